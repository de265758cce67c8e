"""What the flash checkpoint saved of each rank, as a restarted attempt and a resume read it (``SavedState``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from runner.recovery.flash_names import flash_job_id

from .disk import every_ranks_checkpoints, verify
from .restore import list_snapshots
from .segment import CorruptSnapshot


def held_steps(run_dir: Path, rank: int) -> list[int]:
    """The steps of ``rank``'s snapshots in its host's memory, a partner's copy or on disk (not verified yet)."""
    return sorted({c.step for c in list_snapshots(flash_job_id(run_dir), rank, run_dir / "checkpoints")})


def newest_whole_model_file(ckpt_dir: Path, newer_than: int) -> Optional[Path]:
    """The newest persisted file of any rank past step ``newer_than`` that verifies (a half-written or damaged one is
    passed over); the caller knows that one rank's file holds the whole model."""
    for step, path in every_ranks_checkpoints(ckpt_dir):
        if step <= newer_than:
            break
        try:
            verify(path)
        except (CorruptSnapshot, OSError):
            continue
        return path
    return None
