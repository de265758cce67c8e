"""Copy tensor bytes into or out of a slot's data region and checksum them in the same pass.

Verifying a restore with a checksum pass of its own costs about a third of the copy again here
(numpy sums cached data at ~55 GB/s; the copy is bound by memory bandwidth): a restore at ~1.35x
the memcpy floor instead of ~1.0x. A loop that adds every 8-byte word to its block's sum while it
moves the word costs nothing extra, as the additions run while the core waits on memory, and with
streaming (non-temporal) stores, which skip reading the destination lines into the cache first,
it moves less data than ``Tensor.copy_`` and beats it (0.7-0.95x). numpy and torch have no fused
copy-and-reduce, so these loops are compiled with numba (cached on disk after the first compile,
GIL released so that two threads copy at once).

Both kernels walk chunks ``[c0, c1)`` of a plan (chunks.Plan) and add to ``sums`` the wrapping
uint64 sum of every 4 KiB block of the region (checksum.BLOCK_BYTES), which checksum.seal turns
into the digest that checksum.digest computes from the bytes. Tensors are given by address
(0: not copied here), the region too (a read-only mapping is only read); piece tables are int64
arrays in region order, chunk c's pieces being ``first[c]:first[c + 1]``. Every address and the
data length must be multiples of 8 (chunks.address and chunks.Plan ensure it).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# numba's own annotations count an intrinsic's typingctx as an argument of its call and give a
# compiled function's (Dispatcher's) call none, so mypy rejects the calls marked `type: ignore[call-arg]`
_BLOCK_SHIFT = 9  # 512 words = 4 KiB, checksum.BLOCK_BYTES
_BLOCK_BYTES = 8 << _BLOCK_SHIFT
_OUT, _IN, _SUM, _ZERO = 0, 1, 2, 3  # what a walk does to region words: copy out/in, only sum, zero


@intrinsic
def _pointer(typingctx, address):
    """An integer address as a void pointer, so carray can view memory that numpy does not own."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen


@intrinsic
def _store_streaming(typingctx, address, index, value):
    """``((uint64 *) address)[index] = value`` as a non-temporal store: the line goes to memory
    without first being read into the cache, which is what makes a plain copy loop as fast as
    memcpy here (and the fused copy-and-sum faster than ``Tensor.copy_``)."""
    if not (isinstance(address, types.Integer) and isinstance(index, types.Integer) and value == types.uint64):
        return None

    def codegen(context, builder, signature, args):
        base, i, v = args
        word = builder.gep(builder.inttoptr(base, ir.PointerType(ir.IntType(64))), [i], inbounds=True)
        store = builder.store(v, word, align=8)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return types.void(address, index, value), codegen


@intrinsic
def _store_fence(typingctx):
    """Order the streaming stores before anything that follows (the commit flag, another reader)."""

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@njit(nogil=True, cache=True)
def _stream(src, dst_address):
    """Copy the words of `src` to `dst_address` with streaming stores; returns their wrapping sum."""
    acc = np.uint64(0)
    for i in range(src.size):
        v = src[i]
        _store_streaming(dst_address, i, v)  # type: ignore[call-arg]  # numba's types, see above
        acc += v
    return acc


@njit(nogil=True, cache=True)
def _walk(words, w0, w1, other, mode, sums):
    """Region words [w0, w1) against the tensor bytes at address `other` (for word w0), block
    by block, adding each block's sum to `sums`. Loops index slices from 0 so that numba adds no
    wraparound check for negative indices (which costs 5x here)."""
    w = w0
    while w < w1:
        block = w >> _BLOCK_SHIFT
        stop = min(w1, (block + 1) << _BLOCK_SHIFT)
        region = words[w:stop]
        if mode == _OUT:
            acc = _stream(region, other + (w - w0) * 8)
        elif mode == _IN:
            src = carray(_pointer(other + (w - w0) * 8), stop - w, np.uint64)  # type: ignore[call-arg]  # numba's types, see above
            acc = _stream(src, region.ctypes.data)
        elif mode == _SUM:
            acc = np.uint64(0)
            for i in range(region.size):
                acc += region[i]
        else:
            region[:] = 0
            acc = np.uint64(0)
        sums[block] += acc
        w = stop


