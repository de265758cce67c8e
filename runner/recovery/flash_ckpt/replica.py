"""Neighbour backup: a copy of a rank's newest snapshot in a segment held by a partner rank.

The copy lives in the segment ``rrflash.<job>.r<owner>.b<holder>``: the name says whose memory it
stands for, and losing the owner's host (its own segments) leaves the backup to restore from, in the
same verified-chunks format as the owner's segment, so restores read it like any other.

Over torch.distributed (``exchange_with_partners``, the callback's ``comm=``): after each snapshot
every rank sends its newest committed snapshot to its holder (a rank on the partner node) and
receives the snapshots of the ranks it holds copies for, on the generation's side group (gloo,
beside the main group). The HOLDER's process writes what it receives into its own host's
/dev/shm and commits it only once all of it arrived and every chunk verifies; anything less
leaves the previous copy in place. ``backup_to_partner`` is the same copy by memcpy on this host
(the callback without ``comm``). A recovery abandons an exchange in flight (``Abandonment``): it
waits for nothing more and commits nothing.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from .chunks import Plan
from .events import EventSink, emit
from .segment import CorruptSnapshot, Slot, encode_meta
from .shm import segment_name
from .slots import SlotWriter, committed_steps, newest_verified

_TAG_BASE = 8  # message tags below are DeadPool's shard replication, on the same side group
_PARTS = 3  # header (step, metadata length, data length), metadata JSON, data region


def backup_to_partner(job_id: str, owner: int, holder: int) -> int:
    """Copy `owner`'s newest verified snapshot into the backup segment `holder` keeps for it.

    Each chunk is checked before it is copied and the copy commits only if all of them match,
    so a corrupt snapshot is never replicated. Returns the step.
    """
    target = segment_name(job_id, owner, holder)
    return newest_verified(segment_name(job_id, owner), lambda path, step: _copy(path, step, target, holder))


def _copy(path: Path, step: int, target: str, holder: int) -> int:
    src = Slot.open(path)
    try:
        src.lock(exclusive=False)
        meta = src.committed_meta(step)
        return _write_backup(target, step, meta, holder,
                             lambda dst, plan: _whole(plan).drain(src.region(), [dst.region().ctypes.data],
                                                                  meta["digests"],
                                                                  lambda c: src.mismatch(meta, plan, c)))
    finally:
        src.close()


class ExchangeFailed(RuntimeError):
    """A message of a partner exchange did not arrive or leave in time, or a recovery abandoned the exchange."""


class Abandonment:
    """Whether a recovery abandoned an exchange: it starts no more waits, and a received copy is committed
    only under the lock ``abandon`` takes, so none is committed after it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._abandoned = False

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True

    def reason(self) -> str | None:
        return "abandoned: a recovery replaced its generation" if self._abandoned else None

    @contextmanager
    def unless_abandoned(self) -> Iterator[None]:
        with self._lock:
            if self._abandoned:
                raise ExchangeFailed(self.reason())
            yield


def exchange_with_partners(pg: Any, job_id: str, rank: int, holder: tuple[int, int] | None,
                           owners: list[tuple[int, int]], step: int, timeout: timedelta,
                           on_event: EventSink = None, abandonment: Abandonment | None = None) -> None:
    """Send this rank's newest snapshot to `holder` and receive the snapshot of each of `owners`.

    `pg` is a gloo group (``Comm.side_pg``; its stubs declare no send/recv), `holder` (None: this
    rank sends nothing) and `owners` are (logical rank, rank in `pg`). Every message of this exchange
    is tagged with `step` (the snapshot step both sides just took), so an exchange one side gave up
    never pairs with a later one. All sends are posted before the first receive and the whole
    exchange ends within `timeout`, so the pairs cannot deadlock; once `abandonment` is set it waits
    for nothing more and commits nothing. Failures are reported as ``backup_failed`` (a copy
    of this rank's that did not leave, or one of an owner's that did not arrive whole), received
    copies as ``backed_up``; neither raises.
    """
    abandonment = abandonment or Abandonment()
    deadline = time.monotonic() + timeout.total_seconds()

    def wait(work: Any) -> None:
        """Wait for `work` until the deadline (not at all once abandoned), then drop it, so that a receive
        given up on never lands in a slot a later exchange reuses; raises ExchangeFailed if it did not end
        well. A gloo send or receive cannot be woken (and a wait that times out closes the connection),
        so a wait under way when the exchange is abandoned ends when the peer answers or at the deadline."""
        left = deadline - time.monotonic()
        failure = abandonment.reason() or (f"timed out after {timeout.total_seconds():.0f}s" if left < 1e-3 else None)
        if failure is None:  # a wait under a millisecond would be read as none at all
            try:
                work.wait(timedelta(seconds=left))
            except RuntimeError as e:
                failure = _reason(e)
        del work
        if failure is not None:
            raise ExchangeFailed(failure)

    tags = [_TAG_BASE + _PARTS * step + part for part in range(_PARTS)]
    with _outgoing(job_id, rank) as (sent_step, messages):
        sends = [] if holder is None else [pg.send([message], holder[1], tag)
                                           for message, tag in zip(messages, tags) if message.numel()]
        headers = [torch.empty(3, dtype=torch.int64) for _ in owners]  # every owner's header is awaited at once
        arrivals = [pg.recv([header], src, tags[0]) for header, (_, src) in zip(headers, owners)]
        for (owner, src), header in zip(owners, headers):
            try:
                wait(arrivals.pop(0))
                got = _receive(pg, job_id, owner, rank, src, header, tags, wait, abandonment)
                emit(on_event, "backed_up", got, f"rank {rank}", f"copy of rank {owner}")
            except Exception as e:
                emit(on_event, "backup_failed", None, f"rank {rank}", f"copy of rank {owner}: {_reason(e)}")
        failure = None
        while sends:  # every send ends, or is given up and dropped, before the slot it reads is closed
            try:
                wait(sends.pop(0))
            except ExchangeFailed as e:
                failure = failure or _reason(e)
    if holder is not None and (sent_step < 0 or failure is not None):
        detail = "no committed snapshot to send" if sent_step < 0 else f"sending step {sent_step}: {failure}"
        emit(on_event, "backup_failed", None, f"rank {holder[0]}", detail)


