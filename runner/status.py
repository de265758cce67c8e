"""What a worker is doing right now, shared between the training thread and the heartbeat thread.

Plain attribute writes: the training thread never blocks on the heartbeat.
"""

from __future__ import annotations

from dataclasses import dataclass


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
