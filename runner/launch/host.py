"""What the launching process finds on its host before it starts anything: which launcher started it (torchrun,
SLURM, or none), and whether the run directory it was given is free. The local launcher and a per_host host ask
both; neither imports the other for it."""

from __future__ import annotations

import os
from pathlib import Path

from runner.config import ConfigError


def external_launcher() -> str | None:
    """torchrun or SLURM (srun with several tasks), detected the way Lightning's environments do."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "LOCAL_RANK" in os.environ):
        return "torchrun"
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        return "slurm"
    return None


def refuse_used_dir(run_dir: Path) -> None:
    """A run never appends to or writes over another run's outputs (a torchrun/SLURM restart attempt may:
    it continues the same job)."""
    used = [name for name in ("summary.json", "events.jsonl", "metrics.jsonl") if (run_dir / name).exists()]
    if used:
        raise ConfigError(f"hydra.run.dir={run_dir} already holds a run ({', '.join(used)}), and a new run never "
                          "writes over another's outputs: choose a new hydra.run.dir (the default is a fresh "
                          "timestamped directory) or move that run away.")
