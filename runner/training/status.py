"""What a worker is doing right now, shared between the training thread and the heartbeat thread.

Plain attribute writes: the training thread never blocks on the heartbeat.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

TIMINGS_KEPT = 24  # a heartbeat repeats the newest steps' timings: a beat the controller misses loses none


@dataclass
class WorkerStatus:
    wid: int
    node: int
    local_rank: int
    logical_rank: int
    dp: int
    step: int = 0
    # starting | rendezvous | compute | takeover | reduce | sync | validate | checkpoint | recovering | finishing | done
    phase: str = "starting"
    latest_gen: int = -1  # newest generation the controller published (read by the heartbeat thread)
    stop_requested: bool = False  # the controller asked for a checkpoint and a stop (read by the heartbeat thread)
    # the newest committed steps' [step, compute_s, wait_s, link_s] (runner.control.stragglers), sent with every
    # heartbeat: a tuple replaced whole, so the heartbeat thread never sees it half-written
    timings: tuple = ()

    def record_timing(self, step: int, compute_s: float, wait_s: float, link_s: float) -> None:
        entry = (step, round(compute_s, 6), round(wait_s, 6), round(link_s, 6))
        self.timings = (*self.timings[1 - TIMINGS_KEPT:], entry)

    @contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        """Report ``phase`` while the block runs (the controller times each phase apart:
        ``runner.control.phase_timeouts``), then the phase before it."""
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before


def checkpoint_phase(trainer: Any) -> AbstractContextManager[None]:
    """A checkpoint being taken is reported as phase ``checkpoint``, so its time is no slow compute step; nothing
    under a strategy without a worker status (plain Lightning)."""
    status = getattr(trainer.strategy, "status", None)
    return status.in_phase("checkpoint") if isinstance(status, WorkerStatus) else nullcontext()
