"""The slot file format and the IO on one slot (slots.py alternates the two slots of a segment).

A segment is a pair of slot files (double buffer). Each slot describes itself, so a restarted
trainer or a persister in another process needs nothing else alive to use it:

    page 0            fixed header: magic, version, committed flag, step, offsets and
                      capacities of the two regions, length and checksum of the metadata,
                      pid and parent pid of the last writer (for stale-segment cleanup)
    page 1 ...        metadata JSON (capacity meta_cap): job, owner, holder, step, checksum
                      algorithm, the layout (path, dtype, shape, offset, nbytes per tensor),
                      the data length, one checksum per 1 MiB chunk of the data (chunks.py)
                      and the JSON skeleton of the non-tensor state
    data_off ...      tensor bytes, each at a 64-byte aligned offset (capacity data_cap)

Writers clear the committed flag, write data and metadata, then write the header and set the
flag last; the other slot keeps the previous commit meanwhile. flock() orders writers against
readers across processes: a writer holds LOCK_EX on the slot it fills, readers and persist pins
hold LOCK_SH, and the kernel drops the locks of a process that dies.

Mapping a slot costs page-table work for every 4 KiB page (~0.4x of copying it here), so a reader
in a process that also writes the slot (an in-process restore) reads through the writer's
mapping, and a restarted rank through the mapping it made while starting (prefetch.py), instead
of mapping the file again.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checksum import ALGORITHM, digest
from .chunks import CHUNK_BYTES, Plan
from .codec import Flat, dtype_from_name, dtype_name
from .shm import ensure_space, free_bytes, space_error

MAGIC = b"RRFLASH\0"
VERSION = 2
PAGE = mmap.PAGESIZE
ALIGN = 64
_MIN_META_CAP = 64 * 1024
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
# magic, version, committed, step, meta_off, meta_cap, meta_len, data_off, data_cap, meta_digest, pid, ppid
_HEADER = struct.Struct("<8sIIqQQQQQIII")
_COMMITTED = struct.Struct("<I")
_COMMITTED_AT = 12


# (st_dev, st_ino) of a slot file -> the Slot that has it mapped for writing in this process
_WRITERS: dict[tuple[int, int], Slot] = {}
# (st_dev, st_ino) of a slot file -> (descriptor, read-only mapping) made ahead of a restore (prefetch.py)
_READERS: dict[tuple[int, int], tuple[int, mmap.mmap]] = {}


class CorruptSnapshot(Exception):
    """A slot that must not be loaded: uncommitted, wrong step, bad header, metadata or tensor."""


@dataclass(frozen=True)
class Header:
    committed: bool
    step: int
    meta_off: int
    meta_cap: int
    meta_len: int
    data_off: int
    data_cap: int
    meta_digest: int
    pid: int
    ppid: int


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def read_header(path: Path) -> Header | None:
    """The fixed header of a slot file, or None if the file is not (yet) a slot of this version."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return read_header_fd(fd)
    finally:
        os.close(fd)


def read_header_fd(fd: int) -> Header | None:
    return _parse_header(os.pread(fd, _HEADER.size, 0))


def _parse_header(raw: bytes) -> Header | None:
    if len(raw) < _HEADER.size:
        return None
    magic, version, committed, *rest = _HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION:
        return None
    return Header(committed == 1, *rest)


def plan_layout(flat: Flat) -> tuple[list[dict[str, Any]], int]:
    """Byte layout of the tensors in the data region; returns (entries, data length)."""
    entries, offset = [], 0
    for path, t in zip(flat.paths, flat.tensors):
        nbytes = t.numel() * t.element_size()
        entries.append({"path": path, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": offset,
                        "nbytes": nbytes})
        offset = _round_up(offset + nbytes, ALIGN)
    return entries, offset


def snapshot_meta(job_id: str, owner: int, holder: int | None, step: int, tensors: list[dict], skeleton: Any,
                  data_len: int, digests: list[int]) -> dict[str, Any]:
    """The metadata JSON of a slot; `holder` is None for the owner's own copy, `digests` has one
    checksum per CHUNK_BYTES of the first `data_len` bytes of the data region."""
    return {"format": VERSION, "job_id": job_id, "owner": owner, "holder": holder, "step": step,
            "checksum": ALGORITHM, "chunk_bytes": CHUNK_BYTES, "data_len": data_len, "digests": digests,
            "tensors": tensors, "skeleton": skeleton}


