"""Schemas of the fault-tolerance options (``conf/ft/*.yaml``), one dataclass per strategy.

``ft`` is an open dict in the root schema (it is a list-valued group), so each option is checked
here: unknown keys and wrong types are rejected like everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from runner.recovery.ndb.config import NDBConfig


@dataclass
class FlashRecoveryConfig:
    max_restarts: int = 10
    retry_transient: bool = True

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"ft.flashrecovery.max_restarts={self.max_restarts} must be >= 0.")


@dataclass
class DeadPoolConfig:
    crash_action: str = "restart_in_place"
    max_restarts: int = 10

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"ft.deadpool.max_restarts={self.max_restarts} must be >= 0.")
        if self.crash_action not in ("restart_in_place", "swap"):
            raise ValueError(f"ft.deadpool.crash_action={self.crash_action!r}: use restart_in_place or swap.")


@dataclass
class FlashCkptConfig:
    every_n_steps: int = 5
    persist_every_n_steps: int = 50
    overlap: bool = True
    keep: int = 2
    neighbour_backup: bool = True
    max_restarts: int = 5


FT_SCHEMAS = {
    "flashrecovery": FlashRecoveryConfig,
    "deadpool": DeadPoolConfig,
    "flash_ckpt": FlashCkptConfig,
    "ndb": NDBConfig,
}

# Strategies whose recovery path is built into the runner today; the others compose and validate,
# and are refused at run time with a clear message until they land.
IMPLEMENTED = ("flashrecovery", "deadpool", "ndb", "flash_ckpt")
