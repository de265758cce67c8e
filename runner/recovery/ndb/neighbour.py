"""NDB's step hook: the failed ranks' micro-batches this process covers, inside its own step.

The committed-step protocol asks ``take_over`` before every reduction attempt. If a regroup
mid-step took a rank away again (it rejoined), its contribution is removed by going back to this
process's own gradients, kept aside before the first extra micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Optional

import torch
from torch import Tensor

from runner.data import BatchSource
from runner.recovery.ndb.runtime import NDBRuntime
from runner.training.status import WorkerStatus


class NeighbourTakeover:
    """``runner.recovery.common.hooks.MicroBatchTakeover`` for NDB."""

    def __init__(self, runtime: NDBRuntime, status: WorkerStatus, device: torch.device) -> None:
        self.runtime, self.status, self.device = runtime, status, device
        self._done: dict[int, tuple[float, list[int]]] = {}  # this step: taken-over rank -> (loss, sample)
        self._own_grads: Optional[list] = None  # this step's own gradients, before any taken-over micro-batch

    def reset(self) -> None:
        self._done, self._own_grads = {}, None

    def take_over(self, step: int, wanted: list[int], source: Optional[BatchSource], params: list[Tensor]) -> None:
        if set(self._done) - set(wanted):
            assert self._own_grads is not None  # kept before the first extra micro-batch
            for p, g in zip(params, self._own_grads):
                p.grad = None if g is None else g.clone()
            self._done = {}
        for lrank in wanted:
            if lrank not in self._done:
                if self._own_grads is None:
                    self._own_grads = [None if p.grad is None else p.grad.clone() for p in params]
                self.status.phase = "takeover"
                assert source is not None  # the strategy has the step-indexed source once training runs
                self._done[lrank] = self.runtime.backward(source, step, lrank, self.device)

    def contributions(self) -> Iterable[tuple[float, list[int]]]:
        return self._done.values()

    def divisor(self, dp: int, takeovers: int) -> Optional[Callable[[Tensor], int]]:
        return (lambda p: self.runtime.divisor(p, dp, takeovers)) if takeovers else None

    def record_step(self, seconds: float) -> None:
        self.runtime.record_step(seconds, taking_over=bool(self._done))
