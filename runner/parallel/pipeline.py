"""Pipeline parallelism for ``runner.model.GPT``: stages of whole blocks and a 1F1B schedule over
micro-batches, point to point over a passed process group.

``GPTStage`` is one stage's slice of a full GPT: the embeddings on the first stage, its share of the
blocks, the final norm and the head on the last. The head's weight is tied to the token embedding;
with first and last stage on different ranks each keeps a copy, and after the backward pass the two
copies' gradients are exchanged and summed, so both hold the unsharded model's gradient and stay
equal under the same optimizer step (Megatron's embedding group does the same).

``OneFOneB`` runs one training step's forward and backward passes: stage s first runs
``pp - s - 1`` forwards (warm-up), then alternates one forward and one backward, then drains the
backwards, so a stage keeps at most ``pp - s`` micro-batches' activations. Sends are posted without
waiting and waited for at the end of the step; only receives block, so the schedule's own data
dependencies order the stages and no rank waits on a send. The passed group is one pipeline's ranks
in stage order (``Topology.pp_group``); the group rank is the stage. ``OneFOneB.forward_only`` runs
validation batches through the same stages and group, forward only. torch.distributed.pipelining is
not used because it needs the default process group, which the runner's per-generation groups do
not have (docs/parallelism.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from runner.model import GPT, token_loss


class GPTStage(nn.Module):
    """Stage ``stage`` of ``stages`` of a full GPT, holding the full model's modules (not copies), except
    the head's weight on a last stage that is not also the first: a copy of the token embedding."""

    def __init__(self, model: GPT, stage: int, stages: int) -> None:
        super().__init__()
        cfg = model.cfg
        if stages < 1 or not 0 <= stage < stages or cfg.n_layer % stages:
            raise ValueError(f"stage {stage} of {stages}: a pipeline needs parallel.pp to divide model.n_layer "
                             f"({cfg.n_layer}) and a stage index below it.")
        per = cfg.n_layer // stages
        self.cfg, self.index, self.stages, self.first_block = cfg, stage, stages, stage * per
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        if self.is_first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleList(model.blocks[self.first_block:self.first_block + per])
        if self.is_last:
            self.ln_f = model.ln_f
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            tied = model.tok_emb.weight
            self.head.weight = tied if self.is_first else nn.Parameter(tied.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids on the first stage, else the previous stage's activations; logits on the last stage."""
        if self.is_first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.is_last else x

    def tied_weight(self) -> Optional[torch.Tensor]:
        """This stage's copy of the token embedding (first stage) or of the head (last stage)."""
        if self.is_first:
            return self.tok_emb.weight
        return self.head.weight if self.is_last else None

    def full_name(self, name: str) -> str:
        """The unsharded GPT's name of this stage's parameter ``name`` (a stage's blocks count from 0)."""
        if name == "head.weight":
            return "tok_emb.weight"
        if name.startswith("blocks."):
            _, index, rest = name.split(".", 2)
            return f"blocks.{self.first_block + int(index)}.{rest}"
        return name


class _Links:
    """One pass's point-to-point traffic with the neighbouring stages: a send is posted without waiting and its
    tensor kept alive until ``wait_sends``; a receive blocks, in the stage's dtype and device (those of ``like``)."""

    def __init__(self, group, like: torch.Tensor) -> None:
        self.group, self.like = group, like
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []  # the tensor stays alive until its send completes

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        tensor = tensor.contiguous()
        self.sends.append((self.group.send([tensor], peer, tag), tensor))

    def recv(self, shape: tuple[int, ...], peer: int, tag: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=self.like.dtype, device=self.like.device)
        self.group.recv([buf], peer, tag).wait()
        return buf

    def wait_sends(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends = []


class OneFOneB:
    """One training step of a pipeline stage: forward and backward of ``micro_batches`` micro-batches in
    1F1B order over ``group`` (this pipeline's ranks, in stage order), then the tied-embedding gradient
    exchange between the first and the last stage; and forward-only passes of validation batches."""

    def __init__(self, stage: GPTStage, group, micro_batches: int) -> None:
        if micro_batches < 1:
            raise ValueError(f"trainer.micro_batches={micro_batches}: a pipeline step needs at least one.")
        if (group.rank(), group.size()) != (stage.index, stage.stages):
            raise ValueError(f"stage {stage.index} of {stage.stages} runs on rank {group.rank()} of a group of "
                             f"{group.size()}: the group must be the pipeline's ranks in stage order.")
        self.stage, self.group, self.micro_batches = stage, group, micro_batches
        self.index, self.stages = stage.index, stage.stages

    def step(self, idx: torch.Tensor, targets: torch.Tensor,
             stage_forward: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Optional[torch.Tensor]:
        """Accumulate the gradients of the mean loss over the batch (``idx``, ``targets``), split into equal
        micro-batches; returns that loss on the last stage and None elsewhere. Every stage passes the
        same batch (the inner stages use only its shape). ``stage_forward``: the stage's forward to run in place of
        the stage's own (NDB's cheapened one for a taken-over replica's batch, in a second pass of the step)."""
        m, stage = self.micro_batches, self.stage
        run = stage if stage_forward is None else stage_forward
        if idx.shape[0] % m:
            raise ValueError(f"a batch of {idx.shape[0]} samples does not split into {m} equal micro-batches.")
        ids, tgts = idx.chunk(m), targets.chunk(m)
        shape = self._activation_shape(ids[0])
        links = _Links(self.group, next(stage.parameters()))
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        losses: list[torch.Tensor] = []

        def forward(i: int) -> None:
            x = ids[i] if stage.is_first else links.recv(shape, self.index - 1, 2 * i).requires_grad_()
            y = run(x)
            if stage.is_last:
                y = token_loss(y, tgts[i]) / m
                losses.append(y.detach())
            else:
                links.send(y.detach(), self.index + 1, 2 * i)
            inputs[i], outputs[i] = x, y

        def backward(i: int) -> None:
            x, y = inputs.pop(i), outputs.pop(i)
            y.backward(None if stage.is_last else links.recv(shape, self.index + 1, 2 * i + 1))
            if not stage.is_first:
                assert x.grad is not None  # a received activation requires its gradient
                links.send(x.grad, self.index - 1, 2 * i + 1)

        warmup = min(self.stages - self.index - 1, m)
        for i in range(warmup):
            forward(i)
        for i in range(m - warmup):
            forward(warmup + i)
            backward(i)
        for i in range(m - warmup, m):
            backward(i)
        links.wait_sends()
        self._sum_tied_gradients(tag=2 * m)
        return torch.stack(losses).sum() if stage.is_last else None

    def forward_only(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Each batch's mean loss on the last stage (a zero on the other stages, so that a sum over the pipeline
        is the last stage's), forward only and without gradients. Every stage passes the same (``idx``, ``targets``)
        batches (the inner stages use only their shapes). A batch goes through the stages whole, as one micro-batch,
        so its loss is computed as the unsharded model computes it, with the same operations on the same shapes.
        The stages run ahead of each other as far as the receives let them; a stage waits for its sends once
        ``pp`` are in flight, so it keeps at most that many batches' activations."""
        stage = self.stage
        links = _Links(self.group, next(stage.parameters()))
        losses: list[torch.Tensor] = []
        with torch.no_grad():
            for i, (idx, targets) in enumerate(batches):
                x = idx if stage.is_first else links.recv(self._activation_shape(idx), self.index - 1, i)
                y = stage(x)
                if stage.is_last:
                    losses.append(token_loss(y, targets))
                    continue
                links.send(y, self.index + 1, i)
                losses.append(torch.zeros((), device=y.device))
                if len(links.sends) >= self.stages:
                    links.wait_sends()
        links.wait_sends()
        return losses

    def _activation_shape(self, idx: torch.Tensor) -> tuple[int, int, int]:
        """The activations a stage sends for a batch of token ids ``idx``."""
        return idx.shape[0], idx.shape[1], self.stage.cfg.d_model

    def _sum_tied_gradients(self, tag: int) -> None:
        """First and last stage swap their tied copy's gradient and add the other's: both then hold the sum,
        which is the unsharded embedding's gradient (a + b and b + a round alike)."""
        weight = self.stage.tied_weight()
        if self.stages == 1 or weight is None or weight.grad is None:
            return
        peer = self.stages - 1 if self.stage.is_first else 0
        mine, theirs = weight.grad.contiguous().clone(), torch.empty_like(weight.grad)
        sent = self.group.send([mine], peer, tag)
        self.group.recv([theirs], peer, tag).wait()
        sent.wait()
        weight.grad += theirs
