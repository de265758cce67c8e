"""A ZeRO-1 shard as bytes: its parameters and optimizer state, packed without pickling tensors.

The owner packs its shard into one flat byte buffer per step (one foreach copy of all its
tensors) plus a small layout description that changes only when the optimizer's state gains keys
(its first step). The holder of the replica keeps the bytes as they came and decodes them only when a
replacement needs them, possibly replaying the updates it missed (``replay``).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from runner.training.packed import aligned, typed_view
from runner.training.zero import optimizer_like


@dataclass
class ShardLayout:
    """Where each tensor of a shard lives in the packed bytes; ``values`` holds non-tensor state."""

    # (position, key, dtype, shape, offset); key "" = the parameter
    entries: list[tuple[int, str, str, tuple[int, ...], int]]
    values: dict[tuple[int, str], Any] = field(default_factory=dict)
    nbytes: int = 0


@dataclass
class ShardState:
    """A shard decoded: the tensors its optimizer steps (``ZeroOne.own_optimizer_params``: the parameters, or
    their fp32 masters) in optimizer order, and the optimizer state by position."""

    gen: int  # optimizer updates it includes
    params: list[Tensor]
    state: dict[int, dict[str, Any]]
    base_gen: int = -1  # the replica it was rebuilt from (gen - base_gen updates replayed)

    def to_payload(self) -> dict:
        """Plain containers and tensors only: what ``torch.load(weights_only=True)`` accepts."""
        return {"gen": self.gen, "base_gen": self.base_gen, "params": self.params, "state": self.state}

    @staticmethod
    def from_payload(payload: dict) -> ShardState:
        return ShardState(payload["gen"], payload["params"], payload["state"], payload["base_gen"])


def describe(params: list[Tensor], optimizer: torch.optim.Optimizer) -> ShardLayout:
    """The packed layout of this rank's shard as it is now."""
    entries, values, offset = [], {}, 0
    for pos, p in enumerate(params):
        tensors = [("", p.detach())]
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, Tensor):
                tensors.append((key, value))
            else:
                values[(pos, key)] = value
        for key, t in tensors:
            entries.append((pos, key, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
            offset += aligned(t.numel() * t.element_size())
    return ShardLayout(entries, values, offset)


class ShardPacker:
    """Copies a shard into one byte buffer, every tensor in a single ``_foreach_copy_`` (a copy_ per
    tensor cost ~3x as much in dispatch as in copying for a small model's shard, every step). The
    typed views of the buffer are made once per layout."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._views: list[Tensor] = []
        self._entries: tuple = ()  # (prefix, layout entries) the views were made for

    def pack(self, params: list[Tensor], optimizer: torch.optim.Optimizer, layout: ShardLayout,
             prefix: int = 0) -> Tensor:
        """``prefix`` bytes left for the caller, then the shard's bytes: a view of the buffer,
        ``prefix + layout.nbytes`` long, valid until the next pack."""
        if self.buffer.numel() < prefix + layout.nbytes:
            self.buffer, self._entries = torch.empty(prefix + layout.nbytes, dtype=torch.uint8), ()
        if self._entries != (prefix, layout.entries):
            self._views = [typed_view(self.buffer, dtype, shape, prefix + offset)
                           for _, _, dtype, shape, offset in layout.entries]
            self._entries = (prefix, layout.entries)
        state = optimizer.state
        tensors = [params[pos].detach() if key == "" else state[params[pos]][key] for pos, key, *_ in layout.entries]
        torch._foreach_copy_(self._views, tensors)
        return self.buffer[: prefix + layout.nbytes]


def unpack(layout: ShardLayout, data: Tensor, gen: int) -> ShardState:
    """Fresh tensors (never views of ``data``, which the next replication overwrites)."""
    params: dict[int, Tensor] = {}
    state: dict[int, dict[str, Any]] = defaultdict(dict)
    for pos, key, dtype, shape, offset in layout.entries:
        t = typed_view(data, dtype, shape, offset).clone()
        if key == "":
            params[pos] = t
        else:
            state[pos][key] = t
    for (pos, key), value in layout.values.items():
        state[pos][key] = value
    return ShardState(gen, [params[i] for i in range(len(params))], dict(state), gen)


@dataclass
class UpdateRecord:
    """What one optimizer update of a shard used: its final (reduced, clipped) gradients and hyper-parameters."""

    gen: int  # the update produced this generation
    grads: list[Tensor]
    hyper: list[dict[str, Any]]


class LiveShard:
    """A copy of a shard that updates itself: the tensors its owner's optimizer steps and a fresh optimizer of the
    owner's kind (``optimizer_like``: the very same update math) over them, with the shard's state. ``apply`` makes
    the update an ``UpdateRecord`` describes, as the owner made it; a replay (``replay``) and DeadPool's replica kept
    current by replaying every update (``ft.deadpool.replication=replay``) are both this."""

    def __init__(self, template: torch.optim.Optimizer, shard: ShardState, groups: list[int]) -> None:
        """``groups[pos]``: the optimizer group of the shard's parameter at ``pos`` (positions are group-major)."""
        self.params = [torch.nn.Parameter(t.clone()) for t in shard.params]
        self.optimizer = optimizer_like(template, self.params, groups, shard.state)
        self.gen = shard.gen
        self.base_gen = shard.base_gen

    def apply(self, record: UpdateRecord) -> None:
        if record.gen != self.gen + 1:
            raise ValueError(f"replay gap: shard at update {self.gen}, next record produces {record.gen}")
        opt = self.optimizer
        for group, hyper in zip(opt.param_groups, record.hyper):
            group.update(hyper)
        for p, g in zip(self.params, record.grads):
            p.grad = g.to(p.dtype)  # a 16-bit gradient widened for an fp32 master, as the update does
        type(opt).step(opt)
        for p in self.params:
            p.grad = None
        self.gen = record.gen

    def state(self, base_gen: int | None = None) -> ShardState:
        """A snapshot (fresh tensors); ``base_gen``: the replica it counts as rebuilt from (default: its own)."""
        opt = self.optimizer
        state = {pos: {k: v.clone() if isinstance(v, Tensor) else v for k, v in opt.state[p].items()}
                 for pos, p in enumerate(self.params) if opt.state[p]}
        return ShardState(self.gen, [p.detach().clone() for p in self.params], state,
                          self.base_gen if base_gen is None else base_gen)

    def digest(self) -> bytes:
        return digest(self.params, self.optimizer)

    def nbytes(self) -> int:
        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
        tensors = [*self.params, *state]
        return sum(t.numel() * t.element_size() for t in tensors)


def replay(template: torch.optim.Optimizer, shard: ShardState, groups: list[int],
           records: list[UpdateRecord]) -> ShardState:
    """Apply ``records`` to ``shard`` with a fresh optimizer of the template's kind: the very same update math.

    ``groups[pos]`` is the optimizer group of the shard's parameter at ``pos`` (positions are group-major).
    """
    live = LiveShard(template, shard, groups)
    for record in records:
        live.apply(record)
    return live.state()


DIGEST_BYTES = 32


def digest(params: Sequence[Tensor], optimizer: torch.optim.Optimizer) -> bytes:
    """SHA-256 of a shard's bytes (``params`` and their state in ``optimizer``, keys in order): an owner's shard and a
    replica of it have the same digest exactly when they are bit-identical."""
    h = hashlib.sha256()
    for p in params:
        h.update(_raw(p))
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            h.update(key.encode())
            h.update(_raw(value) if isinstance(value, Tensor) else repr(value).encode())
    return h.digest()


def _raw(t: Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
