"""DeadPool's options (``ft.deadpool.*``, ``conf/ft/deadpool.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

CrashAction = Annotated[str, Literal["restart_in_place", "swap"]]
ReplicationMode = Annotated[str, Literal["replay", "copy"]]


@dataclass
class DeadPoolConfig:
    """DeadPool: swap a lost node's ranks for warm hot spares; with parallel.zero=1, replicate every shard."""

    crash_action: CrashAction = "restart_in_place"
    """What a process crash on a healthy node gets: restart_in_place, or swap it for a spare."""
    max_restarts: int = 10
    """In-place restarts over the run when flashrecovery is not in ft (flashrecovery's bound applies otherwise)."""
    replication: ReplicationMode = "replay"
    """parallel.zero=1: how each rank's optimizer shard is kept on its holder on another node. replay: the holder
    applies the owner's update to its replica itself, from the full reduced gradients it already has (0 bytes per step
    on the network; a full copy only seeds a replica: at the start, after a recovery, for a new holder); copy: the
    owner sends its whole shard after every update."""
    verify_every_n_steps: int = 50
    """replication=replay: every that many updates each owner's shard digest (32 bytes) is compared with its holder's
    replica; a replica that differs is logged (replica_drift) and reseeded with a full copy (>= 1)."""