@contextmanager
def _outgoing(job_id: str, owner: int) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """The newest committed snapshot of `owner` as messages (header, metadata, data region); only a
    header with step -1 if there is none. The slot is read-locked only while its metadata is read: a
    send to a partner that does not answer must not hold up the snapshot that reuses the slot. The
    holder verifies every chunk, so data overwritten while in flight is never committed."""
    for step, path in committed_steps(segment_name(job_id, owner)):
        src = Slot.open(path)
        try:
            src.lock(exclusive=False)
            try:
                meta = src.committed_meta(step)
            except CorruptSnapshot:
                continue
            finally:
                src.unlock()
            raw = encode_meta(meta)
            header = torch.tensor([step, len(raw), meta["data_len"]], dtype=torch.int64)
            yield step, [header, torch.frombuffer(bytearray(raw), dtype=torch.uint8), src.data()[: meta["data_len"]]]
            return
        finally:
            src.close()
    yield -1, [torch.tensor([-1, 0, 0], dtype=torch.int64)]


def _receive(pg: Any, job_id: str, owner: int, holder: int, src: int, header: torch.Tensor, tags: list[int],
             wait: Callable[[Any], None], abandonment: Abandonment) -> int:
    """After its `header` arrived, receive `owner`'s snapshot straight into the backup segment in this
    host's memory, committed unless the exchange was abandoned; returns its step."""
    step, meta_len, data_len = header.tolist()
    if step < 0:
        raise LookupError(f"rank {owner} has no committed snapshot")
    raw = torch.empty(meta_len, dtype=torch.uint8)
    wait(pg.recv([raw], src, tags[1]))
    meta = json.loads(raw.numpy().tobytes())
    if meta.get("step") != step or meta.get("data_len") != data_len:
        raise CorruptSnapshot(f"metadata of rank {owner}'s copy does not match its header")

    def receive_and_verify(dst: Slot, plan: Plan) -> None:
        if data_len:
            wait(pg.recv([dst.data()[:data_len]], src, tags[2]))
        _whole(plan).drain(dst.region(), [None], meta["digests"], lambda c: dst.mismatch(meta, plan, c))

    target = segment_name(job_id, owner, holder)
    return _write_backup(target, step, meta, holder, receive_and_verify, abandonment.unless_abandoned)


def _write_backup(target: str, step: int, owner_meta: dict, holder: int, fill,
                  committing: Callable[[], AbstractContextManager] = nullcontext) -> int:
    """Fill (`fill(slot, plan)`, which raises on any chunk that does not verify) and commit the next
    slot of the backup segment `target`, inside `committing()` (which may refuse it by raising); its
    metadata names the holder and the process that wrote it."""
    meta = {**owner_meta, "holder": holder, "written_by": {"host": socket.gethostname(), "pid": os.getpid()}}
    writer = SlotWriter(target)
    try:
        dst = writer.begin(len(encode_meta(meta)), meta["data_len"])
        try:
            fill(dst, dst.plan(meta))
            with committing():
                writer.commit(dst, step, meta)
        except BaseException:
            writer.abort(dst)
            raise
    finally:
        writer.close()
    return step


def _whole(plan: Plan) -> Plan:
    """The data region as one piece per chunk: it moves whole, and the chunk checksums carry over."""
    return Plan.of([{"path": "data region", "offset": 0, "nbytes": plan.data_len}], plan.data_len, plan.chunk_bytes)


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