def encode_meta(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, separators=(",", ":")).encode()


class Slot:
    """One mapped slot file; writers map it read-write, readers read-only."""

    def __init__(self, path: Path, fd: int, writable: bool) -> None:
        self.path, self._fd, self._writable = path, fd, writable
        st = os.fstat(fd)
        self._key = (st.st_dev, st.st_ino)
        self._mm = None if writable else _existing_mapping(self._key, st.st_size)
        if self._mm is None and st.st_size:
            self._mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        if writable:
            _WRITERS[self._key] = self
        self._bytes: torch.Tensor | None = None

    @classmethod
    def open(cls, path: Path, writable: bool = False) -> Slot:
        return cls(path, os.open(path, os.O_RDWR if writable else os.O_RDONLY), writable)

    @classmethod
    def create(cls, path: Path, meta_len: int, data_len: int, with_sibling: bool) -> Slot:
        """Create, allocate and pre-fault a slot for this much metadata and data, locked
        exclusively. `with_sibling` checks /dev/shm for the pair's other slot too."""
        meta_cap = _round_up(max(_MIN_META_CAP, 2 * meta_len), PAGE)
        data_cap = _round_up(max(data_len, 1), PAGE)
        data_off = PAGE + meta_cap
        size = data_off + data_cap
        ensure_space(size * (2 if with_sibling else 1),
                     f"{path.name}" + (" and its sibling slot" if with_sibling else ""))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise space_error(size, free_bytes(), path.name) from e
                raise
            slot = cls(path, fd, writable=True)
            slot._prefault()
            slot._write_header(False, -1, meta_cap, 0, data_off, data_cap, 0)
            return slot
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise

    def _mapping(self) -> mmap.mmap:
        """The mapping, which every slot that has a size holds from open to close."""
        assert self._mm is not None  # only an empty (just created by another process) or closed slot has none
        return self._mm

    def _laid_out(self) -> Header:
        """The header of a slot whose creator has laid it out (every slot one writes to or reads data from)."""
        h = self.header()
        assert h is not None  # create() writes the header before the slot is handed out
        return h

    def _prefault(self) -> None:
        """Map every page now, so the first snapshot copy runs at memcpy speed, not page-fault speed."""
        mm = self._mapping()
        try:
            mm.madvise(_MADV_POPULATE_WRITE)
        except (OSError, AttributeError):
            np.frombuffer(mm, dtype=np.uint8)[::PAGE] = 0

    def lock(self, exclusive: bool) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)

    def unlock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def header(self) -> Header | None:
        return _parse_header(self._mm[: _HEADER.size]) if self._mm is not None else None

    def fits(self, meta_len: int, data_len: int) -> bool:
        h = self.header()
        return h is not None and h.meta_cap >= meta_len and h.data_cap >= data_len

    def committed_meta(self, step: int | None = None) -> dict[str, Any]:
        """Metadata of a committed slot, checked against its digest (and `step` if given)."""
        h = self.header()
        if h is None:
            raise CorruptSnapshot(f"{self.path.name}: no valid header")
        if not h.committed:
            raise CorruptSnapshot(f"{self.path.name}: not committed (empty or a write was interrupted)")
        if step is not None and h.step != step:
            raise CorruptSnapshot(f"{self.path.name}: holds step {h.step}, not {step}")
        mm = self._mapping()
        if h.meta_len > h.meta_cap or h.data_off + h.data_cap > len(mm):
            raise CorruptSnapshot(f"{self.path.name}: header regions exceed the file")
        raw = memoryview(mm)[h.meta_off : h.meta_off + h.meta_len]
        try:
            if digest(raw) != h.meta_digest:
                raise CorruptSnapshot(f"{self.path.name}: metadata checksum mismatch")
            meta = json.loads(bytes(raw))
        finally:
            raw.release()
        if meta.get("step") != h.step or meta.get("checksum") != ALGORITHM or meta.get("data_len", -1) > h.data_cap:
            raise CorruptSnapshot(f"{self.path.name}: metadata does not match the header")
        return meta

    def plan(self, meta: dict[str, Any]) -> Plan:
        """The chunks of a committed slot's data region (segment metadata already verified)."""
        try:
            plan = Plan.of(meta["tensors"], meta["data_len"], meta["chunk_bytes"])
        except ValueError as e:
            raise CorruptSnapshot(f"{self.path.name}: {e}") from e
        if len(meta["digests"]) != plan.nchunks:
            raise CorruptSnapshot(f"{self.path.name}: {len(meta['digests'])} chunk checksums for {plan.nchunks} chunks")
        return plan

    def mismatch(self, meta: dict[str, Any], plan: Plan, chunk: int) -> CorruptSnapshot:
        """The error for a chunk whose bytes fail their checksum, naming the tensors in it."""
        names = dict.fromkeys(meta["tensors"][i]["path"] for i in plan.tensors_in(chunk))
        span = plan.span(chunk)
        return CorruptSnapshot(f"{self.path.name}: checksum mismatch in data bytes {span.start}-{span.stop} "
                               f"(tensors {', '.join(names) or 'none: alignment padding'})")

    def data(self) -> torch.Tensor:
        """The data region as a uint8 tensor aliasing the mapping (never handed to callers)."""
        if self._bytes is None:
            h = self._laid_out()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only mappings are only read
                self._bytes = torch.frombuffer(self._mapping(), dtype=torch.uint8, count=h.data_cap, offset=h.data_off)
        return self._bytes

    def view(self, entry: dict[str, Any]) -> torch.Tensor:
        """The tensor described by a layout entry, as a view into the mapping."""
        raw = self.data()[entry["offset"] : entry["offset"] + entry["nbytes"]]
        return raw.view(dtype_from_name(entry["dtype"])).view(entry["shape"])

    def region(self) -> np.ndarray:
        """The data region as a uint8 numpy array aliasing the mapping (for chunked copies)."""
        return self.data().numpy()

    def mark_uncommitted(self) -> None:
        self._mapping()[_COMMITTED_AT : _COMMITTED_AT + 4] = _COMMITTED.pack(0)

    def commit(self, step: int, meta_bytes: bytes) -> None:
        """Write metadata and header, then set the committed flag as the very last store."""
        h, mm = self._laid_out(), self._mapping()
        if len(meta_bytes) > h.meta_cap:
            raise ValueError(f"{self.path.name}: metadata of {len(meta_bytes)} B exceeds capacity {h.meta_cap} B")
        mm[h.meta_off : h.meta_off + len(meta_bytes)] = meta_bytes
        self._write_header(False, step, h.meta_cap, len(meta_bytes), h.data_off, h.data_cap, digest(meta_bytes))
        mm[_COMMITTED_AT : _COMMITTED_AT + 4] = _COMMITTED.pack(1)

    def _write_header(self, committed: bool, step: int, meta_cap: int, meta_len: int, data_off: int, data_cap: int,
                      meta_digest: int) -> None:
        self._mapping()[: _HEADER.size] = _HEADER.pack(
            MAGIC, VERSION, int(committed), step, PAGE, meta_cap, meta_len, data_off, data_cap, meta_digest,
            os.getpid(), os.getppid(),
        )

    def close(self) -> None:
        """Drop the mapping (freed once no view is left) and the descriptor, which releases locks."""
        if self._writable and _WRITERS.get(self._key) is self:
            del _WRITERS[self._key]
        self._bytes = None
        self._mm = None
        os.close(self._fd)


