"""sha256 over all parameters in a canonical order: equal checksums mean bit-identical models."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch


def param_checksum(module: torch.nn.Module) -> str:
    return state_checksum(module.state_dict())


def state_checksum(state: Mapping[str, Any]) -> str:
    """The checksum of a state dict (a module's, or a tensor-parallel model's gathered in full)."""
    h = hashlib.sha256()
    for name, p in sorted(state.items()):
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            continue
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
