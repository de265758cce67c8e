"""State transfer between data-parallel replicas: what a replica hands over, and how it travels.

``exchange`` broadcasts an object of tensors and plain containers (a checkpoint, a shard, final gradients)
from one member of the current group to the others, packed by ``runner.training.packed`` (the tensors as
bytes, only the rest pickled); ``TrainerState`` is this replica's state as recovery code sees
it (``runner.training.state``): dumped from Lightning's checkpoint connector with the corruption
guard's history, adopted by a laggard, and under ZeRO-1 served shard by shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule

from runner.recovery.sdc import GradientGuard
from runner.training.comm import Comm
from runner.training.epoch_sums import EpochSums
from runner.training.packed import from_bytes, to_bytes
from runner.training.update import CommittedUpdate
from runner.training.zero import ZeroOne

SDC_HISTORY = "resilient_sdc_norms"  # the corruption guard's history, in state handed to a replacement or laggard
# in a handed-over checkpoint: its model and optimizer already hold the update of the step in flight (``global_step``),
# whose counting by Lightning (the step counter, the LR scheduler, the loops' progress) is still to come
UPDATE_APPLIED = "resilient_update_applied"
EPOCH_SUMS = "resilient_epoch_sums"  # the synced epoch values' accumulations (``runner.training.epoch_sums``)


def exchange(comm: Comm, obj: Any, src_pg_rank: int, *, receive: bool) -> Any:
    """Broadcast ``obj`` (given on the source only) over the current group; receivers get a copy."""
    dev = comm.device
    size = torch.zeros(1, dtype=torch.int64, device=dev)
    payload = None
    if comm.rank == src_pg_rank:
        payload = to_bytes(obj, dev)
        size[0] = payload.numel()
    comm.broadcast(size, src_pg_rank)
    if payload is None:
        payload = torch.empty(int(size[0]), dtype=torch.uint8, device=dev)
    comm.broadcast(payload, src_pg_rank)
    if not receive:
        return None
    return from_bytes(payload, dev)


class TrainerState:
    """``ReplicaState`` and ``ShardedState`` of the Lightning module a strategy trains."""

    def __init__(self, module: Callable[[], Optional[LightningModule]], optimizers: Callable[[], list],
                 update: CommittedUpdate, guard: Optional[GradientGuard],
                 epoch_sums: Optional[EpochSums] = None) -> None:
        self._module, self._optimizers = module, optimizers
        self.update, self.guard, self.epoch_sums = update, guard, epoch_sums

    @property
    def global_step(self) -> int:
        module = self._module()
        return module.trainer.global_step if module else -1

    def committed_steps(self) -> int:
        """A laggard that already adopted or finished the newest step counts it, so a recovery that is
        retried never applies it twice."""
        return self.global_step + int(self.update.skip_pending)

    def dump_state(self) -> dict:
        """The full Lightning checkpoint, with the corruption guard's history (its verdicts must stay the
        same on every rank, a replacement's too). A member whose own update of the in-flight step is skipped
        (``skip_pending``) holds that update while Lightning's loop and scheduler state do not count the step yet:
        ``UPDATE_APPLIED`` tells the receiver to finish the step the same way (``adopt_restored``)."""
        module = self._module()
        assert module is not None
        ckpt = module.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        if self.guard is not None:
            ckpt[SDC_HISTORY] = list(self.guard.norms)
        if self.epoch_sums is not None:
            ckpt[EPOCH_SUMS] = self.epoch_sums.state()
        if self.update.skip_pending:
            ckpt[UPDATE_APPLIED] = True
        return ckpt

    def adopt_restored(self, ckpt: Optional[dict]) -> None:
        """A replacement restored ``ckpt``: the guard's history, and if the checkpoint already holds the update of
        its in-flight step, that step is finished without compute or collectives (the strategy's ``skip_pending``
        step): the update skipped, Lightning's step counter and scheduler advanced, as on the member that sent it."""
        self.adopt_guard_history(ckpt)
        if ckpt and ckpt.get(UPDATE_APPLIED):
            self.update.skip_own()

    def awaiting_agreement(self) -> bool:
        return self.update.awaiting_agreement

    def step_norm(self) -> torch.Tensor:
        return self.update.full_grad_norm

    def roll_forward(self, norm: torch.Tensor) -> None:
        """Lightning's own clipping of the step's gradients (by ``norm``, the full model's), then the update."""
        module = self._module()
        assert module is not None
        trainer = module.trainer
        self.update.full_grad_norm = norm
        for opt in self._optimizers():
            trainer.strategy.precision_plugin._clip_gradients(module, opt, trainer.gradient_clip_val,
                                                              trainer.gradient_clip_algorithm)
        self.update.roll_forward()

    def adopt_committed_state(self, ckpt: dict) -> None:
        self.adopt_replica_state(ckpt)
        self.update.skip_own()

    def adopt_replica_state(self, ckpt: dict) -> None:
        module = self._module()
        assert module is not None
        module.load_state_dict(ckpt["state_dict"])
        for opt, state in zip(self._optimizers(), ckpt["optimizer_states"]):
            opt.load_state_dict(state)
        self.adopt_guard_history(ckpt)

    def adopt_guard_history(self, state: Optional[dict]) -> None:
        """The corruption guard's history and the synced epoch values' accumulations of a replica's state."""
        if self.guard is not None and state and SDC_HISTORY in state:
            self.guard.adopt(state[SDC_HISTORY])
        if self.epoch_sums is not None and state:
            self.epoch_sums.adopt(state.get(EPOCH_SUMS))

    def live_weights(self) -> Optional[dict]:
        module = self._module()
        return {"state_dict": module.state_dict()} if module is not None else None

    # -- ZeRO-1 ----------------------------------------------------------------------------------
    @property
    def sharded(self) -> Optional[TrainerState]:
        return self if self.update.zero is not None else None

    @property
    def zero(self) -> ZeroOne:
        assert self.update.zero is not None
        return self.update.zero

    @property
    def replicator(self) -> Any:
        return self.update.replication.replicator if self.update.replication is not None else None

    def final_gradients(self) -> dict:
        """The gradients the last update used: kept in ``.grad`` until the next backward, which no rank can
        have started while a laggard still misses that update (it waits in the parameter sync)."""
        return {"grads": [p.grad for p in self.zero.params],
                **({SDC_HISTORY: list(self.guard.norms)} if self.guard is not None else {})}

    def finish_update(self, final: dict) -> None:
        self.adopt_guard_history(final)
        self.update.finish(final["grads"])

    def own_shard(self) -> dict:
        zero = self.zero
        return {"params": [p.detach() for p in zero.own_optimizer_params()],
                "state": zero.optimizer.state_dict()["state"]}

    def adopt_shard_state(self, ckpt: dict, shard_state: dict) -> None:
        """The source's optimizer state is the source's shard; the parameters are everyone's, synced before
        the source dumped them."""
        mine = self._optimizers()[0].state_dict()["param_groups"]
        source = ckpt["optimizer_states"][0]["param_groups"]
        ckpt["optimizer_states"] = [{"state": shard_state,
                                     "param_groups": [{**s, "params": m["params"]} for s, m in zip(source, mine)]}]
