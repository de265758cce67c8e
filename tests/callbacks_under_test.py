"""Callbacks the callbacks-group tests configure through ``+callbacks.NAME._target_``."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import EarlyStopping


class CommittedBatches(pl.Callback):
    """Counts the committed training batches in its state, which must travel with the model's (a replacement's count
    goes on from its peer's, a resumed run's from last.ckpt's); each rank writes its final count into the run dir."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1

    def on_train_end(self, trainer, pl_module) -> None:
        path = Path(trainer.default_root_dir) / f"committed_batches.rank{trainer.global_rank}.json"
        path.write_text(json.dumps(self.batches))

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict) -> None:
        self.batches = state_dict["batches"]


class EveryBatchEarlyStopping(EarlyStopping):
    """Lightning's EarlyStopping, checked after every committed batch rather than at an epoch's end, so that a test's
    stop comes within a few steps: its decision goes through ``strategy.reduce_boolean_decision`` and
    ``trainer.should_stop`` as the stock one's does."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._run_early_stopping_check(trainer)
