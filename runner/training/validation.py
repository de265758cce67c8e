"""Validation inside the committed-step protocol, and the evaluations after fit (the final weights' validation and
``runner.test_after_fit``'s test).

Validation of step ``s`` measures the weights after ``s`` committed updates. It is due every ``val_check_interval``
steps (an int), or, with a float in (0, 1], every that fraction of an epoch of a finite training set, counted within
each epoch as Lightning counts it (``set_epoch_steps``). Each DP rank evaluates its own disjoint slice of the
validation batches (batch ``i`` belongs to logical rank ``i % dp``) at the start of step ``s``, and its share (the
loss sum and batch count, and the values the module logs, ``runner.training.eval_logs``) rides in step ``s``'s
gradient all-reduce (``StepCommit``'s accounting). So validation needs no collective of its own, and whatever
recovery the step goes through, its values are taken over the full DP world exactly as in a fault-free run: a
survivor keeps its share for the retried reduction, and a replacement, which holds the same committed weights and
the same logical rank, computes the share of the rank it replaces.

``val/loss`` is the mean of what the module's ``validation_step`` returns (a scalar tensor or a dict with ``loss``)
over the batches that returned one; a ``validation_step`` may also return nothing and only log, as Lightning's own
idiom has it. What it (and ``on_validation_epoch_end``) logs is recorded under its own names, as Lightning's
validation loop records it. With pipeline parallelism no stage holds the whole model, so the strategy passes the
batches' losses in place of ``validation_step`` (``BatchLosses``): the same batches, through the pipeline's stages.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor

from runner.training.eval_logs import EvalShare

BatchLosses = Callable[[Iterator[Any]], Iterable[Tensor]]
"""The loss of each of a rank's validation batches (on its device), in place of the module's ``validation_step``."""


class StepValidation:
    def __init__(self, interval: float, limit: int) -> None:
        """``interval``: steps between validations (an int; 0 = never) or a fraction of an epoch (a float in (0, 1]);
        ``limit``: validation batches over all DP ranks (0 = the whole validation dataloader)."""
        self.interval, self.limit = interval, limit
        self._every = interval if isinstance(interval, int) else 0  # steps; a fraction's once the epoch is known
        self._epoch_steps = 0  # steps per epoch of a finite training set (0: unknown)
        self._loader: Any = None

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    @property
    def fraction(self) -> bool:
        return not isinstance(self.interval, int)

    def set_epoch_steps(self, steps: int) -> None:
        """The training set's epoch in steps: a fraction of it becomes a number of steps, as Lightning rounds it."""
        self._epoch_steps = steps
        if self.fraction and self.enabled:
            self._every = max(1, int(steps * self.interval))

    def due(self, step: int) -> bool:
        """After ``step`` committed updates; a fraction counts the steps within the epoch (Lightning's batch index)."""
        if not self.enabled or step <= 0:
            return False
        if not self.fraction:
            return step % self._every == 0
        assert self._epoch_steps > 0  # the strategy refuses a fraction of a training set without an epoch
        return ((step - 1) % self._epoch_steps + 1) % self._every == 0

    def check(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """At set-up: a scheduled validation has a ``validation_step`` and a validation dataloader."""
        if not self.enabled:
            return
        if not is_overridden("validation_step", module):
            raise ValueError(f"trainer.val_check_interval={self.interval} but {type(module).__name__} has no "
                             "validation_step(): add one (returning the batch's loss, or logging) or set "
                             "val_check_interval=0.")
        if loader_hook(trainer, module, "val") is None:
            raise ValueError(f"trainer.val_check_interval={self.interval} but neither the DataModule nor "
                             f"{type(module).__name__} defines val_dataloader(): add one or set val_check_interval=0.")

    def run(self, trainer: pl.Trainer, module: pl.LightningModule, logical_rank: int, dp: int,
            batch_losses: Optional[BatchLosses] = None) -> EvalShare:
        """This rank's share of one validation; each batch's loss is the module's ``validation_step``'s, or
        ``batch_losses``'."""
        if self._loader is None:
            hook = loader_hook(trainer, module, "val")
            assert hook is not None  # check() ran at set-up
            self._loader = hook()
        step = None if batch_losses is not None else module.validation_step
        return evaluate(trainer, module, self._loader, self.limit, logical_rank, dp, "validation", step,
                        batch_losses)


def evaluate(trainer: pl.Trainer, module: pl.LightningModule, loader: Any, limit: int, logical_rank: int, dp: int,
             stage: str, step_fn: Optional[Callable[..., Any]],
             batch_losses: Optional[BatchLosses] = None) -> EvalShare:
    """This rank's share of an evaluation (``stage`` validation or test) of ``loader``'s first ``limit`` batches, in
    eval mode without gradients, the module's epoch hooks of the stage around them. A rank without batches runs the
    first one unrecorded, to learn what the module logs (every rank resolves the same values)."""
    fx = f"{stage}_step"
    share = EvalShare(fx, "val/loss" if stage == "validation" else None)
    own = list(_own_batches(loader, limit, logical_rank, dp))
    if not own:
        share = EvalShare(fx, share.loss_name, filled=False)
        own = list(_own_batches(loader, limit, 0, 1))[:1]
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), share.recording(module):
            getattr(module, f"on_{stage}_epoch_start")()
            batches = ((i, trainer.strategy.batch_to_device(batch)) for i, batch in own)
            if batch_losses is not None:
                outs: Iterable[Any] = batch_losses(batch for _, batch in batches)
            else:
                assert step_fn is not None
                outs = (_step(share, step_fn, batch, i) for i, batch in batches)
            for out in outs:
                loss = _loss_value(out, type(module).__name__, fx) if share.loss_name else None
                if loss is not None and share.filled:
                    share.add_loss(loss)
            share.batch = None
            getattr(module, f"on_{stage}_epoch_end")()
    finally:
        module.train(was_training)
    return share


