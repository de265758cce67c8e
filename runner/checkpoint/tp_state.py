"""Model-parallel state in a checkpoint: every TP rank's slices of the parameters and of their optimizer
state, and every pipeline stage's, gathered into the state of one unsharded model and optimizer, and a rank's
slices and stage cut out of it again.

A TP run's parameters keep the unsharded model's names and order (``shard_gpt_for_tp``), so its optimizer
numbers them as the unsharded model's optimizer does. A sharded parameter's optimizer state of its own
shape (Adam's moments) is gathered and cut with the parameter's ``ShardLayout``; the rest (step counts,
replicated parameters and their state) is the same on every TP rank and is taken as it is. The file
therefore loads into the unsharded GPT (``GPTModule.load_from_checkpoint``, a tp = 1 run) and, sliced
again, into a run at any tp that divides the model.

A pipeline stage (``GPTStage``) numbers its blocks from 0 and its optimizer numbers only its own parameters.
Stages exchange their (TP-gathered) state by name over the PP group; the unsharded optimizer's numbering is
each optimizer group's parameters stage after stage, which is the unsharded module's own (its groups take
the parameters in model order, and the stages hold consecutive parts of it). The last stage's copy of the
tied embedding is the first stage's embedding, so its optimizer state is taken from the first stage.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runner.parallel.full_model import allgather_objects, full_state_name, pp_group
from runner.parallel.pipeline import GPTStage
from runner.parallel.tensor import gather_shards, shard_layouts
from runner.training.comm import Comm


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters ``optimizer``'s state_dict numbers, in that order (group after group)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _param_names(module: nn.Module, order: list[torch.Tensor]) -> list[str]:
    """The parameter name of each number of an optimizer state_dict over the parameters ``order``."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [names[id(p)] for p in order]


