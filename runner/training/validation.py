"""Validation inside the committed-step protocol: a held-out loss every ``val_check_interval`` steps.

Validation of step ``s`` (``s`` a positive multiple of the interval) measures the weights after ``s``
committed updates. Each DP rank computes the loss of its own disjoint slice of the validation
batches (batch ``i`` belongs to logical rank ``i % dp``) at the start of step ``s``, and the loss sum
and batch count ride in step ``s``'s gradient all-reduce (``StepCommit``'s accounting). So
validation needs no collective of its own, and whatever recovery the step goes through, the
average is taken over the full DP world exactly as in a fault-free run: a survivor keeps its
contribution for the retried reduction, and a replacement, which holds the same committed weights
and the same logical rank, computes the one of the rank it replaces.

The loss of a validation batch is what the module's ``validation_step`` returns (a scalar tensor or
a dict with ``loss``); ``self.log`` calls inside it are not recorded (Lightning's validation loop
does not run), ``val/loss`` in metrics.jsonl and the logger is the mean over the batches that returned
one. A ``validation_step`` may also return nothing, as Lightning's own idiom has it (it only logs):
its batch adds nothing to ``val/loss`` (none at all when no batch returned a loss), and logical rank 0
says once that what it logs is not recorded. With
pipeline parallelism no stage holds the whole model, so the strategy passes the batches' losses
in place of ``validation_step`` (``BatchLosses``): the same batches, through the pipeline's stages.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor

BatchLosses = Callable[[Iterator[Any]], Iterable[Tensor]]
"""The loss of each of a rank's validation batches (on its device), in place of the module's ``validation_step``."""


class StepValidation:
    def __init__(self, interval: int, limit: int) -> None:
        """``interval``: steps between validations (0 = never); ``limit``: validation batches over all
        DP ranks (0 = the whole validation dataloader)."""
        self.interval, self.limit = interval, limit
        self._loader: Any = None
        self._said_unrecorded = False

    def due(self, step: int) -> bool:
        return self.interval > 0 and step > 0 and step % self.interval == 0

    def check(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """At set-up: a scheduled validation has a ``validation_step`` and a validation dataloader."""
        if self.interval <= 0:
            return
        if not is_overridden("validation_step", module):
            raise ValueError(f"trainer.val_check_interval={self.interval} but {type(module).__name__} has no "
                             "validation_step(): add one (returning the batch's loss) or set val_check_interval=0.")
        if self._loader_hook(trainer, module) is None:
            raise ValueError(f"trainer.val_check_interval={self.interval} but neither the DataModule nor "
                             f"{type(module).__name__} defines val_dataloader(): add one or set val_check_interval=0.")

    def run(self, trainer: pl.Trainer, module: pl.LightningModule, logical_rank: int, dp: int,
            batch_losses: Optional[BatchLosses] = None) -> tuple[float, int]:
        """This rank's share of one validation: (sum of its batches' losses, their number); each batch's loss is
        the module's ``validation_step``'s, or ``batch_losses``'."""
        if self._loader is None:
            hook = self._loader_hook(trainer, module)
            assert hook is not None  # check() ran at set-up
            self._loader = hook()
        total, count = 0.0, 0
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad(), _logging_ignored(module):
                own = ((i, trainer.strategy.batch_to_device(batch)) for i, batch in self._own_batches(logical_rank, dp))
                outs = (module.validation_step(batch, i) for i, batch in own) if batch_losses is None else \
                    batch_losses(batch for _, batch in own)
                for out in outs:
                    loss = _loss_value(out, type(module).__name__)
                    if loss is None:
                        self._say_unrecorded(module, logical_rank)
                        continue
                    total += loss
                    count += 1
        finally:
            module.train(was_training)
        return total, count

    def _say_unrecorded(self, module: pl.LightningModule, logical_rank: int) -> None:
        if logical_rank == 0 and not self._said_unrecorded:
            self._said_unrecorded = True
            print(f"[runner] warning: {type(module).__name__}.validation_step returned nothing, and the values it "
                  "logs with self.log are not recorded: return the batch's loss to get val/loss", file=sys.stderr,
                  flush=True)

    def _own_batches(self, logical_rank: int, dp: int) -> Iterator[tuple[int, Any]]:
        """Batches ``i`` with ``i % dp == logical_rank``, below the limit; by index where the loader allows it."""
        loader = self._loader
        if hasattr(loader, "__getitem__") and hasattr(loader, "__len__"):
            n = len(loader) if self.limit <= 0 else min(self.limit, len(loader))
            for i in range(logical_rank, n, dp):
                yield i, loader[i]
            return
        for i, batch in enumerate(loader):
            if 0 < self.limit <= i:
                return
            if i % dp == logical_rank:
                yield i, batch

    @staticmethod
    def _loader_hook(trainer: pl.Trainer, module: pl.LightningModule) -> Optional[Any]:
        datamodule = getattr(trainer, "datamodule", None)  # a property the stubs do not declare
        if datamodule is not None and is_overridden("val_dataloader", datamodule):
            return datamodule.val_dataloader
        if is_overridden("val_dataloader", module):
            return module.val_dataloader
        return None


def warn_unscheduled(module: pl.LightningModule, interval: int) -> None:
    """A user's module with a validation_step that will never run: say so once, at start."""
    if interval <= 0 and is_overridden("validation_step", module):
        print(f"[runner] warning: {type(module).__name__}.validation_step is not run: set "
              "trainer.val_check_interval=N to validate every N steps", file=sys.stderr, flush=True)


def _loss_value(out: Any, module_name: str) -> Optional[float]:
    """The batch's loss; None for a ``validation_step`` that returned nothing."""
    if out is None:
        return None
    loss = out.get("loss") if isinstance(out, dict) else out
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise TypeError(f"{module_name}.validation_step returned {type(out).__name__}; the runner averages the "
                        "validation loss itself: return the batch's loss (a scalar tensor or a dict with 'loss'), "
                        "or nothing.")
    return float(loss)


@contextmanager
def _logging_ignored(module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` outside Lightning's validation loop would land among the training step's metrics."""
    module.log = module.log_dict = _ignore  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None
