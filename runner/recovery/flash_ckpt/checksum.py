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
_BLOCK_WORDS = 512
_ZERO_WORD = bytes(8)


def digest(buf) -> int:
    """Checksum of a bytes-like object (memoryview, mmap, numpy array, bytes)."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    nwords = raw.size // 8
    full = nwords - nwords % _BLOCK_WORDS
    # einsum sums the rows ~1.5x faster than .sum(axis=1), with the same wrapping uint64 result
    crc = zlib.crc32(np.einsum("ij->i", raw[: full * 8].view(np.uint64).reshape(-1, _BLOCK_WORDS))) if full else 0
    if raw.size > full * 8:  # the words of the last, partial block, then the odd bytes
        crc = zlib.crc32(raw[full * 8 : nwords * 8].view(np.uint64).sum(dtype=np.uint64).tobytes(), crc)
        crc = zlib.crc32(raw[nwords * 8 :], crc)
    else:  # what the two lines above give for an empty tail
        crc = zlib.crc32(_ZERO_WORD, crc)
    return zlib.crc32(raw.size.to_bytes(8, "little"), crc)


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
