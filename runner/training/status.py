"""What a worker is doing right now, shared between the training thread and the heartbeat thread.

Plain attribute writes: the training thread never blocks on the heartbeat.
"""

from __future__ import annotations

from dataclasses import dataclass

TIMINGS_KEPT = 24  # a heartbeat repeats the newest steps' timings: a beat the controller misses loses none


@dataclass
class WorkerStatus:
    wid: int
    node: int
    local_rank: int
    logical_rank: int
    dp: int
    step: int = 0
    phase: str = "starting"  # starting | rendezvous | compute | takeover | reduce | recovering | finishing | done
    latest_gen: int = -1  # newest generation the controller published (read by the heartbeat thread)
    stop_requested: bool = False  # the controller asked for a checkpoint and a stop (read by the heartbeat thread)
    # the newest committed steps' [step, compute_s, wait_s, link_s] (runner.control.stragglers), sent with every
    # heartbeat: a tuple replaced whole, so the heartbeat thread never sees it half-written
    timings: tuple = ()

    def record_timing(self, step: int, compute_s: float, wait_s: float, link_s: float) -> None:
        entry = (step, round(compute_s, 6), round(wait_s, 6), round(link_s, 6))
        self.timings = (*self.timings[1 - TIMINGS_KEPT:], entry)
