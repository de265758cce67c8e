"""The worker-side hooks a recovery technique plugs into the training step.

The strategy and the committed-step protocol name no technique: they call these interfaces, and
each technique's package implements the ones it needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional, Protocol

from torch import Tensor

from runner.data import BatchSource


class MicroBatchTakeover(Protocol):
    """Inside a step, a live rank also computes failed ranks' micro-batches (NDB)."""

    def reset(self) -> None:
        """A new step, or a recompute of this one: nothing is taken over yet."""

    def take_over(self, step: int, wanted: list[int], source: BatchSource, params: list[Tensor]) -> None:
        """Add the gradients of the micro-batches of logical ranks ``wanted`` (and only those) to ``params``."""

    def contributions(self) -> Iterable[tuple[float, list[int]]]:
        """(loss, [sample step, sample rank]) of each micro-batch taken over in this step."""

    def divisor(self, dp: int, takeovers: int) -> Optional[Callable[[Tensor], int]]:
        """How each summed gradient is averaged when ``takeovers`` ranks are covered; None: by ``dp``."""

    def record_step(self, seconds: float) -> None:
        """A committed step took ``seconds`` from its batch to its commit."""


class UpdateReplication(Protocol):
    """Each rank's updated optimizer shard is copied to another rank after every update (DeadPool, ZeRO-1)."""

    replicator: Any  # what recovery reads the replicas from

    def start(self, gen: int) -> None:
        """Copy this rank's shard as it is after ``gen`` updates."""

    def wait_previous(self) -> None:
        """The shard is about to change again: the copy in flight must be complete."""

    def record(self, gen: int) -> None:
        """Before the update producing ``gen``: keep what a replay of it needs."""

    def close(self) -> None:
        """The worker ends: no copy is left in flight."""
