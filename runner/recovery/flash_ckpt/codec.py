"""Split a nested checkpoint dict into tensors and a JSON skeleton, and join them back.

The segment stores tensors as raw bytes and everything else as JSON, so nothing is pickled and a
reader needs no Python class to be importable. The skeleton keeps what a Lightning checkpoint
relies on: non-string dict keys (optimizer state is keyed by int), tuples (Adam betas),
OrderedDict with its ``_metadata`` (module versions used by ``load_state_dict``), and tied
tensors, which come back as one tensor as they do from torch.load.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

_PRIMITIVES = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class Flat:
    """A state split into a JSON-able skeleton and its tensors, in walk order."""

    skeleton: Any
    tensors: list[torch.Tensor]
    paths: list[str]


@lru_cache(maxsize=1 << 16)  # positions repeat at every snapshot of a run
def tensor_path(keys: tuple) -> str:
    """Stable text id of a position in the nested state (used in the layout and in reports)."""
    return json.dumps(list(keys))


def flatten(state: Any) -> Flat:
    """Walk `state`; tensors are referenced, not copied, and non-tensor values are deep-copied."""
    tensors: list[torch.Tensor] = []
    paths: list[str] = []
    seen: dict[tuple, int] = {}  # a tensor reachable twice (tied weights) is stored once

    def enc(obj: Any, keys: tuple) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.layout is not torch.strided or obj.is_meta or obj.is_quantized:
                raise TypeError(f"flash checkpoint stores dense tensors only; {tensor_path(keys)} is not one")
            alias = (obj.data_ptr(), obj.dtype, obj.shape, obj.stride(), obj.device) if obj.numel() else None
            if alias in seen:
                return {"T": seen[alias]}
            tensors.append(obj.detach())
            paths.append(tensor_path(keys))
            if alias is not None:
                seen[alias] = len(tensors) - 1
            return {"T": len(tensors) - 1}
        if type(obj) in _PRIMITIVES:
            return obj
        if type(obj) is dict:
            if all(type(k) is str and type(v) in _PRIMITIVES for k, v in obj.items()):  # most of the dict
                return {"D": [[k, v] for k, v in obj.items()]}
            return {"D": [[enc_key(k, keys), enc(v, keys + (k,))] for k, v in obj.items()]}
        if type(obj) is OrderedDict:
            node = {"O": [[enc_key(k, keys), enc(v, keys + (k,))] for k, v in obj.items()]}
            meta = getattr(obj, "_metadata", None)
            if meta is not None:
                node["m"] = enc(meta, keys + ("_metadata",))
            return node
        if type(obj) is list:
            if all(type(v) in _PRIMITIVES for v in obj):  # e.g. an optimizer group's parameter ids
                return {"L": list(obj)}
            return {"L": [enc(v, keys + (i,)) for i, v in enumerate(obj)]}
        if type(obj) is tuple:
            return {"U": [enc(v, keys + (i,)) for i, v in enumerate(obj)]}
        raise TypeError(
            f"flash checkpoint cannot store {type(obj).__qualname__} at {tensor_path(keys)}: only tensors, "
            "dict/OrderedDict/list/tuple and str/int/float/bool/None are kept (nothing is pickled); "
            "convert the value or leave its key out of the snapshot"
        )

    def enc_key(key: Any, keys: tuple) -> Any:
        if isinstance(key, torch.Tensor):
            raise TypeError(f"tensor used as a dict key at {tensor_path(keys)}")
        return enc(key, keys)

    return Flat(enc(state, ()), tensors, paths)


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuild the nested state from `flatten`'s skeleton and a tensor list in the same order."""

    def dec(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if "T" in node:
            return tensors[node["T"]]
        if "D" in node:
            return {dec(k): dec(v) for k, v in node["D"]}
        if "O" in node:
            out = OrderedDict((dec(k), dec(v)) for k, v in node["O"])
            if "m" in node:
                out._metadata = dec(node["m"])  # type: ignore[attr-defined]
            return out
        if "L" in node:
            return [dec(v) for v in node["L"]]
        if "U" in node:
            return tuple(dec(v) for v in node["U"])
        raise ValueError(f"unknown skeleton node {sorted(node)}")

    return dec(skeleton)


def tensors_at(skeleton: Any, state: Any) -> dict[int, torch.Tensor]:
    """The tensors of `state` that sit where `skeleton` (from ``flatten``) has tensor i, by i: the
    targets of an in-place restore. Walks only the skeleton's shape, which is much cheaper than
    flattening `state` (no path strings, no alias keys); positions that differ are left out."""
    found: dict[int, torch.Tensor] = {}

    def walk(node: Any, obj: Any) -> None:
        if not isinstance(node, dict):
            return
        if "T" in node:
            if isinstance(obj, torch.Tensor):
                found.setdefault(node["T"], obj)
            return
        items = node.get("D", node.get("O"))
        if items is not None:
            if isinstance(obj, dict):
                for key, value in items:
                    key = unflatten(key, []) if isinstance(key, dict) else key
                    if key in obj:
                        walk(value, obj[key])
            return
        seq = node.get("L", node.get("U"))
        if seq is not None and isinstance(obj, (list, tuple)):
            for value, item in zip(seq, obj):
                walk(value, item)

    walk(skeleton, state)
    return found


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in snapshot layout")
    return dtype
