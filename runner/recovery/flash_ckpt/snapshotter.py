"""In-process snapshots of one rank's state into its /dev/shm segment.

Parameters and optimizer state only change in the optimizer step, so a snapshot taken after
step k can be copied while forward/backward of step k+1 run: ``save_async`` keeps references
and returns, a background thread copies into the slot that is not the newest commit (checksumming
each chunk as it lands) and commits, and ``wait`` (called right before the next optimizer step)
blocks only for what is left. ``save`` copies (and checksums, in the same pass) in the caller
and leaves the commit to the thread.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from .chunks import CHUNK_BYTES, Plan, address
from .codec import Flat, flatten
from .events import EventSink, emit
from .segment import Slot, encode_meta, plan_layout, snapshot_meta
from .shm import check_job_id, segment_name
from .slots import SlotWriter

_DIGEST_BOUND = 2**32 - 1  # widest digest, used to size the metadata before digests exist


@dataclass
class _Job:
    step: int
    flat: Flat
    entries: list[dict[str, Any]]
    data_len: int
    digests: list[int] | None = None  # one per chunk of the data region, once computed
    copy_s: float = 0.0


class Snapshotter:
    """Double-buffered shared-memory snapshots of one rank; one save in flight at a time."""

    def __init__(self, job_id: str, rank: int, *, on_event: EventSink = None) -> None:
        self.job_id = check_job_id(job_id)
        self.rank = rank
        self.segment = segment_name(job_id, rank)
        self._writer = SlotWriter(self.segment)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"flash-ckpt-r{rank}")
        self._inflight: Future | None = None
        self._on_event = on_event

    def save(self, state: Any, step: int) -> float:
        """Copy `state` now; checksum and commit in the background. Returns seconds blocked."""
        t0 = perf_counter()
        self.wait()
        job = self._prepare(state, step)
        slot = self._writer.begin(self._meta_bound(job), job.data_len)
        self._copy_or_abort(slot, job, helper=self._pool)  # idle after wait(): copy in two streams
        self._inflight = self._pool.submit(self._seal, slot, job)  # the commit and its event
        return perf_counter() - t0

    def save_async(self, state: Any, step: int) -> float:
        """Reference `state` and return; copy, checksum and commit in the background.

        The caller must not modify the referenced tensors before ``wait`` returns.
        Returns seconds blocked (the previous save's leftover plus walking the state).
        """
        t0 = perf_counter()
        self.wait()
        job = self._prepare(state, step)
        self._inflight = self._pool.submit(self._write, job)
        return perf_counter() - t0

    def wait(self) -> float:
        """Block until the save in flight is committed; re-raise its error. Returns seconds blocked."""
        if self._inflight is None:
            return 0.0
        t0 = perf_counter()
        inflight, self._inflight = self._inflight, None
        inflight.result()
        return perf_counter() - t0

    def invalidate_after(self, step: int) -> list[int]:
        """Uncommit own snapshots newer than `step`, e.g. after the job rolled back to `step`."""
        self.wait()
        return self._writer.invalidate_after(step)

    def close(self, unlink: bool = False) -> None:
        """Finish the save in flight and release the segment; `unlink` removes it from /dev/shm."""
        try:
            self.wait()
        finally:
            self._pool.shutdown()
            self._writer.close(unlink)

    def _prepare(self, state: Any, step: int) -> _Job:
        flat = flatten(state)
        entries, data_len = plan_layout(flat)
        return _Job(step, flat, entries, data_len)

    def _meta(self, job: _Job) -> dict[str, Any]:
        digests = job.digests or [_DIGEST_BOUND] * -(-job.data_len // CHUNK_BYTES)  # widest, to size the slot
        return snapshot_meta(self.job_id, self.rank, None, job.step, job.entries, job.flat.skeleton, job.data_len,
                             digests)

    def _meta_bound(self, job: _Job) -> int:
        """Metadata size once the chunk checksums are known (they are not yet)."""
        return len(encode_meta(self._meta(job)))

    def _write(self, job: _Job) -> None:
        slot = self._writer.begin(self._meta_bound(job), job.data_len)
        self._copy_or_abort(slot, job)  # nobody waits on this thread yet: one stream
        self._seal(slot, job)

    def _copy_or_abort(self, slot: Slot, job: _Job, helper: Executor | None = None) -> None:
        """Copy the tensors into the slot, checksumming each chunk in the copy."""
        t0 = perf_counter()
        try:
            srcs = [address(t) for t in job.flat.tensors]
            for entry, tensor, src in zip(job.entries, job.flat.tensors, srcs):
                if src is None:  # strided or on a device (the device-to-host copy on GPU)
                    slot.view(entry).copy_(tensor)
            job.digests = Plan.of(job.entries, job.data_len).fill(slot.region(), srcs, helper)
        except BaseException:
            self._writer.abort(slot)
            raise
        job.copy_s = perf_counter() - t0

    def _seal(self, slot: Slot, job: _Job) -> None:
        t0 = perf_counter()
        self._writer.commit(slot, job.step, self._meta(job))
        emit(self._on_event, "committed", job.step, str(slot.path),
             f"copy+checksum {job.copy_s:.4f} s, commit {perf_counter() - t0:.4f} s")
