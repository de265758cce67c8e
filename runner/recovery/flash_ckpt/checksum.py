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


def digest(buf) -> int:
    """Checksum of a bytes-like object (memoryview, mmap, numpy array, bytes)."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    nwords = raw.size // 8
    words = raw[: nwords * 8].view(np.uint64)
    full = nwords - nwords % _BLOCK_WORDS
    crc = zlib.crc32(words[:full].reshape(-1, _BLOCK_WORDS).sum(axis=1, dtype=np.uint64))
    crc = zlib.crc32(words[full:].sum(dtype=np.uint64).tobytes(), crc)
    crc = zlib.crc32(raw[nwords * 8 :], crc)
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
