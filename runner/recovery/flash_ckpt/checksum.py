"""A checksum fast enough to verify a snapshot inside the restore path.

zlib.crc32 runs at ~4 GB/s on this host, a quarter of memcpy speed, so verifying a snapshot
with it would cost about four copies. Instead every 4 KiB block is summed as uint64 words
(wrapping, numpy, ~25 GB/s, GIL released) and crc32 runs over the short vector of block sums,
the tail and the length. Any change confined to one 8-byte word (a flipped bit or byte, a NaN
written over a value, a zeroed page) changes its block sum; a moved or truncated block changes
the crc. Changes that keep a block's 64-bit sum (two compensating edits inside one block) go
unseen: the price of verifying at memory speed.
"""

from __future__ import annotations

import mmap
import zlib
from pathlib import Path

import numpy as np

ALGORITHM = "bsum64x4k-crc32"
BLOCK_BYTES = 4096
_BLOCK_WORDS = BLOCK_BYTES // 8


def digest(buf) -> int:
    """Checksum of a bytes-like object (memoryview, mmap, numpy array, bytes)."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    nwords = raw.size // 8
    full = nwords - nwords % _BLOCK_WORDS
    # einsum sums the rows ~1.5x faster than .sum(axis=1), with the same wrapping uint64 result
    block_sums = np.einsum("ij->i", raw[: full * 8].view(np.uint64).reshape(-1, _BLOCK_WORDS))
    tail_sum = int(raw[full * 8 : nwords * 8].view(np.uint64).sum(dtype=np.uint64))
    return _finish(block_sums, tail_sum, raw[nwords * 8 :], raw.size)


def seal(sums: np.ndarray, nbytes: int) -> int:
    """``digest`` of `nbytes` bytes (a multiple of 8) from the uint64 sums of their 4 KiB blocks
    (the last one partial or not), as the fused copy kernels compute them."""
    full = nbytes // BLOCK_BYTES
    tail_sum = int(sums[full]) if nbytes % BLOCK_BYTES else 0
    return _finish(sums[:full], tail_sum, b"", nbytes)


def _finish(block_sums: np.ndarray, tail_sum: int, odd_bytes, size: int) -> int:
    """crc32 over the whole blocks' sums, the sum of the words after them, the odd bytes, the size."""
    crc = zlib.crc32(block_sums.data)  # the array's own buffer (numpy's stubs give ndarray no __buffer__)
    crc = zlib.crc32(tail_sum.to_bytes(8, "little"), crc)
    crc = zlib.crc32(odd_bytes, crc)
    return zlib.crc32(size.to_bytes(8, "little"), crc)


def digest_file(path: Path) -> int:
    """Checksum of a file's bytes, read through the page cache without a private copy."""
    with open(path, "rb") as f:
        if not f.seek(0, 2):
            return digest(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                return digest(view)
            finally:
                view.release()
