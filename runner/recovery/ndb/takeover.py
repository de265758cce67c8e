"""Forward of the taken-over micro-batch with NDB's approximations, on the model's own modules.

Why a separate forward: the approximations apply only to the extra micro-batch, while the
neighbour's own micro-batch keeps the plain ``model.loss`` path. This mirrors ``GPT.forward`` and
``FeedForward.forward`` op for op (so that with every approximation off the gradients are bitwise
those of ``model.loss``; a test guards this) and changes only:

* skip_attention: each block's attention branch (ln1 + attn) runs under ``no_grad``; its output
  joins the residual as a constant, so nothing is saved for it and the residual alone carries the
  gradient.
* recompute_ffn: each block's FFN branch (ln2 + ffn) is checkpointed (non-reentrant, RNG preserved):
  only its input is saved and the branch is recomputed in backward, with identical gradients. With
  low-rank Wgrads the down-projection needs only ``gelu(h) V`` (N x r), so it stays outside the
  checkpoint and only ln2 -> fc -> gelu is recomputed.
* lowrank_ffn: after warm-up, the FFN linears use ``lowrank_linear`` (rank-r weight gradients). With tensor
  parallelism each rank projects the weight gradient of its own slice on that slice's top-r right singular
  vectors (r from the slice's shape), inside the layer's usual all-reduces.

The tensor-parallel blocks (``runner.parallel.tensor``) take the same path: their attention and FFN run
their own collectives, which every TP rank of the neighbour replica reaches in the same order. With
pipeline parallelism ``extra_microbatch_stage`` does the same for one ``GPTStage``, and the pipeline's 1F1B
schedule runs it over the taken-over batch's micro-batches in place of the stage's own forward.

The forward value is exact in every mode; only the backward is approximated.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from runner.model import GPT, Block, token_loss
from runner.parallel.pipeline import GPTStage
from runner.parallel.tensor import ColumnParallelLinear, RowParallelLinear, copy_to_tp, reduce_from_tp
from runner.recovery.ndb.config import NDBConfig
from runner.recovery.ndb.lowrank import SVDCache, lowrank_linear, lowrank_rank

FFNBases = tuple[torch.Tensor, torch.Tensor]


def extra_microbatch_loss(
    model: GPT,
    idx: torch.Tensor,
    targets: torch.Tensor,
    cfg: NDBConfig,
    step: int,
    svd_cache: SVDCache,
) -> torch.Tensor:
    """Mean cross-entropy of the taken-over micro-batch; ``.backward()`` accumulates its
    (approximate) gradients into the model's ``.grad`` like ``model.loss`` would.

    ``model`` is the bare GPT (not a DDP wrapper); ``step`` is the global optimizer step, which
    gates the low-rank warm-up and the SVD refreshes of ``svd_cache``.
    """
    if cfg.exact_reference:
        return model.loss(idx, targets)
    pos = torch.arange(idx.shape[1], device=idx.device)
    x = model.drop(model.tok_emb(idx) + model.pos_emb(pos))
    x = _through_blocks(_blocks(model), x, cfg, step, svd_cache)
    logits = model.head(model.ln_f(x))
    return token_loss(logits, targets)


def extra_microbatch_stage(stage: GPTStage, x: torch.Tensor, cfg: NDBConfig, step: int,
                           svd_cache: SVDCache) -> torch.Tensor:
    """``stage(x)`` for the taken-over batch with the approximations (pp > 1: the pipeline schedule runs it in
    place of the stage's own forward), mirroring ``GPTStage.forward`` as ``extra_microbatch_loss`` mirrors
    ``GPT.forward``."""
    if cfg.exact_reference:
        return stage(x)
    if stage.is_first:
        pos = torch.arange(x.shape[1], device=x.device)
        x = stage.drop(stage.tok_emb(x) + stage.pos_emb(pos))
    x = _through_blocks(_blocks(stage), x, cfg, step, svd_cache)
    return stage.head(stage.ln_f(x)) if stage.is_last else x


class TakeoverForward:
    """The neighbour's handle on a taken-over rank: model (or pipeline stage), knobs and the SVD cache across
    steps."""

    def __init__(self, model: GPT | GPTStage, cfg: NDBConfig) -> None:
        self.model = model
        self.cfg = cfg
        self.svd_cache = SVDCache(cfg.svd_every)

    def __call__(self, idx: torch.Tensor, targets: torch.Tensor, step: int) -> torch.Tensor:
        assert isinstance(self.model, GPT)  # a stage has no loss of its own: ``stage``
        return extra_microbatch_loss(self.model, idx, targets, self.cfg, step, self.svd_cache)

    def stage(self, x: torch.Tensor, step: int) -> torch.Tensor:
        assert isinstance(self.model, GPTStage)
        return extra_microbatch_stage(self.model, x, self.cfg, step, self.svd_cache)


def _through_blocks(blocks: list[Block], x: torch.Tensor, cfg: NDBConfig, step: int,
                    svd_cache: SVDCache) -> torch.Tensor:
    for block, block_bases in zip(blocks, _ffn_bases(blocks, cfg, step, svd_cache)):
        x = x + _attention_branch(block, x, cfg.skip_attention)
        x = x + _ffn_branch(block, x, cfg.recompute_ffn, block_bases)
    return x


def _ffn_bases(
    blocks: list[Block], cfg: NDBConfig, step: int, svd_cache: SVDCache
) -> list[FFNBases | None]:
    """Per block, the (fc, out) projection bases, or None where the exact Wgrad is used.

    Fetched before any checkpointed region so that the recomputation reuses the same V.
    """
    if not cfg.lowrank_active(step):
        return [None] * len(blocks)

    def basis(name: str, layer: torch.nn.Module) -> torch.Tensor:
        assert isinstance(layer.weight, torch.Tensor)
        out_features, in_features = layer.weight.shape
        rank = lowrank_rank(out_features, in_features, cfg, step)
        return svd_cache.basis(name, layer.weight, rank, step)

    bases: list[FFNBases | None] = []
    for i, block in enumerate(blocks):
        ffn = block.ffn
        bases.append((basis(f"blocks.{i}.ffn.fc", ffn.fc), basis(f"blocks.{i}.ffn.out", ffn.out)))
    return bases


def _blocks(model: GPT | GPTStage) -> list[Block]:
    """The model's blocks, typed as such (a ModuleList's items are typed as plain Modules)."""
    blocks = []
    for block in model.blocks:
        assert isinstance(block, Block)
        blocks.append(block)
    return blocks


def _attention_branch(block: Block, x: torch.Tensor, skip: bool) -> torch.Tensor:
    if not skip:
        return block.attn(block.ln1(x))
    with torch.no_grad():
        return block.attn(block.ln1(x))


def _ffn_branch(
    block: Block, x: torch.Tensor, recompute: bool, bases: FFNBases | None
) -> torch.Tensor:
    ffn = block.ffn
    if bases is None:
        return _maybe_checkpoint(lambda inp: ffn(block.ln2(inp)), x, recompute)
    # Low-rank: the down-projection keeps only gelu(h) V for its backward, so only
    # ln2 -> fc -> gelu (whose input gelu's backward needs) has to be recomputed.
    hidden = _maybe_checkpoint(lambda inp: F.gelu(_lowrank_layer(ffn.fc, block.ln2(inp), bases[0])), x, recompute)
    return ffn.drop(_lowrank_layer(ffn.out, hidden, bases[1]))


def _lowrank_layer(layer: torch.nn.Module, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` with a rank-r weight gradient: a tensor-parallel layer's own collectives around it, op for op
    as its forward (its weight is this rank's slice, and ``v`` that slice's basis)."""
    if isinstance(layer, ColumnParallelLinear):
        return lowrank_linear(copy_to_tp(x, layer.group), layer.weight, layer.bias, v)
    if isinstance(layer, RowParallelLinear):
        y = reduce_from_tp(lowrank_linear(x, layer.weight, None, v), layer.group)
        return y if layer.bias is None else y + layer.bias
    assert isinstance(layer, torch.nn.Linear)
    return lowrank_linear(x, layer.weight, layer.bias, v)


def _maybe_checkpoint(fn, x: torch.Tensor, recompute: bool) -> torch.Tensor:
    """Keep only ``x`` and rerun ``fn`` in backward, same RNG state, hence the same gradients."""
    if recompute:
        return checkpoint(fn, x, use_reentrant=False, preserve_rng_state=True)
    return fn(x)