def _own_shape(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def gather_tp_state(module: nn.Module, optimizers: list[tuple[dict, list[torch.Tensor]]]) -> tuple[dict, list[dict]]:
    """The full parameters by state_dict name and the unsharded optimizers' state_dicts of the TP-sharded
    ``module``, from each optimizer's state_dict of this rank's slices with the parameters it numbers
    (``optimizer_params``; under ZeRO-1 the DP-gathered state and the unsharded order). Every rank of the TP
    group calls it at the same step (one all-gather per sharded tensor, in the same order on every rank)."""
    layouts, params = shard_layouts(module), dict(module.named_parameters())
    full_params = {name: gather_shards(p.detach(), *layouts[name]) for name, p in params.items() if name in layouts}
    states = []
    for sd, order in optimizers:
        names = _param_names(module, order)
        state = {}
        for k in sorted(sd["state"]):
            name = names[k]
            state[k] = {key: gather_shards(v, *layouts[name]) if name in layouts and _own_shape(v, params[name])
                        else v for key, v in sd["state"][k].items()}
        states.append({"state": state, "param_groups": sd["param_groups"]})
    return full_params, states


def gather_replica_state(module: nn.Module, optimizers: list[tuple[dict, list[torch.Tensor]]],
                         comm: Comm) -> tuple[dict, list[dict]]:
    """The unsharded module's whole state_dict and the unsharded optimizers' state_dicts, from this rank's TP
    slice of its pipeline stage and each optimizer's state_dict with the parameters it numbers (as
    ``gather_tp_state`` takes them). Every rank of the replica calls it at the same step (over its TP group,
    then its PP group)."""
    state = module.state_dict()
    states = [sd for sd, _ in optimizers]
    if comm.tp > 1:
        full_params, states = gather_tp_state(module, optimizers)
        state = {**state, **full_params}
    stage = _stage(module)
    if comm.pp == 1 or stage is None:
        return state, states
    names = {id(p): n for n, p in module.named_parameters()}
    tied = stage.tied_weight() if stage.is_last and not stage.is_first else None
    mine: dict[str, Any] = {"state": {full_state_name(n, stage): t for n, t in state.items()}, "optimizers": []}
    for (_, order), sd in zip(optimizers, states):
        full_names = [None if p is tied else full_state_name(names[id(p)], stage) for p in order]
        groups, k = [], 0
        for group in sd["param_groups"]:  # each group's parameters by unsharded name, the tied copy left out
            groups.append([n for n in full_names[k:k + len(group["params"])] if n is not None])
            k += len(group["params"])
        hyper = [{key: v for key, v in g.items() if key != "params"} for g in sd["param_groups"]]
        mine["optimizers"].append({"groups": groups, "hyper": hyper, "state": {
            full_names[i]: entry for i, entry in sd["state"].items() if full_names[i] is not None}})
    stages = allgather_objects(mine, pp_group(comm))
    full_state: dict = {}
    for theirs in stages:
        full_state.update(theirs["state"])
    unsharded = []
    for j in range(len(optimizers)):
        parts = [theirs["optimizers"][j] for theirs in stages]
        order = [n for g in range(len(parts[0]["groups"])) for part in parts for n in part["groups"][g]]
        index = {n: i for i, n in enumerate(order)}
        merged: dict = {}
        for part in parts:
            merged.update({index[n]: entry for n, entry in part["state"].items()})
        param_groups, start = [], 0
        for g, hyper in enumerate(parts[0]["hyper"]):
            count = sum(len(part["groups"][g]) for part in parts)
            param_groups.append({**hyper, "params": list(range(start, start + count))})
            start += count
        unsharded.append({"state": dict(sorted(merged.items())), "param_groups": param_groups})
    return full_state, unsharded


def _stage(module: nn.Module) -> GPTStage | None:
    stage = getattr(module, "model", None)
    return stage if isinstance(stage, GPTStage) else None


def slice_model_state(state_dict: dict, module: nn.Module) -> dict:
    """``state_dict`` of the unsharded model cut to this rank's pipeline stage, with every TP-sharded parameter
    cut to this rank's slice."""
    stage = _stage(module)
    if stage is not None and stage.stages > 1:
        state_dict = {name: state_dict[full_state_name(name, stage)] for name in module.state_dict()}
    layouts = shard_layouts(module)
    return {name: _slice(t, *layouts[name]) if name in layouts else t for name, t in state_dict.items()}


def slice_optimizer_state(full: dict, module: nn.Module, order: list[torch.Tensor]) -> dict:
    """The state_dict of an optimizer over this rank's slices (of its pipeline stage) of the parameters
    ``order``, from the unsharded optimizer's state_dict ``full``."""
    layouts, params, names = shard_layouts(module), dict(module.named_parameters()), _param_names(module, order)
    stage = _stage(module)
    if stage is not None and stage.stages > 1:
        full = _stage_optimizer_state(full, module, order, stage)
    state = {}
    for k, entry in full["state"].items():
        name = names[k]
        if name not in layouts:
            state[k] = entry
            continue
        layout, group = layouts[name]
        shape = list(params[name].shape)
        shape[layout.dim] *= group.size()
        state[k] = {key: _slice(v, layout, group) if isinstance(v, torch.Tensor) and list(v.shape) == shape else v
                    for key, v in entry.items()}
    return {"state": state, "param_groups": full["param_groups"]}


def _slice(full: torch.Tensor, layout, group) -> torch.Tensor:
    return layout.shard(full, group.rank(), group.size())


def _stage_optimizer_state(full: dict, module: Any, order: list[torch.Tensor], stage: GPTStage) -> dict:
    """The unsharded optimizer's state_dict ``full`` renumbered for this stage's optimizer over ``order``: the
    unsharded numbering, and the group of each parameter, are those of the unsharded module's optimizer, which a
    parameter-less copy of the module (on the meta device) gives by name."""
    with torch.device("meta"):
        reference = type(module)(**module.hparams)  # a GPTModule: pp > 1 trains no other model
    configured = reference.configure_optimizers()
    ref_opt = configured["optimizer"] if isinstance(configured, dict) else configured
    ref_names = {id(p): n for n, p in reference.named_parameters()}
    number = {ref_names[id(p)]: i for i, p in enumerate(optimizer_params(ref_opt))}
    group_of = {ref_names[id(p)]: g for g, group in enumerate(ref_opt.param_groups) for p in group["params"]}
    tied = stage.tied_weight()
    own = {id(p): n for n, p in module.named_parameters()}
    names = ["model.tok_emb.weight" if p is tied else full_state_name(own[id(p)], stage) for p in order]
    state = {i: full["state"][number[name]] for i, name in enumerate(names) if number[name] in full["state"]}
    groups = [{**hyper, "params": [i for i, name in enumerate(names) if group_of[name] == g]}
              for g, hyper in enumerate(full["param_groups"])]
    return {"state": state, "param_groups": groups}
