"""Start the job: on one host, a controller with simulated nodes; under torchrun/SLURM, one rank."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig

from runner.checkpoint.resume import resume_checkpoint
from runner.config import ConfigError
from runner.control.controller import Controller


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
    if cfg.runner.resume:  # the workers get the checked file's absolute path
        cfg.runner.resume = str(resume_checkpoint(cfg.runner.resume, Path(run_dir), cfg.trainer.max_steps))
    if kind != "local":
        from runner.external import run_rank

        return run_rank(cfg, Path(run_dir), kind)
    refuse_used_dir(Path(run_dir))
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return Controller(cfg, run_dir).run()


def refuse_used_dir(run_dir: Path) -> None:
    """A run never appends to or writes over another run's outputs (a torchrun/SLURM restart attempt may:
    it continues the same job)."""
    used = [name for name in ("summary.json", "events.jsonl", "metrics.jsonl") if (run_dir / name).exists()]
    if used:
        raise ConfigError(f"hydra.run.dir={run_dir} already holds a run ({', '.join(used)}), and a new run never "
                          "writes over another's outputs: choose a new hydra.run.dir (the default is a fresh "
                          "timestamped directory) or move that run away.")
