"""The double buffer: which slot of a segment to write next, which commits to read, and pins.

A segment's two slots alternate: the writer always fills the slot that does not hold the newest
commit, so a crash mid-write leaves the previous snapshot current. Readers take the newest slot
that verifies. A persist request pins its slot with a shared lock so the writer waits for it
instead of overwriting a step that still has to reach disk.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from . import codec
from .chunks import address
from .segment import CorruptSnapshot, Slot, encode_meta, read_header, read_header_fd
from .shm import slot_paths

T = TypeVar("T")


def committed_steps(name: str) -> list[tuple[int, Path]]:
    """(step, slot path) of the committed slots of a segment, newest first; not yet verified."""
    found = [(h.step, p) for p in slot_paths(name) if (h := read_header(p)) is not None and h.committed]
    return sorted(found, reverse=True)


def find_step(name: str, step: int) -> Path:
    """The slot of segment `name` that holds a commit of `step`."""
    held = committed_steps(name)
    for s, path in held:
        if s == step:
            return path
    raise LookupError(f"step {step} is not in memory segment {name} (committed steps: {[s for s, _ in held]})")


def newest_verified(name: str, use: Callable[[Path, int], T]) -> T:
    """Apply `use` to the newest committed slot of segment `name` whose data verifies."""
    reasons = []
    for step, path in committed_steps(name):
        try:
            return use(path, step)
        except CorruptSnapshot as e:
            reasons.append(str(e))
    raise LookupError(f"no committed snapshot in {name} verifies ({'; '.join(reasons) or 'none committed'})")


def load_slot(path: Path, *, step: int | None = None, into: Any = None,
              new: Callable[[list[int], torch.dtype], torch.Tensor] | None = None) -> tuple[dict, Any]:
    """Copy a committed slot's state out into private tensors (never views into shm), verifying
    each chunk's checksum in the copy; raises CorruptSnapshot on a mismatch.

    `into` is a state of the same structure (e.g. the live checkpoint dict); a tensor of the same
    shape and dtype at a tensor's position there is filled in place instead of allocating a new
    one; other tensors come from `new(shape, dtype)` (default ``torch.empty``). After a
    CorruptSnapshot those tensors hold partly copied data: the caller loads another snapshot or
    gives up.
    """
    slot = Slot.open(path)
    try:
        slot.lock(exclusive=False)
        meta = slot.committed_meta(step)
        plan = slot.plan(meta)
        targets = codec.tensors_at(meta["skeleton"], into) if into is not None else {}
        dsts = []
        for index, entry in enumerate(meta["tensors"]):
            dst = targets.get(index)
            if dst is None or list(dst.shape) != entry["shape"] or codec.dtype_name(dst.dtype) != entry["dtype"]:
                dtype = codec.dtype_from_name(entry["dtype"])
                dst = new(entry["shape"], dtype) if new is not None else torch.empty(entry["shape"], dtype=dtype)
            if dst.numel() * dst.element_size() != entry["nbytes"]:
                raise CorruptSnapshot(f"{path.name}: tensor {entry['path']} has {entry['nbytes']} bytes "
                                      f"for its shape {entry['shape']}")
            dsts.append(dst)
        addrs = [address(dst) for dst in dsts]
        with ThreadPoolExecutor(1, thread_name_prefix="flash-restore") as helper:
            plan.drain(slot.region(), addrs, meta["digests"], lambda c: slot.mismatch(meta, plan, c), helper)
        for entry, dst, addr in zip(meta["tensors"], dsts, addrs):
            if addr is None:  # a strided or device target: its chunks are verified by now
                dst.copy_(slot.view(entry))
    finally:
        slot.close()
    return meta, codec.unflatten(meta["skeleton"], dsts)


def pin_step(name: str, step: int) -> int:
    """Hold a shared lock on the slot with `step` so no writer reuses it; returns the fd to close."""
    path = find_step(name, step)
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    header = read_header_fd(fd)
    if header is None or not header.committed or header.step != step:
        os.close(fd)
        raise LookupError(f"step {step} left {path.name} before it could be pinned")
    return fd


class SlotWriter:
    """Owns both slots of one segment for writing and always fills the one that is not the newest commit."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.paths = slot_paths(name)
        self._open: dict[Path, Slot] = {}

    def begin(self, meta_len: int, data_len: int) -> Slot:
        """Lock the target slot exclusively (waiting for pins on it), size it, clear its flag."""
        path = self._target()
        slot = self._open.pop(path, None)
        if slot is None and path.exists():  # left by an earlier incarnation of this rank
            slot = Slot.open(path, writable=True)
            slot._prefault()
        if slot is not None:
            slot.lock(exclusive=True)
            if not slot.fits(meta_len, data_len):
                path.unlink()
                slot.close()
                slot = None
        if slot is None:
            sibling_missing = not any(p.exists() for p in self.paths if p != path)
            slot = Slot.create(path, meta_len, data_len, with_sibling=sibling_missing)
        self._open[path] = slot
        slot.mark_uncommitted()
        return slot

    def commit(self, slot: Slot, step: int, meta: dict[str, Any]) -> None:
        try:
            slot.commit(step, encode_meta(meta))
        finally:
            slot.unlock()

    def abort(self, slot: Slot) -> None:
        """Give up a write: the slot stays uncommitted, the other slot keeps the last commit."""
        slot.unlock()

    def _target(self) -> Path:
        headers = [(read_header(p), p) for p in self.paths]
        free = [p for h, p in headers if h is None or not h.committed]
        if free:
            return free[0]
        committed = [(h.step, p) for h, p in headers if h is not None]  # all of them: none is free
        return min(committed, key=lambda sp: sp[0])[1]

    def invalidate_after(self, step: int) -> list[int]:
        """Uncommit slots newer than `step` (an abandoned timeline after a rollback); returns their steps."""
        dropped = []
        for path in self.paths:
            if not path.exists():
                continue
            slot = self._open.get(path) or Slot.open(path, writable=True)
            self._open[path] = slot
            slot.lock(exclusive=True)
            try:
                h = slot.header()
                if h is not None and h.committed and h.step > step:
                    slot.mark_uncommitted()
                    dropped.append(h.step)
            finally:
                slot.unlock()
        return dropped

    def close(self, unlink: bool = False) -> None:
        for slot in self._open.values():
            slot.close()
        self._open.clear()
        if unlink:
            for path in self.paths:
                path.unlink(missing_ok=True)