@njit(nogil=True, cache=True)
def _chunks(region_addr, data_len, chunk_bytes, c0, c1, first, region_off, index, tensor_off, nbytes, addrs, copy_in,
            sums):
    words = carray(_pointer(region_addr), data_len >> 3, np.uint64)  # type: ignore[call-arg]  # numba's types, see above
    scratch = np.zeros(1, dtype=np.uint64)
    tail_bytes = scratch.view(np.uint8)
    for c in range(c0, c1):
        pos = c * chunk_bytes  # region byte offset reached so far, always word aligned
        for p in range(first[c], first[c + 1]):
            start, n, addr = region_off[p], nbytes[p], addrs[index[p]]
            if start > pos:  # alignment padding: kept as written (out) or zeroed (in)
                _walk(words, pos >> 3, start >> 3, 0, _SUM if not copy_in else _ZERO, sums)
            full = n >> 3
            if addr == 0:  # the caller copies this tensor itself: only its region bytes are summed
                _walk(words, start >> 3, (start + n + 7) >> 3, 0, _SUM, sums)
            else:
                base = addr + tensor_off[p]
                _walk(words, start >> 3, (start >> 3) + full, base, _IN if copy_in else _OUT, sums)
                rest = n - full * 8
                if rest:  # a last partial word: its bytes, then zeros, in the region
                    tensor_tail = carray(_pointer(base + full * 8), rest, np.uint8)
                    w = (start >> 3) + full
                    if copy_in:
                        scratch[0] = 0
                        tail_bytes[:rest] = tensor_tail
                        words[w] = scratch[0]
                    else:
                        scratch[0] = words[w]
                        tensor_tail[:] = tail_bytes[:rest]
                    sums[w >> _BLOCK_SHIFT] += words[w]
            pos = start + ((n + 7) & ~7)
        stop = min((c + 1) * chunk_bytes, data_len)
        if stop > pos:
            _walk(words, pos >> 3, stop >> 3, 0, _SUM if not copy_in else _ZERO, sums)
    _store_fence()


def copy_out(region_addr: int, data_len: int, chunk_bytes: int, c0: int, c1: int, tables: tuple,
             addrs: np.ndarray, sums: np.ndarray) -> None:
    """Copy the pieces of chunks [c0, c1) from the region at `region_addr` to the tensors at
    `addrs`, summing every region word (padding included) into `sums`."""
    _chunks(region_addr, data_len, chunk_bytes, c0, c1, *tables, addrs, False, sums)  # type: ignore[call-arg]  # numba's types, see above


def copy_in(region_addr: int, data_len: int, chunk_bytes: int, c0: int, c1: int, tables: tuple,
            addrs: np.ndarray, sums: np.ndarray) -> None:
    """Copy the pieces of chunks [c0, c1) from the tensors at `addrs` into the region at
    `region_addr`, zeroing the padding between them, summing every region word into `sums`."""
    _chunks(region_addr, data_len, chunk_bytes, c0, c1, *tables, addrs, True, sums)  # type: ignore[call-arg]  # numba's types, see above


def warm_up() -> None:
    """Load the kernels (from numba's cache, else compile them) now instead of in the first copy:
    a fresh process pays ~0.3 s for it, which a restarting rank can spend while it starts."""
    region = np.zeros(8, dtype=np.uint8)
    no_pieces = np.zeros(0, dtype=np.int64)
    tables = (np.zeros(2, dtype=np.int64), no_pieces, no_pieces, no_pieces, no_pieces)
    copy_in(region.ctypes.data, 8, _BLOCK_BYTES, 0, 1, tables, np.zeros(1, dtype=np.int64),
            np.zeros(1, dtype=np.uint64))
