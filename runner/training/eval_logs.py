"""What a module logs while it is evaluated, accumulated as Lightning does and reduced over the DP ranks in rows.

Lightning's evaluation loop keeps, for every value a ``validation_step`` or ``test_step`` (or its epoch-end hook)
logs with ``self.log``/``self.log_dict``, one accumulation per rank: a mean weighted by each batch's size (``reduce_fx``
mean), a sum, a max or a min, and at the epoch's end reduces it over the ranks when the value was logged with
``sync_dist=True`` (a mean as the ratio of the summed accumulations and batch sizes), or keeps rank 0's own without
it. Here each DP rank fills its row of fixed slots (a flag, a fingerprint of the names and reductions, then an
accumulation and a weight per value, in name order) and the rows are summed (``StepCommit``'s accounting for a
validation at a step, one all-reduce after fit). Every rank then resolves the same values from the same rows, so they
are the same whatever recovery the reduction went through: a rank's row depends only on the committed weights and
its logical rank's batches.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor

LOGGED_PER_EVAL = 8  # values an evaluation may log
ROW = 2 + 2 * LOGGED_PER_EVAL  # a DP rank's slots: a flag, the names' fingerprint, (accumulation, weight) per value
_OPS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}
_CALLABLE_OPS = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min", torch.amax: "max",
                 torch.amin: "min", max: "max", min: "min", sum: "sum"}


@dataclass
class _Value:
    op: str  # mean, sum, max or min
    sync: bool  # reduced over the DP ranks (sync_dist), else logical rank 0's own
    prog_bar: bool
    logger: bool
    total: float = 0.0
    weight: float = 0.0  # the summed batch sizes of a mean; 1 once a sum, max or min holds a value

    def add(self, value: float, batch_size: float) -> None:
        if self.op == "mean":
            self.total += value * batch_size
            self.weight += batch_size
        elif self.op == "sum":
            self.total += value
        else:
            held = self.weight > 0
            self.total = value if not held else (max if self.op == "max" else min)(self.total, value)
        if self.op != "mean":
            self.weight = 1.0


@dataclass
class Evaluated:
    """An evaluation's values, the same on every rank: what goes to the logger, and what the progress bar shows."""

    values: dict[str, float]
    logger: set[str] = field(default_factory=set)
    prog_bar: set[str] = field(default_factory=set)

    def logged(self) -> dict[str, float]:
        return {k: v for k, v in self.values.items() if k in self.logger}


