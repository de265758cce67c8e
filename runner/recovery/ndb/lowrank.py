"""Low-rank FFN weight gradients for the taken-over micro-batch (MeCeFO approximation c).

Why: for ``y = x W^T + b`` (W is out x in, N tokens) the exact weight gradient ``G_y^T X`` costs
``2*N*out*in`` FLOPs and keeps X (N x in) alive until backward. With V the top-r right singular
vectors of the *weight* (in x r),

    G_W ~= (G_y^T (X V)) V^T

costs ``2*N*r*(in + out) + 2*r*out*in`` and keeps only ``X V`` (N x r). The input gradient
``G_y W`` and the bias gradient stay exact, so every other parameter's gradient is unchanged.
V comes from an SVD in fp32 (or wider), cached per layer and refreshed every ``svd_every`` steps.

Rank: ``r = ceil(rank_ratio * min(out, in))``; for the FFN this is ``ceil(rank_ratio * d_model)``
for both layers, the paper's ``ceil(0.2 d)``. (Taking the input width instead would give the
down-projection r = 0.8 d, whose "low-rank" Wgrad then costs as much as the exact one.)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.nn import functional as F

from runner.recovery.ndb.config import NDBConfig

RANK_GROWTH_STEPS = 1000
"""With ``dynamic_rank`` the rank is ``max(base, step // RANK_GROWTH_STEPS)`` (the seed's rule)."""


def lowrank_rank(out_features: int, in_features: int, cfg: NDBConfig, step: int) -> int:
    """Rank r of the projection for one layer at ``step``, never above ``min(out, in)``."""
    full = min(out_features, in_features)
    base = cfg.base_rank if cfg.base_rank is not None else math.ceil(cfg.rank_ratio * full)
    rank = max(base, step // RANK_GROWTH_STEPS) if cfg.dynamic_rank else base
    return min(rank, full)


class _Basis(NamedTuple):
    step: int
    v: torch.Tensor


class SVDCache:
    """Per-layer top-r right singular vectors of W; an SVD per layer every ``svd_every`` steps.

    Derived from the weights alone, so it needs no checkpointing: a restarted rank rebuilds it.
    """

    def __init__(self, svd_every: int) -> None:
        self.svd_every = svd_every
        self._bases: dict[str, _Basis] = {}

    def basis(self, name: str, weight: torch.Tensor, rank: int, step: int) -> torch.Tensor:
        """V (in x rank) for layer ``name``, recomputed when stale, missing or of another rank."""
        cached = self._bases.get(name)
        if cached is not None and cached.v.shape[1] == rank and 0 <= step - cached.step < self.svd_every:
            return cached.v  # fresh
        dtype = torch.promote_types(weight.dtype, torch.float32)  # no half-precision SVD
        _, _, vh = torch.linalg.svd(weight.detach().to(dtype), full_matrices=False)
        cached = _Basis(step, vh[:rank].T.to(weight.dtype).contiguous())
        self._bases[name] = cached
        return cached.v


class LowRankWgradLinear(torch.autograd.Function):
    """``F.linear`` whose backward gives an exact G_X and bias grad but a rank-r G_W."""

    @staticmethod
    def forward(ctx, x, weight, bias, v):  # noqa: D102 (autograd protocol)
        ctx.save_for_backward(x @ v, weight, v)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):  # noqa: D102
        xv, weight, v = ctx.saved_tensors
        grad_x = grad_y @ weight if ctx.needs_input_grad[0] else None
        gy = grad_y.reshape(-1, grad_y.shape[-1])
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (gy.T @ xv.reshape(-1, xv.shape[-1])) @ v.T
        grad_b = gy.sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def lowrank_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, v: torch.Tensor
) -> torch.Tensor:
    """Functional linear layer with a low-rank weight gradient; ``v`` is the (in x r) basis."""
    return LowRankWgradLinear.apply(x, weight, bias, v)
