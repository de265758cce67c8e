"""Copies between tensors and a slot's data region, with a checksum per 1 MiB chunk.

The data region is cut into fixed-size chunks and each chunk has its own checksum, so a
corrupt snapshot names the tensors it hit. The copy and the checksum are one pass (kernels.py):
a snapshot sums the words it writes into the region, a restore the words it reads out of it, so
verifying costs nothing beyond the copy. Where the caller waits anyway, two threads take one half
of the chunks each (the kernels release the GIL), which a copy needs on this host to reach the
memory bandwidth that ``Tensor.copy_`` gets from its two intra-op threads. A tensor is handled by
its address and length only: a numpy or torch view per tensor costs ~10 us, which over a few
hundred small tensors is a third of a 200 MB copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import torch

from .checksum import BLOCK_BYTES, seal

# kernels.copy_in / copy_out: (region_addr, data_len, chunk_bytes, c0, c1, tables, addrs, sums)
CopyKernel = Callable[[int, int, int, int, int, tuple, np.ndarray, np.ndarray], None]

CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Plan:
    """Which tensor pieces lie in each chunk of the first `data_len` bytes of a region, as the
    int64 tables the copy kernels take: chunk c holds pieces ``first[c]:first[c + 1]``, piece p
    is ``nbytes[p]`` bytes of tensor ``index[p]`` from ``tensor_off[p]`` on, at ``region_off[p]``."""

    data_len: int
    chunk_bytes: int
    first: np.ndarray
    region_off: np.ndarray
    index: np.ndarray
    tensor_off: np.ndarray
    nbytes: np.ndarray

    @classmethod
    def of(cls, entries: Sequence[dict], data_len: int, chunk_bytes: int = CHUNK_BYTES) -> Plan:
        """Cut a layout (segment.plan_layout's entries) into chunks; ValueError if it leaves the
        region, overlaps itself or is not word aligned (the kernels copy 8-byte words)."""
        if chunk_bytes < 1 or chunk_bytes % BLOCK_BYTES:
            raise ValueError(f"chunk size {chunk_bytes} must be a positive multiple of {BLOCK_BYTES}")
        if data_len < 0 or data_len % 8:
            raise ValueError(f"data length {data_len} must be a multiple of 8")
        nchunks = -(-data_len // chunk_bytes)
        counts = [0] * nchunks
        rows: list[tuple[int, int, int, int]] = []
        end = 0
        for index, entry in enumerate(entries):
            start = entry["offset"]
            if start < end or start % 8 or start + entry["nbytes"] > data_len:
                raise ValueError(f"tensor {entry['path']} overlaps another, is not 8-byte aligned "
                                 "or lies outside the data region")
            pos, end = start, start + entry["nbytes"]
            while pos < end:
                c = pos // chunk_bytes
                stop = min(end, (c + 1) * chunk_bytes)
                rows.append((pos, index, pos - start, stop - pos))
                counts[c] += 1
                pos = stop
        table = np.array(rows, dtype=np.int64).reshape(-1, 4)
        first = np.zeros(nchunks + 1, dtype=np.int64)
        np.cumsum(counts, out=first[1:])
        return cls(data_len, chunk_bytes, first, *(np.ascontiguousarray(col) for col in table.T))

    @property
    def nchunks(self) -> int:
        return len(self.first) - 1

    def span(self, c: int) -> slice:
        return slice(c * self.chunk_bytes, min((c + 1) * self.chunk_bytes, self.data_len))

    def tensors_in(self, c: int) -> list[int]:
        """Indices of the tensors with bytes in chunk c, in region order."""
        return self.index[self.first[c] : self.first[c + 1]].tolist()

    def fill(self, region: np.ndarray, srcs: list[int | None], helper: Executor | None = None) -> list[int]:
        """Copy the tensors at addresses `srcs` into `region` (None: the caller copied that one)
        and zero the padding between them; returns each chunk's checksum, computed in the copy."""
        from . import kernels  # numba is imported by the runs that copy, not by every import of the package

        return self._run(kernels.copy_in, region, srcs, helper)

    def drain(self, region: np.ndarray, dsts: list[int | None], expected: list[int],
              on_mismatch: Callable[[int], Exception], helper: Executor | None = None) -> None:
        """Copy each chunk's pieces from `region` to the tensors at addresses `dsts` (None: the
        caller copies that one afterwards), checksumming the chunk in the copy; raises
        `on_mismatch(chunk)` for the first chunk whose checksum is not the `expected` one, after
        which the tensors hold unverified bytes."""
        from . import kernels

        for c, (got, want) in enumerate(zip(self._run(kernels.copy_out, region, dsts, helper), expected)):
            if got != want:
                raise on_mismatch(c)

    def _run(self, kernel: CopyKernel, region: np.ndarray, addrs: list[int | None],
             helper: Executor | None) -> list[int]:
        """Run a copy kernel over all chunks, the two halves at once on the caller and `helper`."""
        sums = np.zeros(-(-self.data_len // BLOCK_BYTES), dtype=np.uint64)
        args = (region.ctypes.data, self.data_len, self.chunk_bytes)
        tables = (self.first, self.region_off, self.index, self.tensor_off, self.nbytes)
        table = np.array([a or 0 for a in addrs] or [0], dtype=np.int64)
        half = (self.nchunks + 1) // 2 if helper is not None else self.nchunks
        other = None
        if helper is not None and half < self.nchunks:  # with no helper, half is every chunk
            other = helper.submit(kernel, *args, half, self.nchunks, tables, table, sums)
        try:
            kernel(*args, 0, half, tables, table, sums)
        finally:
            if other is not None:
                other.result()
        per_chunk = self.chunk_bytes // BLOCK_BYTES
        return [seal(sums[c * per_chunk : (c + 1) * per_chunk], self.span(c).stop - self.span(c).start)
                for c in range(self.nchunks)]


def address(t: torch.Tensor) -> int | None:
    """Address of a tensor's bytes if the kernels can copy them (plain CPU memory, contiguous,
    8-byte aligned); None: copy it with copy_."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.data_ptr() % 8:
        return None
    return t.data_ptr()
