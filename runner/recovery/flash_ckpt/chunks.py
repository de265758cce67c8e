"""Copies between tensors and a slot's data region, one checksummed chunk at a time.

The data region is cut into fixed-size chunks (1 MiB, half a core's L2 here) and each chunk has
its own checksum. A copy goes chunk by chunk: a restore checksums a source chunk and then copies
its tensor pieces while the chunk is in the cache; a snapshot copies the pieces in and checksums
the chunk while it is still cached. Verifying thus costs little beyond the copy. Where the caller
waits anyway, two threads take alternate chunks (memmove and the checksum release the GIL), which
a copy needs on this host to reach the memory bandwidth that ``Tensor.copy_`` gets from its two
intra-op threads. A tensor is handled by its address and length only: a numpy or torch view per
tensor costs ~10 us, which over a few hundred small tensors is a third of a 200 MB copy.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from .checksum import digest

CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Piece:
    """The bytes of tensor `index` from `tensor_off` on that lie in one chunk, at `region_off`."""

    index: int
    region_off: int
    tensor_off: int
    nbytes: int


@dataclass(frozen=True)
class Plan:
    """Which tensor pieces lie in each chunk of the first `data_len` bytes of a region."""

    data_len: int
    chunk_bytes: int
    chunks: list[list[Piece]]

    @classmethod
    def of(cls, entries: Sequence[dict], data_len: int, chunk_bytes: int = CHUNK_BYTES) -> Plan:
        """Cut a layout (segment.plan_layout's entries) into chunks; ValueError if it leaves the region."""
        if chunk_bytes < 1:
            raise ValueError(f"chunk size {chunk_bytes} must be positive")
        chunks: list[list[Piece]] = [[] for _ in range(-(-data_len // chunk_bytes))]
        for index, entry in enumerate(entries):
            start, end = entry["offset"], entry["offset"] + entry["nbytes"]
            if start < 0 or end > data_len:
                raise ValueError(f"tensor {entry['path']} lies outside the data region")
            pos = start
            while pos < end:
                c = pos // chunk_bytes
                stop = min(end, (c + 1) * chunk_bytes)
                chunks[c].append(Piece(index, pos, pos - start, stop - pos))
                pos = stop
        return cls(data_len, chunk_bytes, chunks)

    def span(self, c: int) -> slice:
        return slice(c * self.chunk_bytes, min((c + 1) * self.chunk_bytes, self.data_len))

    def fill(self, region: np.ndarray, srcs: list[int | None], with_digests: bool,
             helper: Executor | None = None) -> list[int] | None:
        """Copy the tensors at addresses `srcs` into `region` (None: the caller copied that one);
        with `with_digests`, checksum each chunk right after filling it and return the checksums."""
        base = region.ctypes.data
        digests = [0] * len(self.chunks)

        def run(part: list[int]) -> None:
            for c in part:
                for p in self.chunks[c]:
                    if srcs[p.index] is not None:
                        ctypes.memmove(base + p.region_off, srcs[p.index] + p.tensor_off, p.nbytes)
                if with_digests:
                    digests[c] = digest(region[self.span(c)])

        _in_two_streams(list(range(len(self.chunks))), run, helper)
        return digests if with_digests else None

    def drain(self, region: np.ndarray, dsts: list[int | None], expected: list[int],
              on_mismatch: Callable[[int], Exception], helper: Executor | None = None) -> None:
        """Checksum each chunk of `region` against `expected`, then copy its pieces to the tensors at
        addresses `dsts` (None: the caller copies that one afterwards); raises `on_mismatch(chunk)`."""
        base = region.ctypes.data

        def run(part: list[int]) -> None:
            for c in part:
                if digest(region[self.span(c)]) != expected[c]:
                    raise on_mismatch(c)
                for p in self.chunks[c]:
                    if dsts[p.index] is not None:
                        ctypes.memmove(dsts[p.index] + p.tensor_off, base + p.region_off, p.nbytes)

        _in_two_streams(list(range(len(self.chunks))), run, helper)

    def digests(self, region: np.ndarray) -> list[int]:
        """Checksums of every chunk of `region`, as a pass of its own."""
        return [digest(region[self.span(c)]) for c in range(len(self.chunks))]


def address(t: torch.Tensor) -> int | None:
    """Address of a tensor's bytes if they are plain CPU memory; None: copy it with copy_."""
    return t.data_ptr() if t.device.type == "cpu" and t.is_contiguous() else None


def _in_two_streams(items: list[int], fn: Callable[[list[int]], None], helper: Executor | None) -> None:
    """Run `fn` over alternate items on the caller and on `helper` at once; without one, on the caller."""
    if helper is None:
        fn(items)
        return
    other = helper.submit(fn, items[1::2])
    try:
        fn(items[::2])
    finally:
        other.result()
