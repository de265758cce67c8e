"""Tensor-parallel state in a checkpoint: every TP rank's slices of the parameters and of their optimizer
state gathered into the state of one unsharded model and optimizer, and a rank's slices cut out of it again.

A TP run's parameters keep the unsharded model's names and order (``shard_gpt_for_tp``), so its optimizer
numbers them as the unsharded model's optimizer does. A sharded parameter's optimizer state of its own
shape (Adam's moments) is gathered and cut with the parameter's ``ShardLayout``; the rest (step counts,
replicated parameters and their state) is the same on every TP rank and is taken as it is. The file
therefore loads into the unsharded GPT (``GPTModule.load_from_checkpoint``, a tp = 1 run) and, sliced
again, into a run at any tp that divides the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runner.parallel.tensor import gather_shards, shard_layouts


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


def slice_model_state(state_dict: dict, module: nn.Module) -> dict:
    """``state_dict`` of the unsharded model with every TP-sharded parameter cut to this rank's slice."""
    layouts = shard_layouts(module)
    return {name: _slice(t, *layouts[name]) if name in layouts else t for name, t in state_dict.items()}


def slice_optimizer_state(full: dict, module: nn.Module, order: list[torch.Tensor]) -> dict:
    """The state_dict of an optimizer over this rank's slices of the parameters ``order``, from the unsharded
    optimizer's state_dict ``full``."""
    layouts, params, names = shard_layouts(module), dict(module.named_parameters()), _param_names(module, order)
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
