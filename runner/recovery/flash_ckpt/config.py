"""The flash checkpoint's options (``ft.flash_ckpt.*``, ``conf/ft/flash_ckpt.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass


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
