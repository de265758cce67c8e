"""The optimizer update of a committed step: applied exactly once, whatever a recovery did.

``optimizer.step`` is routed through ``CommittedUpdate.apply`` (``gate``): the update is skipped when
a recovery already gave this replica the step's committed state (a laggard that adopted a peer's
state, or finished its update from a peer's final gradients, or rolled its own step forward: ``roll_forward``);
under ZeRO-1 each rank updates its own
shard (``ZeroOne``) and any shard it carries for a failed rank (NDB), a technique's ``UpdateReplication``
around it, and everyone's parameters are synced at the next step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from runner.recovery.common.hooks import UpdateReplication
from runner.training.zero import ZeroOne


class CommittedUpdate:
    def __init__(self, global_step: Callable[[], int]) -> None:
        self._global_step = global_step
        self.zero: Optional[ZeroOne] = None  # ZeRO-1: set once the optimizer is sharded
        self.replication: Optional[UpdateReplication] = None  # set with ``zero`` when a technique replicates shards
        self._inner: Optional[Callable[[], Any]] = None  # the optimizer's own step, under the gate
        self._skip = False  # the newest committed step's update is already in this replica's state
        # tp*pp > 1: the full model's gradient norm of the newest committed step (the agreement's), for clipping
        self.full_grad_norm = torch.zeros(())
        # tp*pp > 1: the step's reduced gradients are in ``.grad``, but its agreement did not complete here
        self.awaiting_agreement = False

    def gate(self, optimizer: torch.optim.Optimizer) -> None:
        """Route ``optimizer.step`` through ``apply``."""
        inner = optimizer.step
        self._inner = inner

        def step(closure: Optional[Callable[[], Any]] = None) -> Any:
            loss = closure() if closure is not None else None
            self.apply(inner)
            return loss

        # The gate calls the scheduler-wrapped step, so torch's "step before scheduler" bookkeeping holds.
        step._wrapped_by_lr_sched = getattr(inner, "_wrapped_by_lr_sched", True)  # type: ignore[attr-defined]
        optimizer.step = step  # type: ignore[method-assign]

    def apply(self, inner: Callable[[], Any]) -> None:
        """The update of a committed step (called by the gated ``optimizer.step``)."""
        if self.consume_skip():
            return
        if self.zero is None:
            inner()
            return
        gen = self._global_step() + 1  # updates applied once this one is
        if self.replication is not None:
            self.replication.wait_previous()
            self.replication.record(gen)
        inner()
        self.zero.step_carried()
        self.zero.stale = True
        if self.replication is not None:
            self.replication.start(gen)

    def finish(self, grads: list[Tensor]) -> None:
        """ZeRO-1 laggard: the update it missed, with the final gradients every other rank used."""
        assert self.zero is not None
        for p, g in zip(self.zero.params, grads):
            p.grad = g
        self._update_in_recovery()

    def roll_forward(self) -> None:
        """tp*pp > 1: the step's agreement failed here but completed on another member, so every DP group's
        reduction completed: this rank's update with its own reduced (and clipped) gradients, the very update it
        would have made (under ZeRO-1: of its own shard, and of any it carries); Lightning then only advances the
        step (``skip_pending``)."""
        assert self.awaiting_agreement
        self._update_in_recovery()

    def _update_in_recovery(self) -> None:
        """The in-flight step's update, made inside a recovery; the gate then skips it. Under ZeRO-1 the shards of
        other owners are synced by the recovery, and the update is only recorded for the replica this rank holds
        (DeadPool: a replacement of its owner gets it replayed); the next update's exchange, in the new
        generation, seeds the replicas again."""
        assert self._inner is not None
        if self.zero is not None and self.replication is not None:
            self.replication.record(self._global_step() + 1)
        self._inner()
        if self.zero is not None:
            self.zero.step_carried()
            self.zero.stale = True
        self.skip_own()

    def skip_own(self) -> None:
        """The newest committed step's state was adopted: this replica's own update of it is skipped (and its own
        reduced gradients of the step no longer count)."""
        self._skip = True
        self.awaiting_agreement = False

    @property
    def skip_pending(self) -> bool:
        return self._skip

    def consume_skip(self) -> bool:
        skip, self._skip = self._skip, False
        return skip
