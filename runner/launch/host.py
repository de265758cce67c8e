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


OUTPUTS = ("summary.json", "events.jsonl", "metrics.jsonl")  # what makes a directory a run's
KEPT = (".hydra", "cli.log", "checkpoints", "previous")  # what a continued run keeps in place: Hydra's own files (this
# process writes them already), the checkpoints it continues from and advances, and the earlier runs' outputs


def claim_run_dir(run_dir: Path, continuing: bool) -> None:
    """A run never appends to or writes over another run's outputs. ``continuing`` (``runner.resume=auto``): the run
    dir holds an earlier run of this job (a requeue, a relaunch with the same command): its outputs move to
    ``previous/<n>/`` and this run continues in the directory, its checkpoints in place. A torchrun/SLURM restart
    attempt under ``per_rank`` continues the same job by itself and does not come here."""
    used = [name for name in OUTPUTS if (run_dir / name).exists()]
    if not used:
        return
    if not continuing:
        raise ConfigError(f"hydra.run.dir={run_dir} already holds a run ({', '.join(used)}), and a new run never "
                          "writes over another's outputs: choose a new hydra.run.dir (the default is a fresh "
                          "timestamped directory), move that run away, or continue it in place with "
                          "runner.resume=auto.")
    previous = run_dir / "previous"
    n = sum(1 for _ in previous.glob("*")) if previous.is_dir() else 0
    dest = previous / str(n)
    dest.mkdir(parents=True)
    for path in sorted(run_dir.iterdir()):
        if path.name not in KEPT:
            path.rename(dest / path.name)
    print(f"[runner] runner.resume=auto: {run_dir} held an earlier run of this job; its outputs are now in {dest}",
          flush=True)
