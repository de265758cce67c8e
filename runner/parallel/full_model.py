"""The unsharded model's state from a model-parallel rank's slice of it: its tensor-parallel slices gathered over
the TP group, then its pipeline stages over the PP group, under the names the unsharded ``GPTModule`` uses.

Every rank of a replica gets the full state, so the summary's checksum compares one model whatever the layout,
and a checkpoint written from it loads at any other layout (``runner.checkpoint.tp_state``). Stages exchange
their state as bytes (they hold different tensors), so the gather over the PP group is a size all-gather and a
byte all-gather.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runner.parallel.generation_group import GenerationGroup
from runner.parallel.pipeline import GPTStage
from runner.parallel.tensor import gather_full
from runner.training.comm import Comm
from runner.training.packed import from_bytes, to_bytes

MODEL_PREFIX = "model."  # GPTModule's attribute holding the GPT (or, with pp > 1, its stage)


def tp_group(comm: Comm) -> GenerationGroup:
    """This rank's tensor-parallel group, across generations."""
    return GenerationGroup(comm, "tp", comm.tp_rank, comm.tp)


def pp_group(comm: Comm) -> GenerationGroup:
    """This rank's pipeline, across generations (the group rank is the stage)."""
    return GenerationGroup(comm, "pp", comm.pp_rank, comm.pp)


def full_state_name(name: str, stage: GPTStage) -> str:
    """The unsharded module's state_dict name of this stage's entry ``name`` (its blocks count from 0; the head
    keeps its name, as the unsharded GPT's state_dict lists its tied weight under both)."""
    if not name.startswith(MODEL_PREFIX + "blocks."):
        return name
    _, _, index, rest = name.split(".", 3)
    return f"{MODEL_PREFIX}blocks.{stage.first_block + int(index)}.{rest}"


def gather_model(module: nn.Module, comm: Comm) -> dict[str, torch.Tensor]:
    """The full model's state_dict, as the unsharded module has it. Every rank of the replica calls it."""
    state = module.state_dict()
    if comm.tp > 1:
        state = {**state, **{name: t for name, t in gather_full(module, tp_group(comm)).items() if t is not None}}
    stage = getattr(module, "model", None)
    if comm.pp > 1 and isinstance(stage, GPTStage):
        mine = {full_state_name(name, stage): t for name, t in state.items()}
        state = {}
        for theirs in allgather_objects(mine, pp_group(comm)):
            state.update(theirs)
    return state


def allgather_objects(obj: Any, group: GenerationGroup) -> list[Any]:
    """Every group member's ``obj`` (tensors and plain containers), in group-rank order."""
    device = group.comm.device
    data = to_bytes(obj, device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(group.size())]
    group.allgather([sizes], [size])
    longest = int(max(int(s) for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    out = [torch.empty_like(padded) for _ in range(group.size())]
    group.allgather([out], [padded])
    return [from_bytes(b[: int(s)]) for b, s in zip(out, sizes)]
