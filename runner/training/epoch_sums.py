"""Epoch values a module logs with ``sync_dist=True``, kept the same on every rank through the step's reduction.

Lightning accumulates an ``on_epoch`` value on each rank and reduces the accumulations at the epoch's end. A
replacement's accumulation would start at the step it joined, so after a recovery the epoch value would miss the
replaced rank's earlier steps. Here every rank's increments of a step ride in the step's reduction
(``StepCommit``'s synced slots, two per value), and once the step commits each rank's accumulation becomes the
previous accumulation plus every DP rank's increments (the extreme of them for max and min): every rank then
holds the same accumulation, which a replacement or a laggard receives with the rest of the state
(``TrainerState``). Lightning's own reduction at the epoch's end still runs and gives the same global value: a
mean is the ratio of two reduced sums, max and min of equal values, and a sum is kept divided by the number of
ranks that Lightning's sum multiplies it by. Only values logged in ``training_step`` are kept so; a step
recomputed after a recovery (or by the corruption guard) starts again from the step's accumulations, of
every epoch value (synced or not), so that no step is accumulated twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

SLOTS = 2  # per value: the increment of its accumulation and of its batch count (mean), or its new extreme


class EpochSums:
    def __init__(self, results: Callable[[], Any], ranks: Callable[[], int]) -> None:
        """``results``: Lightning's result collection of the training loop; ``ranks``: how many ranks Lightning's
        reduction at the epoch's end sums over."""
        self._results, self._ranks = results, ranks
        self._before: Optional[dict[str, tuple[Tensor, Tensor]]] = None  # the step's accumulations before its compute
        self._adopted: dict[str, tuple[Tensor, Tensor]] = {}  # from a replica: the accumulations to continue from
        self._resolved = False
        self._step = -1

    def begin_step(self, step: int) -> None:
        """A step's batch: a new step starts from the accumulations as they are; the same step again (its
        ``training_step`` recomputed) from those it started from."""
        if step != self._step:
            self._step, self._before, self._resolved = step, None, False

    def before_compute(self) -> None:
        """Before the step's first micro-batch: keep the accumulations, or (a recomputation) go back to them (of
        every epoch value, synced or not: a recomputed step is accumulated once)."""
        if self._before is None:
            self._before = {key: _state(m) for key, m in self._metrics(synced_only=False).items()}
            return
        for key, metric in self._metrics(synced_only=False).items():
            value, count = self._before.get(key, _default(metric))
            _set(metric, value.clone(), count.clone())

    @property
    def size(self) -> int:
        return SLOTS * len(self._metrics())

    def row(self) -> list[float]:
        """This rank's increments of the step, two per value in key order."""
        out: list[float] = []
        before = self._before or {}
        for key, metric in sorted(self._metrics().items()):
            value, count = _state(metric)
            old_value, old_count = before.get(key, _default(metric))
            if metric.meta.is_max_reduction or metric.meta.is_min_reduction:
                out += [float(value), 0.0]
            else:
                out += [float(value - old_value), float(count - old_count)]
        return out

    def resolve(self, rows: Tensor) -> None:
        """The committed step's rows (one per DP rank that filled it, ``size`` columns): every rank's new
        accumulations, from the step's own (or the adopted) ones."""
        ranks = self._ranks()
        before = self._before or {}
        for i, (key, metric) in enumerate(sorted(self._metrics().items())):
            value, count = self._adopted.get(key) or before.get(key) or _default(metric)
            column = rows[:, SLOTS * i].to(value.dtype)
            if metric.meta.is_max_reduction:
                new_value = torch.maximum(value, column.max()) if column.numel() else value
            elif metric.meta.is_min_reduction:
                new_value = torch.minimum(value, column.min()) if column.numel() else value
            elif metric.meta.is_sum_reduction:
                new_value = value + column.sum() / ranks
            else:
                new_value = value + column.sum()
            _set(metric, new_value, count + rows[:, SLOTS * i + 1].sum().to(count.dtype))
        self._adopted, self._resolved = {}, True

    def state(self) -> dict[str, tuple[Tensor, Tensor]]:
        """The accumulations as of the last committed step, for a replica that continues from it."""
        if self._adopted:  # this member adopted a committed step itself
            return dict(self._adopted)
        if self._resolved or self._before is None:
            return {key: _state(m) for key, m in self._metrics().items()}
        return {key: state for key, state in self._before.items() if key in self._metrics()}

    def adopt(self, state: Optional[dict]) -> None:
        """A replica's accumulations: this rank's own continue from them at its next committed step."""
        if state:
            self._adopted = {key: (value.clone(), count.clone()) for key, (value, count) in state.items()}

    def _metrics(self, synced_only: bool = True) -> dict[str, Any]:
        """The tensor values ``training_step`` logs with ``on_epoch=True`` (and ``sync_dist=True``)."""
        results = self._results()
        if results is None:
            return {}
        return {key: m for key, m in results.items()
                if getattr(m, "is_tensor", False) and m.meta.on_epoch and m.meta.fx == "training_step"
                and (m.meta.sync.should or not synced_only)}


def _state(metric: Any) -> tuple[Tensor, Tensor]:
    count = metric.cumulated_batch_size if metric.meta.is_mean_reduction else torch.tensor(0)
    return metric.value.detach().clone(), count.detach().clone()


def _default(metric: Any) -> tuple[Tensor, Tensor]:
    return metric._defaults["value"].clone(), torch.tensor(0)


def _set(metric: Any, value: Tensor, count: Tensor) -> None:
    metric.value = value.to(metric.value.device)
    if metric.meta.is_mean_reduction:
        metric.cumulated_batch_size = count.to(metric.cumulated_batch_size)
