"""The progress bar on logical rank 0: committed step, loss and tokens/s (samples/s for a user's module that states no
``tokens_per_sample``) instead of Lightning's ``v_num``.

The numbers are the committed step's global view that ``CommitMetrics`` computed from the reduction
(the loss averaged over every rank's micro-batch, tokens/s of the whole job), so the bar says what
metrics.jsonl and the logger record.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import TQDMProgressBar

from runner.callbacks.metrics import CommitMetrics


class StepProgressBar(TQDMProgressBar):
    def __init__(self, metrics: CommitMetrics) -> None:
        super().__init__()
        self.commit_metrics = metrics

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        last = self.commit_metrics.last
        shown: dict[str, Any] = {"step": trainer.global_step}
        if last is not None:
            rate, value = ("samples/s", last["samples_per_s"]) if last["tokens_per_s"] is None else \
                ("tokens/s", last["tokens_per_s"])
            shown.update({"loss": f"{last['loss']:.4f}", rate: f"{value:,.0f}"})
        return {**shown, **trainer.progress_bar_metrics}  # and what the module logs with prog_bar=True
