"""Megatron-style tensor parallelism for ``runner.model.GPT`` over a passed process group.

Each block's attention and FFN become a column-parallel linear followed by a row-parallel one:
the attention heads (and the FFN's hidden units) are split over the TP ranks, so a rank computes
only its heads with no communication inside the branch. ``copy_to_tp`` marks the branch's input
(identity forward, all-reduce of the input gradient backward) and ``reduce_from_tp`` its output
(all-reduce forward, identity backward): one all-reduce per branch in each direction. Embeddings,
layer norms, the row-parallel biases, the head and the loss stay replicated; their gradients come
out identical on every TP rank because the input gradient of each branch is all-reduced.

``shard_gpt_for_tp`` turns a full GPT into a rank's shard by slicing the full weights, so a TP run
starts from exactly the parameters of the unsharded model; ``gather_full`` reassembles the full
parameters (or gradients) from the shards; ``grad_squares`` and ``clip_grads_`` clip by the full
model's gradient norm, the same on every TP rank, so the replicated parameters stay equal. The layers are written
over ``torch.distributed`` rather than DTensor because the runner's per-generation groups cannot
back a ``DeviceMesh`` (docs/parallelism.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F

from runner.model import GPT, CausalSelfAttention, FeedForward


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` in place (a ``ProcessGroup`` or a backend such as ``ProcessGroupGloo``)."""
    group.allreduce([tensor]).wait()
    return tensor


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward (see ``copy_to_tp``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward (see ``reduce_from_tp``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        return _all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a tensor-parallel region: ``x`` as is; backward, the TP ranks' input gradients summed."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a tensor-parallel region: the TP ranks' partial outputs summed; backward, the gradient as is."""
    return _ReduceFromTP.apply(x, group)


@dataclass(frozen=True)
class ShardLayout:
    """How a full tensor is cut among ``size`` TP ranks: along ``dim``, in ``parts`` equal blocks (3 for a
    fused q/k/v projection) each cut into ``size`` pieces; rank r holds piece r of every block."""

    dim: int
    parts: int = 1

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        blocks = full.chunk(self.parts, self.dim)
        return torch.cat([b.chunk(size, self.dim)[rank] for b in blocks], self.dim).clone()

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        pieces = [s.chunk(self.parts, self.dim) for s in shards]
        return torch.cat([torch.cat([p[b] for p in pieces], self.dim) for b in range(self.parts)], self.dim)


class ColumnParallelLinear(nn.Module):
    """This rank's rows of a full ``nn.Linear`` (its output features); the input enters the TP region."""

    def __init__(self, full: nn.Linear, group, parts: int = 1) -> None:
        super().__init__()
        self.group = group
        rank, size = group.rank(), group.size()
        self.layouts = {"weight": ShardLayout(0, parts), "bias": ShardLayout(0, parts)}
        self.bias: Optional[nn.Parameter]
        self.weight = nn.Parameter(self.layouts["weight"].shard(full.weight.detach(), rank, size))
        self.bias = None
        if full.bias is not None:
            self.bias = nn.Parameter(self.layouts["bias"].shard(full.bias.detach(), rank, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's columns of a full ``nn.Linear`` (its input features); the partial outputs are summed
    over the TP ranks, then the replicated bias is added once."""

    def __init__(self, full: nn.Linear, group) -> None:
        super().__init__()
        self.group = group
        self.layouts = {"weight": ShardLayout(1)}
        self.weight = nn.Parameter(self.layouts["weight"].shard(full.weight.detach(), group.rank(), group.size()))
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class TensorParallelAttention(nn.Module):
    """``CausalSelfAttention`` with this rank's ``n_head / tp`` heads: q, k and v column-parallel, the output
    projection row-parallel."""

    def __init__(self, full: CausalSelfAttention, group) -> None:
        super().__init__()
        self.n_head = full.n_head // group.size()
        self.qkv = ColumnParallelLinear(full.qkv, group, parts=3)
        self.proj = RowParallelLinear(full.proj, group)
        self.dropout = full.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)
        width = q.shape[2]
        q, k, v = (z.view(b, t, self.n_head, width // self.n_head).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, width))


class TensorParallelFeedForward(nn.Module):
    """``FeedForward`` with this rank's ``1 / tp`` of the hidden units: ``fc`` column-, ``out`` row-parallel."""

    def __init__(self, full: FeedForward, group) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(full.fc, group)
        self.out = RowParallelLinear(full.out, group)
        self.drop = full.drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out(F.gelu(self.fc(x))))


def shard_gpt_for_tp(model: GPT, group) -> GPT:
    """Replace every block's attention and FFN of ``model`` (a full GPT) by this rank's tensor-parallel
    shard, sliced from the full weights, in place; returns ``model``. Parameter names do not change."""
    cfg, size = model.cfg, group.size()
    hidden = cfg.ffn_mult * cfg.d_model
    if cfg.n_head % size or hidden % size:
        raise ValueError(f"tensor parallelism over {size} ranks needs model.n_head ({cfg.n_head}) and the FFN width "
                         f"({hidden}) to be multiples of {size}: choose parallel.tp among the divisors of "
                         f"{cfg.n_head}.")
    if cfg.dropout:
        raise ValueError(f"model.dropout={cfg.dropout}: the tensor-parallel layers do not keep a separate dropout "
                         "stream per TP rank yet, so their dropout would differ from the unsharded model's; set "
                         "model.dropout=0 with parallel.tp > 1.")
    for block in model.blocks:
        attn, ffn = block.attn, block.ffn
        if not isinstance(attn, CausalSelfAttention) or not isinstance(ffn, FeedForward):
            raise ValueError("shard_gpt_for_tp needs a full GPT: this model's blocks are sharded already.")
        block.attn = TensorParallelAttention(attn, group)
        block.ffn = TensorParallelFeedForward(ffn, group)
    return model


def shard_layouts(module: nn.Module) -> dict[str, tuple[ShardLayout, Any]]:
    """Every TP-sharded parameter of ``module`` by name (as ``named_parameters`` gives it): how it is cut, and
    the TP group it is cut over (that group's ``rank()`` is this process's slice)."""
    return {f"{prefix}.{name}" if prefix else name: (layout, sub.group) for prefix, sub in module.named_modules()
            if isinstance(sub, (ColumnParallelLinear, RowParallelLinear)) for name, layout in sub.layouts.items()}


def gather_shards(tensor: torch.Tensor, layout: ShardLayout, group) -> torch.Tensor:
    """The full tensor whose slice over ``group`` is ``tensor`` (one all-gather: every rank of the group
    calls it with its own slice of the same tensor)."""
    shards = [torch.empty_like(tensor) for _ in range(group.size())]
    group.allgather([shards], [tensor.contiguous()]).wait()
    return layout.unshard(shards)


def gather_full(model: nn.Module, group, *, grads: bool = False) -> dict[str, Optional[torch.Tensor]]:
    """The full parameters (or, with ``grads``, their gradients) of a TP-sharded ``model`` by name, as the
    unsharded model has them: sharded ones gathered over ``group``, replicated ones as they are. Every
    rank of the group must call it (it runs one all-gather per sharded parameter)."""
    layouts = shard_layouts(model)
    full: dict[str, Optional[torch.Tensor]] = {}
    for name, param in model.named_parameters():
        tensor = param.grad if grads else param.detach()
        if name not in layouts or tensor is None:
            full[name] = None if tensor is None else tensor.clone()
            continue
        full[name] = gather_shards(tensor, layouts[name][0], group)
    return full


def grad_squares(model: nn.Module, skip: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The summed squares of ``model``'s gradients, [TP-sharded parameters, replicated parameters], in fp32:
    the full model's squared gradient norm is the first summed over the TP group, plus the second once.
    ``skip``: a parameter left out (a pipeline's last stage's copy of the tied embedding)."""
    sharded = {id(getattr(m, name)) for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
               for name in m.layouts}
    squares = torch.zeros(2, dtype=torch.float32)
    for p in model.parameters():
        if p.grad is not None and p is not skip:
            squares[0 if id(p) in sharded else 1] += p.grad.detach().float().pow(2).sum().cpu()
    return squares


def clip_grads_(params, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale the gradients of ``params`` as ``torch.nn.utils.clip_grad_norm_`` would for a gradient norm of
    ``total_norm`` (the full model's, the same on every TP rank, so the replicated parameters stay equal)."""
    factor = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.detach().mul_(factor.to(device=p.grad.device, dtype=p.grad.dtype))