class EvalShare:
    """One rank's share of an evaluation: its batches' loss sum and count (``loss_name``: what the mean of the losses
    its step returns is recorded as; None: returned values are not recorded, as in Lightning's test loop) and what
    it logged. ``filled`` False: a rank without batches, which ran one only to learn what the module logs."""

    def __init__(self, fx: str, loss_name: Optional[str], filled: bool = True) -> None:
        self.fx, self.loss_name, self.filled = fx, loss_name, filled
        self.loss_sum, self.batches = 0.0, 0
        self.values: dict[str, _Value] = {}
        self.batch: Any = None  # the batch being evaluated (its size weighs a mean); None in an epoch-end hook

    @contextmanager
    def recording(self, module: pl.LightningModule) -> Iterator[None]:
        """``self.log`` and ``self.log_dict`` of the module record into this share while it is evaluated."""
        module.log = self._log  # type: ignore[method-assign]
        module.log_dict = self._log_dict  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            del module.log, module.log_dict

    def _log_dict(self, dictionary: Any, **kwargs: Any) -> None:
        for name, value in dict(dictionary).items():
            self._log(name, value, **kwargs)

    def _log(self, name: str, value: Any, prog_bar: bool = False, logger: Optional[bool] = None,
             on_step: Optional[bool] = None, on_epoch: Optional[bool] = None, reduce_fx: Any = "mean",
             enable_graph: bool = False, sync_dist: bool = False, sync_dist_group: Any = None,
             add_dataloader_idx: bool = True, batch_size: Optional[int] = None, metric_attribute: Optional[str] = None,
             rank_zero_only: bool = False) -> None:
        """``self.log``'s arguments, in its order; ``rank_zero_only`` values are logical rank 0's own."""
        if on_step or on_epoch is False:
            raise ValueError(f"{self.fx} logs {name!r} with on_step={on_step}, on_epoch={on_epoch}: the runner "
                             "records an evaluation's values once per evaluation, as Lightning's epoch-level values; "
                             "drop on_step and on_epoch.")
        op = _OPS.get(reduce_fx) if isinstance(reduce_fx, str) else _CALLABLE_OPS.get(reduce_fx)
        if op is None:
            raise ValueError(f"{self.fx} logs {name!r} with reduce_fx={reduce_fx!r}; the runner reduces an "
                             "evaluation's values with mean, sum, max or min: use one of those.")
        number = _number(value, name, self.fx)
        sync = bool(sync_dist) and not rank_zero_only
        entry = self.values.setdefault(name, _Value(op, sync, bool(prog_bar), logger is not False))
        if entry.op != op:
            raise ValueError(f"{self.fx} logs {name!r} with reduce_fx={entry.op} and {op}: use one.")
        size = batch_size if batch_size is not None else (1 if self.batch is None else _batch_size(self.batch))
        entry.add(number, float(size))

    def add_loss(self, loss: float) -> None:
        self.loss_sum += loss
        self.batches += 1

    def fingerprint(self) -> float:
        """The names and reductions logged, in 24 bits (exact in the float32 a step's accounting may ride in): every
        filled row must carry the same."""
        text = "\n".join(f"{name}:{v.op}:{v.sync}" for name, v in sorted(self.values.items()))
        return float(zlib.crc32(text.encode()) & 0xFFFFFF)

    def row(self) -> list[float]:
        """This rank's slots (``ROW`` of them)."""
        if len(self.values) > LOGGED_PER_EVAL:
            raise ValueError(f"{self.fx} logs {len(self.values)} values ({', '.join(sorted(self.values))}); the "
                             f"runner reduces at most {LOGGED_PER_EVAL} per evaluation: log fewer.")
        out = [float(self.filled), self.fingerprint()]
        for _, value in sorted(self.values.items()):
            out += [value.total, value.weight] if self.filled else [0.0, 0.0]
        return out + [0.0] * (ROW - len(out))

    def resolve(self, rows: Tensor, loss_sum: float, batches: int) -> Evaluated:
        """The evaluation's values from every DP rank's row (``dp`` x ``ROW``, summed into place) and the summed
        loss and batch count."""
        filled = rows[:, 0] > 0
        prints = set(rows[filled, 1].tolist())
        if prints - {self.fingerprint()}:
            raise ValueError(f"{self.fx} logs other values (or reductions, or sync_dist) on some DP ranks' batches "
                             f"than on this rank's ({', '.join(sorted(self.values)) or 'none'}): log the same values "
                             "in every batch.")
        out = Evaluated({})
        if self.loss_name is not None and batches:
            out.values[self.loss_name] = loss_sum / batches
            out.logger.add(self.loss_name)
        for i, (name, value) in enumerate(sorted(self.values.items())):
            ranks = filled.clone()
            if not value.sync:
                ranks[1:] = False  # logical rank 0's own, as Lightning's logger on rank 0 gets it
            totals, weights = rows[ranks, 2 + 2 * i], rows[ranks, 3 + 2 * i]
            totals = totals[weights > 0]
            if value.op == "mean":
                result = float(totals.sum() / weights.sum()) if weights.sum() > 0 else float("nan")
            elif not totals.numel():
                result = float("nan")
            else:
                reduced = totals.sum() if value.op == "sum" else totals.max() if value.op == "max" else totals.min()
                result = float(reduced)
            out.values[name] = result
            if value.logger:
                out.logger.add(name)
            if value.prog_bar:
                out.prog_bar.add(name)
        return out


def _number(value: Any, name: str, fx: str) -> float:
    if isinstance(value, Tensor) and value.numel() == 1:
        return float(value.detach())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{fx} logs {name!r} as {type(value).__name__}: the runner records numbers and one-element "
                    "tensors of an evaluation (compute a torchmetrics Metric and log its value).")


def _batch_size(batch: Any) -> int:
    try:
        return extract_batch_size(batch)
    except Exception:  # Lightning's own fallback when it cannot tell: a batch counts as one
        return 1