def map_for_reading(path: Path) -> mmap.mmap | None:
    """Map a slot read-only now, for this process's later readers to use instead of mapping it
    again (``Slot.open``); None if the file is gone. ``unmap_for_reading`` forgets it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    st = os.fstat(fd)
    if not st.st_size:
        os.close(fd)
        return None
    mapping = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
    old = _READERS.pop((st.st_dev, st.st_ino), None)
    if old is not None:
        os.close(old[0])
    _READERS[(st.st_dev, st.st_ino)] = (fd, mapping)
    return mapping


def unmap_for_reading(mapping: mmap.mmap) -> None:
    for key, (fd, held) in list(_READERS.items()):
        if held is mapping:
            del _READERS[key]
            os.close(fd)


def _existing_mapping(key: tuple[int, int], size: int) -> mmap.mmap | None:
    """This process's mapping of the file `key` if it has one of `size` bytes: the writer's, or one
    made ahead for reading. The file must still be linked: an unlinked file's inode number can be
    reused."""
    writer = _WRITERS.get(key)
    if writer is not None and writer._mm is not None:
        fd, mapping = writer._fd, writer._mm
    elif key in _READERS:
        fd, mapping = _READERS[key]
    else:
        return None
    try:
        linked = os.fstat(fd).st_nlink > 0
    except OSError:
        return None
    return mapping if linked and len(mapping) == size else None
