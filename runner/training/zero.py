"""ZeRO-1: each data-parallel rank keeps the optimizer state of, and updates, only the parameters it owns.

Gradients are still all-reduced in full (the commit point, the corruption guard and the token
accounting need the whole reduced gradient); each rank then updates its own shard, and the next
step begins by all-gathering every owner's updated parameters. Syncing at the start of the next
step instead of right after the update keeps every collective at a step boundary or inside the
reduction, which is where recovery expects them; and every ZeRO-1 recovery ends with a sync of
its own, so whichever collective a member was in when the fault struck, all leave it up to date.

The shards are cut over the DP group: the ranks that hold the same parameters, one per model replica.
With tensor or pipeline parallelism each (pp, tp) coordinate has a DP group of its own and shards its own
slices (of its stage) of the layers. With DP replica groups (HSDP, ``parallel.dp_group_size``) the shards
are cut within each replica group only, so every group holds a whole copy of the optimizer state and the
same shard index in each group holds the same shard. A rank's shard is named by its shard index (its DP
coordinate without replica groups), and the all-gather runs over its shard group (``Comm.allgather_shards``).

With ``master_weights`` (Megatron's distributed optimizer) the module keeps 16-bit parameters and
gradients, and the optimizer steps fp32 master copies of the rank's own parameters, with fp32 Adam
moments: the reduced 16-bit gradients are widened into the masters' gradients, the optimizer steps the
masters, and the masters are rounded back into the module's parameters, which the sync then hands to
everyone. The masters travel in the optimizer's state_dict as ``MASTER_KEY`` of each parameter's state,
so a checkpoint or a replica's state restores them exactly.

Ownership is a pure function of the module's parameter list, the optimizer's groups and the DP
size, so every process (a spare too) computes the same plan without talking to anyone.

When NDB takes a failed rank over (with DeadPool's replicas), the rank that held the replica of its shard *carries*
that shard (at tp*pp > 1 within each (pp, tp) coordinate's DP group, whose shard indices are DP coordinates): it
rebuilds the shard from the replica (``carry``), updates it after its own every step with the same full gradients
and the optimizer's hyper-parameters of the step (``step_carried``, a fresh optimizer of the same kind: the very same
update math) and sends it in the all-gather with its own. Who carries which shard (``carriers``) follows from the
generation's layout, so every member unpacks the same messages.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from runner.training.reducer import trainable_params

MASTER_KEY = "master_weight"  # a parameter's fp32 master copy in the optimizer's state_dict (master_weights)


@dataclass
class ShardPlan:
    """Who owns which parameter; parameters are indices into the module's trainable parameter list."""

    owner: list[int]  # owner[i]: the shard index that updates parameter i
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

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, dp: int, *,
                 master_weights: bool = False) -> None:
        self.params = trainable_params(module)
        if len({p.dtype for p in self.params}) > 1:
            raise ValueError("parallel.zero=1 needs all trainable parameters in one dtype (use a 32-true or "
                             "bf16-true precision, not a mix)")
        if optimizer.state:
            raise RuntimeError("ZeRO-1 sharding must happen before the optimizer's first step")
        if master_weights and self.params[0].dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"trainer.master_weights=true keeps fp32 masters of 16-bit parameters, but the module's "
                             f"parameters are {self.params[0].dtype}: use trainer.precision=bf16-true")
        index = {id(p): i for i, p in enumerate(self.params)}
        groups = [[index[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        self.plan = ShardPlan.balanced(self.params, groups, dp)
        self.unsharded = [p for group in optimizer.param_groups for p in group["params"]]  # the optimizer's own order
        self.optimizer = optimizer
        self.master_weights = master_weights
        self.masters: dict[int, Tensor] = {}  # master_weights: parameter index -> its fp32 master (own shard only)
        self.names = {index[id(p)]: n for n, p in module.named_parameters() if id(p) in index}
        self._width = max(1, max(sum(self.params[i].numel() for i in self.plan.flat_shard(r)) for r in range(dp)))
        self._send = torch.zeros(self._width, dtype=self.params[0].dtype, device=self.params[0].device)
        self.stale = False  # other owners' parameters are one update behind until the next sync
        self._rank = -1
        self.carriers: dict[int, int] = {}  # NDB: a failed rank's shard -> the shard index of the rank carrying it
        self._carried: dict[int, CarriedShard] = {}  # the shards this rank carries, by shard index

    @property
    def rank(self) -> int:
        """The shard index (the DP coordinate within the replica group) whose shard this rank holds (set by
        ``shard_for``)."""
        return self._rank

    def shard_for(self, dp_rank: int) -> None:
        """Keep only shard ``dp_rank``'s parameters in the optimizer's groups (group indices stay); with master
        weights, their fp32 masters instead.

        ``zero_grad`` keeps clearing every parameter's gradient: all of them still go into the full
        all-reduce, and a gradient left over from the previous step would be added to the next one. It
        always drops the gradients (``set_to_none``), never zeroes them in place: DeadPool's replay
        records keep the last update's gradients by reference.
        """
        self._rank = dp_rank
        own = self.plan.shard(dp_rank)
        if self.master_weights:
            self.masters = {i: self.params[i].detach().float() for group in own for i in group}
        for group, indices in zip(self.optimizer.param_groups, own):
            group["params"] = [self.masters[i] if self.master_weights else self.params[i] for i in indices]
        params = self.params

        def zero_grad(set_to_none: bool = True) -> None:
            for p in params:
                p.grad = None

        self.optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
        if self.master_weights:
            self._step_masters()

    def _own_masters(self) -> list[Tensor]:
        """The masters in the sharded optimizer's numbering (its state_dict's parameter numbers)."""
        return [self.masters[i] for i in self.plan.flat_shard(self._rank)]

    def _step_masters(self) -> None:
        """Route the optimizer's step through the masters, and carry them in its state_dict."""
        optimizer, inner = self.optimizer, self.optimizer.step

        def step(closure: Optional[Callable[[], Any]] = None) -> Any:
            loss = closure() if closure is not None else None
            with torch.no_grad():
                for i, master in self.masters.items():
                    grad = self.params[i].grad
                    master.grad = None if grad is None else grad.float()
            inner()
            with torch.no_grad():
                for i, master in self.masters.items():
                    self.params[i].copy_(master)
                    master.grad = None  # only the update needs the fp32 gradient
            return loss

        optimizer.step = step  # type: ignore[method-assign]
        optimizer.register_state_dict_post_hook(self._with_masters)
        optimizer.register_load_state_dict_pre_hook(self._adopt_masters)

    def _with_masters(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        masters = self._own_masters()
        state_dict["state"] = {k: {**s, MASTER_KEY: masters[k]} for k, s in state_dict["state"].items()}
        return state_dict

    def _adopt_masters(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        """Loading the optimizer: every master from its module parameter (loaded just before), then from the
        state's own master where it has one (a parameter without optimizer state was never updated, so its
        16-bit value is exact)."""
        masters, own = self._own_masters(), self.plan.flat_shard(self._rank)
        with torch.no_grad():
            for master, i in zip(masters, own):
                master.copy_(self.params[i])
            for k, s in state_dict["state"].items():
                if MASTER_KEY in s:
                    masters[k].copy_(s[MASTER_KEY])
        state = {k: {key: v for key, v in s.items() if key != MASTER_KEY} for k, s in state_dict["state"].items()}
        return {**state_dict, "state": state}

    def own_optimizer_params(self) -> list[Tensor]:
        """This rank's shard as its optimizer steps it, in the optimizer's order: the fp32 masters with master
        weights, else the module's own parameters. A copy of the shard (DeadPool's replica, the shard a peer
        in another DP replica group hands over) is these and their optimizer state, so it restores exactly."""
        if self.master_weights:
            return self._own_masters()
        return [self.params[i] for i in self.plan.flat_shard(self._rank)]

    def shard_state_dict(self, params: list[Tensor], state: dict) -> dict:
        """The optimizer state of a copy of this rank's shard (``params`` from ``own_optimizer_params``, ``state``
        by position) as this optimizer's state_dict carries it: with master weights, each parameter's fp32 master
        as ``MASTER_KEY``, which loading the state_dict puts back into the masters."""
        if not self.master_weights:
            return state
        return {pos: {**state.get(pos, {}), MASTER_KEY: p} for pos, p in enumerate(params)}

    def load_own(self, params: list[Tensor]) -> None:
        """A joiner's shard parameters (from a copy of the shard), in place, before the sync hands them to everyone;
        fp32 masters are rounded into the 16-bit parameters as an update rounds them."""
        with torch.no_grad():
            for i, value in zip(self.plan.flat_shard(self._rank), params):
                self.params[i].copy_(value)

    # -- NDB: the shards of failed ranks, carried by the holders of their replicas ------------------------------
    def set_carriers(self, carriers: dict[int, int]) -> None:
        """Who carries which failed rank's shard in this generation (the same on every member); this rank stops
        carrying a shard no longer in ``carriers`` (its owner is back)."""
        self.carriers = dict(carriers)
        self._carried = {s: c for s, c in self._carried.items() if self.carriers.get(s) == self._rank}
        width = max(sum(self.params[i].numel() for s in self.sent_by(r) for i in self.plan.flat_shard(s))
                    for r in range(self.plan.dp) if r not in self.carriers)
        if width != self._send.numel():
            self._send = torch.zeros(max(1, width), dtype=self._send.dtype, device=self._send.device)

    def carries(self, shard: int) -> bool:
        return shard in self._carried

    def carry(self, shard: int, params: list[Tensor], state: dict) -> None:
        """Take over shard ``shard``'s updates from a copy of it (``params`` as its owner's ``own_optimizer_params``,
        ``state`` its optimizer state by position, as DeadPool's replica holds them: ``ShardState``); its values go
        into the module's parameters, as an update leaves them."""
        indices = self.plan.flat_shard(shard)
        groups = [g for g, idx in enumerate(self.plan.shard(shard)) for _ in idx]
        if self.master_weights:
            tensors = [p.detach().clone() for p in params]
        else:
            tensors = [self.params[i] for i in indices]
            with torch.no_grad():
                for t, value in zip(tensors, params):
                    t.copy_(value)
        optimizer = optimizer_like(self.optimizer, tensors, groups, state)
        self._carried[shard] = CarriedShard(indices, tensors, optimizer)
        self._round_carried(self._carried[shard])

    def step_carried(self) -> None:
        """Update every carried shard as its owner would have: with its part of the full gradients and this step's
        hyper-parameters (after this rank's own update)."""
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        for carried in self._carried.values():
            if self.master_weights:  # else the tensors are the module's parameters, with their gradients
                for i, master in zip(carried.indices, carried.tensors):
                    grad = self.params[i].grad
                    master.grad = None if grad is None else grad.float()
            for group, h in zip(carried.optimizer.param_groups, hyper):
                group.update(h)
            type(carried.optimizer).step(carried.optimizer)
            self._round_carried(carried)

    def carried_shard(self, shard: int) -> tuple[list[Tensor], dict]:
        """A carried shard as its owner's ``own_optimizer_params`` and optimizer state (by position) would give it,
        for the owner's replacement."""
        carried = self._carried[shard]
        state = carried.optimizer.state
        return ([t.detach() for t in carried.tensors],
                {pos: dict(state[t]) for pos, t in enumerate(carried.tensors) if state[t]})

    def carried_state_by_param(self) -> dict[int, dict]:
        """The carried shards' optimizer state by parameter index, as their owners' state_dicts would give it (with
        master weights, each master as ``MASTER_KEY``): a checkpoint's gathered optimizer state holds them too."""
        out = {}
        for shard, carried in self._carried.items():
            for pos, state in self.shard_state_dict(*self.carried_shard(shard)).items():
                out[carried.indices[pos]] = state
        return out

    def _round_carried(self, carried: CarriedShard) -> None:
        """With master weights, the carried fp32 masters rounded into the module's 16-bit parameters."""
        if not self.master_weights:
            return
        with torch.no_grad():
            for i, master in zip(carried.indices, carried.tensors):
                self.params[i].copy_(master)
                master.grad = None

    def sent_by(self, rank: int) -> list[int]:
        """The shards member ``rank`` sends in the all-gather: its own, then those it carries."""
        return [rank] + sorted(s for s, c in self.carriers.items() if c == rank)

    def sync(self, comm) -> None:
        """All-gather over the shard group: every member sends its own shard (and those it carries) and copies the
        others' into its parameters."""
        offset = 0
        for shard in self.sent_by(self._rank):
            for i in self.plan.flat_shard(shard):
                n = self.params[i].numel()
                self._send[offset:offset + n].copy_(self.params[i].detach().reshape(-1))
                offset += n
        gathered = comm.allgather_shards(self._send)
        with torch.no_grad():
            for owner, flat in gathered.items():
                if owner == self._rank:
                    continue
                offset = 0
                for shard in self.sent_by(owner):
                    for i in self.plan.flat_shard(shard):
                        p = self.params[i]
                        p.copy_(flat[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()
        self.stale = False


@dataclass
class CarriedShard:
    """A failed rank's shard that this rank updates in its place: the module's parameter indices, the tensors its
    optimizer steps (the module's parameters, or fp32 masters) and that optimizer."""

    indices: list[int]
    tensors: list[Tensor]
    optimizer: torch.optim.Optimizer


def optimizer_like(template: torch.optim.Optimizer, params: Sequence[Tensor], groups: list[int],
                   state: dict[int, dict[str, Any]]) -> torch.optim.Optimizer:
    """A fresh optimizer of ``template``'s kind and hyper-parameters over ``params`` (``groups[pos]``: the template's
    group of the parameter at ``pos``), with ``state`` by position (cloned). Its update is the template's very math;
    step it with ``type(opt).step(opt)``, as the template's own ``step`` may be wrapped."""
    opt = copy.copy(template)  # a new optimizer object: defaults only, no parameters, no state, no wrappers
    opt.param_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in template.param_groups]
    opt.state = defaultdict(dict)
    for pos, p in enumerate(params):
        opt.param_groups[groups[pos]]["params"].append(p)
    for pos, p in enumerate(params):
        opt.state[p] = {k: v.clone() if isinstance(v, Tensor) else v for k, v in state.get(pos, {}).items()}
    return opt
