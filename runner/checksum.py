"""sha256 over all parameters in a canonical order: equal checksums mean bit-identical models."""

from __future__ import annotations

import hashlib

import torch


def param_checksum(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            continue
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