def _step(share: EvalShare, step_fn: Callable[..., Any], batch: Any, index: int) -> Any:
    share.batch = batch
    return step_fn(batch, index)


def _own_batches(loader: Any, limit: int, logical_rank: int, dp: int) -> Iterator[tuple[int, Any]]:
    """Batches ``i`` with ``i % dp == logical_rank``, below the limit; by index where the loader allows it."""
    if hasattr(loader, "__getitem__") and hasattr(loader, "__len__"):
        n = len(loader) if limit <= 0 else min(limit, len(loader))
        for i in range(logical_rank, n, dp):
            yield i, loader[i]
        return
    for i, batch in enumerate(loader):
        if 0 < limit <= i:
            return
        if i % dp == logical_rank:
            yield i, batch


def loader_hook(trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> Optional[Callable[[], Any]]:
    """The DataModule's ``<stage>_dataloader``, else the module's; None when neither defines one."""
    name = f"{stage}_dataloader"
    datamodule = getattr(trainer, "datamodule", None)  # a property the stubs do not declare
    if datamodule is not None and is_overridden(name, datamodule):
        return getattr(datamodule, name)
    if is_overridden(name, module):
        return getattr(module, name)
    return None


def warn_unscheduled(module: pl.LightningModule, interval: float) -> None:
    """A user's module with a validation_step that will never run: say so once, at start."""
    if interval <= 0 and is_overridden("validation_step", module):
        print(f"[runner] warning: {type(module).__name__}.validation_step is not run: set "
              "trainer.val_check_interval=N to validate every N steps", file=sys.stderr, flush=True)


def _loss_value(out: Any, module_name: str, fx: str) -> Optional[float]:
    """The batch's loss; None for a step that returned nothing."""
    if out is None:
        return None
    loss = out.get("loss") if isinstance(out, dict) else out
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise TypeError(f"{module_name}.{fx} returned {type(out).__name__}; the runner averages the validation loss "
                        "itself: return the batch's loss (a scalar tensor or a dict with 'loss'), or nothing (and "
                        "log what you measure with self.log).")
    return float(loss)
