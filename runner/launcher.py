"""Start the job: on one host, a controller with simulated nodes; under torchrun/SLURM, one rank."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig

from runner.controller import Controller


def external_launcher() -> str | None:
    """torchrun or SLURM (srun with several tasks), detected the way Lightning's environments do."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "LOCAL_RANK" in os.environ):
        return "torchrun"
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        return "slurm"
    return None


def launch(cfg: DictConfig, run_dir: Path) -> dict | None:
    """Returns the summary, or None on a rank of an external job other than rank 0."""
    kind = cfg.launcher.kind if cfg.launcher.kind != "auto" else (external_launcher() or "local")
    if kind != "local":
        from runner.external import run_rank

        return run_rank(cfg, Path(run_dir), kind)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return Controller(cfg, run_dir).run()
