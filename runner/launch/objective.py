"""What a job gives back to Hydra: the final value of ``runner.optimized_metric``, for a sweeper to optimise.

The names are the experiment logger's (``train/loss``, ``val/loss``, ...), read from the run's ``metrics.jsonl``
(``runner.callbacks.metrics``), where a committed step's record holds them under its own field names. Torch-free:
the config is checked against ``LOGGED`` before anything starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from runner.plumbing.events import read_jsonl

TRAIN_ROW = {"train/loss": "loss", "train/samples_per_s": "samples_per_s", "train/tokens_per_s": "tokens_per_s",
             "train/step_time_s": "step_time_s"}
"""The logger's ``train/*`` row: its names and the metrics.jsonl fields they come from (``tokens_per_s`` null where a
module's batches are not tokens: not logged then)."""
LOGGED = {**TRAIN_ROW, "val/loss": "val/loss"}
"""Every name a run logs per committed step, and its metrics.jsonl field (``val/loss`` on validation steps)."""


def final_metric(run_dir: Path, name: str) -> Optional[float]:
    """The value of ``name`` at the newest committed step that has it (a step committed again after a restart:
    its last record); None when no step has it, or this process holds no metrics.jsonl (a rank of an external job
    other than rank 0)."""
    field = LOGGED[name]
    records = [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if r.get(field) is not None]
    if not records:
        return None
    newest = max(r["step"] for r in records)
    return float([r for r in records if r["step"] == newest][-1][field])
