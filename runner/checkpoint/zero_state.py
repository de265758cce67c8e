"""ZeRO-1 optimizer state in a checkpoint: every owner's shard gathered into the state of one unsharded
optimizer, and a rank's shard cut out of such a state again.

Under ZeRO-1 each rank's optimizer holds only the parameters it owns (``runner.training.zero``). The checkpoint
holds what an unsharded optimizer's ``state_dict()`` would: parameters numbered in the optimizer's own
order, group after group. It therefore loads into a plain optimizer (a single-process
``Trainer.fit(ckpt_path=...)``) as well as back into ZeRO-1 shards, for any DP size. With tensor
parallelism the shards are gathered over the rank's shard group (its DP group, or with DP replica groups the
part of it in its replica group, which holds every shard once), which gives the unsharded optimizer state of
its TP slice (``runner.checkpoint.tp_state`` gathers the slices). fp32 master weights (``MASTER_KEY``) are
per-parameter state like the Adam moments, so they are gathered and cut with them.
"""

from __future__ import annotations

from typing import Any

import torch

from runner.training.comm import Comm
from runner.training.packed import from_bytes, to_bytes
from runner.training.zero import ShardPlan, ZeroOne


def _unsharded_position(plan: ShardPlan) -> dict[int, int]:
    """Parameter index (into ``ZeroOne.params``) -> its number in an unsharded optimizer's state_dict."""
    return {i: n for n, i in enumerate(i for group in plan.groups for i in group)}


def own_state_by_param(zero: ZeroOne, rank: int) -> dict[int, Any]:
    """This rank's optimizer state, keyed by parameter index instead of the shard's own numbering, with the state
    of the shards it carries for failed ranks (NDB)."""
    state = zero.optimizer.state_dict()["state"]
    own = {i: state[k] for k, i in enumerate(zero.plan.flat_shard(rank)) if k in state}
    return {**own, **zero.carried_state_by_param()}


def gather_full_state(zero: ZeroOne, rank: int, comm: Comm) -> dict:
    """All-gather every shard of the rank's shard group (collectives of the current generation: every member calls
    this at the same step) and assemble the unsharded optimizer's state_dict; ``rank`` is this member's shard
    index."""
    data = to_bytes(own_state_by_param(zero, rank), comm.device)
    sizes = comm.allgather_shards(torch.tensor([data.numel()], dtype=torch.int64, device=comm.device))
    width = max(int(s[0]) for s in sizes.values())
    padded = torch.zeros(width, dtype=torch.uint8, device=comm.device)
    padded[: data.numel()] = data
    shards = [from_bytes(flat[: int(sizes[owner][0])]) for owner, flat in comm.allgather_shards(padded).items()]
    position = _unsharded_position(zero.plan)
    groups = zero.optimizer.state_dict()["param_groups"]
    return {"state": {position[i]: s for shard in shards for i, s in shard.items()},
            "param_groups": [{**g, "params": [position[i] for i in indices]}
                             for g, indices in zip(groups, zero.plan.groups)]}


def shard_of_full_state(zero: ZeroOne, rank: int, full: dict) -> dict:
    """The state_dict ``rank``'s sharded optimizer loads, from an unsharded optimizer's state_dict."""
    position = _unsharded_position(zero.plan)
    own = zero.plan.flat_shard(rank)
    state = {k: full["state"][position[i]] for k, i in enumerate(own) if position[i] in full["state"]}
    groups, first = [], 0
    for g, indices in zip(full["param_groups"], zero.plan.shard(rank)):
        groups.append({**g, "params": list(range(first, first + len(indices)))})
        first += len(indices)
    return {"state": state, "param_groups": groups}
