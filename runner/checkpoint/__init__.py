"""The run's Lightning checkpoint, ``<run dir>/checkpoints/last.ckpt``: the file, and resuming from it.

``writer`` writes it off the training thread and atomically; ``zero_state`` turns ZeRO-1 shards into
the optimizer state of one unsharded optimizer and back; ``tp_state`` turns tensor-parallel slices of the
parameters and their optimizer state into the full model's and back; ``resume`` checks a ``runner.resume`` target
in the launching process, before any worker starts. The Lightning callback that decides when to save
is ``runner.callbacks.lightning_checkpoint.LightningCheckpoint``.
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_DIR = "checkpoints"
LAST = "last.ckpt"
RUNNER_KEY = "resilient_runner"  # our extras in the checkpoint: data position, seed, optimizer layout


def last_checkpoint(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / LAST
