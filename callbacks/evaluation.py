"""What Lightning does with an evaluation's values, once they are committed: the callbacks' hooks and the evaluations
after fit.

A validation's values are known only once the step that carried it commits (``runner.training.validation``), so
at the end of that step they become ``trainer.callback_metrics`` (``logged_metrics`` and the progress bar's metrics
as the module asked) and every callback's ``on_validation_epoch_end`` and ``on_validation_end`` run (but a progress
bar's: no validation bar is shown), as Lightning's validation loop runs them: a stock ``EarlyStopping`` or
``ModelCheckpoint`` monitoring ``val/loss`` sees it. Every member that commits the step does this with the same
values. At the end of fit (``on_train_end``, while the group still stands) the final weights are validated once more
when the run validates, and tested over the ``test_dataloader`` with ``runner.test_after_fit``; their values go to
``callback_metrics``, the hooks (validation's) and a metrics.jsonl record of their own
(``CommitMetrics.add_after_fit``), which the summary reports.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.utilities.model_helpers import is_overridden

from runner.callbacks.metrics import CommitMetrics
from runner.training.eval_logs import Evaluated
from runner.training.strategy import ResilientStrategy
from runner.training.validation import loader_hook


class EvaluationHooks(Callback):
    def __init__(self, strategy: ResilientStrategy, metrics: CommitMetrics, test_after_fit: bool) -> None:
        self.strategy, self.metrics, self.test_after_fit = strategy, metrics, test_after_fit

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """``runner.test_after_fit`` needs a ``test_step`` and a ``test_dataloader`` (the module is built by now)."""
        if not self.test_after_fit:
            return
        name = type(pl_module).__name__
        if not is_overridden("test_step", pl_module):
            raise ValueError(f"runner.test_after_fit=true but {name} has no test_step(): add one (logging what it "
                             "measures with self.log) or set runner.test_after_fit=false.")
        if loader_hook(trainer, pl_module, "test") is None:
            raise ValueError(f"runner.test_after_fit=true but neither the DataModule nor {name} defines "
                             "test_dataloader(): add one or set runner.test_after_fit=false.")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        validated = self.strategy.commit.validated
        if validated is not None:
            self._validation_end(trainer, pl_module, validated)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        values: dict[str, float] = {}
        if self.strategy.validation.enabled:
            validated = self.strategy.evaluate_after_fit("validation")
            self._validation_end(trainer, pl_module, validated)
            values.update(validated.logged())
        validation = sorted(values)
        if self.test_after_fit:
            tested = self.strategy.evaluate_after_fit("test")
            _publish(trainer, tested)
            clash = sorted(set(tested.logged()) & set(values))
            if clash:
                raise ValueError(f"test_step logs {clash}, names validation_step logs too: give the test's values "
                                 "names of their own (e.g. test/...).")
            values.update(tested.logged())
        self.metrics.add_after_fit(trainer.global_step, values, validation)

    def _validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, validated: Evaluated) -> None:
        _publish(trainer, validated)
        # a progress bar's validation hooks close the validation bar its own start hooks open: none is shown here
        callbacks = [c for c in trainer.callbacks  # type: ignore[attr-defined]
                     if c is not self and not isinstance(c, ProgressBar)]
        for callback in callbacks:
            callback.on_validation_epoch_end(trainer, pl_module)
        for callback in callbacks:
            callback.on_validation_end(trainer, pl_module)


def _publish(trainer: pl.Trainer, evaluated: Evaluated) -> None:
    """The values into the trainer's metrics, as Lightning's logger connector puts an evaluation's there."""
    connector = trainer._logger_connector
    tensors = {name: torch.tensor(value) for name, value in evaluated.values.items()}
    connector._callback_metrics.update(tensors)
    connector._logged_metrics.update({k: v for k, v in tensors.items() if k in evaluated.logger})
    connector._progress_bar_metrics.update({k: float(v) for k, v in tensors.items() if k in evaluated.prog_bar})
