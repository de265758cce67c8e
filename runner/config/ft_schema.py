"""Schemas of the fault-tolerance options (``conf/ft/*.yaml``), one dataclass per strategy.

``ft`` is an open dict in the root schema (it is a list-valued group), so each option's YAML lists
its schema first (``schema/ft/NAME``, stored by ``register_schema``): Hydra then fills the defaults
and rejects unknown keys and wrong types like everywhere else. Every strategy here is implemented.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from runner.recovery.ndb.config import NDBConfig

CrashAction = Annotated[str, Literal["restart_in_place", "swap"]]
ReplicationMode = Annotated[str, Literal["replay", "copy"]]


@dataclass
class FlashRecoveryConfig:
    """FlashRecovery: restart only the failed rank, with its state from a healthy DP replica (RPO 0)."""

    max_restarts: int = 10
    """Restarts of failed ranks over the whole run; one more and the run fails."""
    retry_transient: bool = True
    """A collective error with every process alive is retried in a rebuilt group; nobody restarts."""
    standby: bool = False
    """One warm replacement per host, started ahead and parked until a crashed rank of its host needs it (one more
    worker process's memory per host); needs runner.device=cpu."""


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


@dataclass
class FlashCkptConfig:
    """Flash checkpoint: snapshots to /dev/shm hidden under compute, persisted asynchronously by the node's agent."""

    every_n_steps: int = 5
    """Memory snapshot cadence (>= 1)."""
    persist_every_n_steps: int = 50
    """Disk persist cadence, a multiple of every_n_steps; 0 = never."""
    overlap: bool = True
    """Copy in a background thread during the next forward/backward."""
    keep: int = 2
    """Persisted checkpoints kept on disk."""
    neighbour_backup: bool = True
    """Copy each node's snapshot into a partner node's memory."""
    max_restarts: int = 5
    """Restarts of every rank from snapshots (restart_all) over the whole run; one more and the run fails."""


FT_SCHEMAS = {
    "flashrecovery": FlashRecoveryConfig,
    "deadpool": DeadPoolConfig,
    "flash_ckpt": FlashCkptConfig,
    "ndb": NDBConfig,
}
