"""ZeRO-1: each data-parallel rank keeps the optimizer state of, and updates, only the parameters it owns.

Gradients are still all-reduced in full (the commit point, the corruption guard and the token
accounting need the whole reduced gradient); each rank then updates its own shard, and the next
step begins by all-gathering every owner's updated parameters. Syncing at the start of the next
step instead of right after the update keeps every collective at a step boundary or inside the
reduction, which is where recovery expects them; and every ZeRO-1 recovery ends with a sync of
its own, so whichever collective a member was in when the fault struck, all leave it up to date.

Ownership is a pure function of the module's parameter list, the optimizer's groups and the DP
size, so every process (a spare too) computes the same plan without talking to anyone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from runner.reducer import trainable_params


@dataclass
class ShardPlan:
    """Who owns which parameter; parameters are indices into the module's trainable parameter list."""

    owner: list[int]  # owner[i]: the logical rank that updates parameter i
    groups: list[list[int]]  # the optimizer's param groups before sharding, as parameter indices
    dp: int

    @staticmethod
    def balanced(params: list[Tensor], groups: list[list[int]], dp: int) -> ShardPlan:
        """Whole tensors, largest first, each to the least-loaded rank (ties: lowest rank)."""
        load = [0] * dp
        owner = [0] * len(params)
        for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
            rank = min(range(dp), key=lambda r: (load[r], r))
            owner[i] = rank
            load[rank] += params[i].numel()
        return ShardPlan(owner, groups, dp)

    def shard(self, rank: int) -> list[list[int]]:
        """The parameters ``rank`` owns, per optimizer group, in optimizer order."""
        return [[i for i in group if self.owner[i] == rank] for group in self.groups]

    def flat_shard(self, rank: int) -> list[int]:
        return [i for group in self.shard(rank) for i in group]


class ZeroOne:
    """A rank's sharded optimizer and the all-gather that brings everyone's parameters up to date."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, dp: int) -> None:
        self.params = trainable_params(module)
        if len({p.dtype for p in self.params}) > 1:
            raise ValueError("parallel.zero=1 needs all trainable parameters in one dtype (use a 32-true or "
                             "bf16-true precision, not a mix)")
        if optimizer.state:
            raise RuntimeError("ZeRO-1 sharding must happen before the optimizer's first step")
        index = {id(p): i for i, p in enumerate(self.params)}
        groups = [[index[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        self.plan = ShardPlan.balanced(self.params, groups, dp)
        self.unsharded = [p for group in optimizer.param_groups for p in group["params"]]  # the optimizer's own order
        self.optimizer = optimizer
        self.names = {index[id(p)]: n for n, p in module.named_parameters() if id(p) in index}
        self._width = max(1, max(sum(self.params[i].numel() for i in self.plan.flat_shard(r)) for r in range(dp)))
        self._send = torch.zeros(self._width, dtype=self.params[0].dtype, device=self.params[0].device)
        self.stale = False  # other owners' parameters are one update behind until the next sync
        self._rank = -1

    def shard_for(self, logical_rank: int) -> None:
        """Keep only ``logical_rank``'s parameters in the optimizer's groups (group indices stay).

        ``zero_grad`` keeps clearing every parameter's gradient: all of them still go into the full
        all-reduce, and a gradient left over from the previous step would be added to the next one. It
        always drops the gradients (``set_to_none``), never zeroes them in place: DeadPool's replay
        records keep the last update's gradients by reference.
        """
        self._rank = logical_rank
        for group, indices in zip(self.optimizer.param_groups, self.plan.shard(logical_rank)):
            group["params"] = [self.params[i] for i in indices]
        params = self.params

        def zero_grad(set_to_none: bool = True) -> None:
            for p in params:
                p.grad = None

        self.optimizer.zero_grad = zero_grad  # type: ignore[method-assign]

    def load_own(self, params: list[Tensor]) -> None:
        """A joiner's shard parameters (from the replica), in place, before the sync hands them to everyone."""
        with torch.no_grad():
            for i, value in zip(self.plan.flat_shard(self._rank), params):
                self.params[i].copy_(value)

    def sync(self, comm) -> None:
        """All-gather: every member sends its own shard and copies the others' into its parameters."""
        offset = 0
        for i in self.plan.flat_shard(self._rank):
            n = self.params[i].numel()
            self._send[offset:offset + n].copy_(self.params[i].detach().reshape(-1))
            offset += n
        gathered = comm.allgather(self._send)
        with torch.no_grad():
            for pg_rank, flat in enumerate(gathered):
                owner = comm.layout.logical[pg_rank]
                if owner == self._rank:
                    continue
                offset = 0
                for i in self.plan.flat_shard(owner):
                    p = self.params[i]
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
        self.stale = False

