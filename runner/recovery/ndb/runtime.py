"""NDB inside a training step: the neighbour's extra micro-batches and how their gradients average.

The strategy asks ``backward`` for each logical rank this process has taken over (the batch comes
from the same step-indexed source at that rank's data rank, its DP coordinate, so it is exactly the batch
the failed rank would have used, and with tp*pp > 1 every rank of the neighbour replica reads the same one),
then divides every summed gradient by ``divisor``: attention-branch parameters only count the
micro-batches that computed them when the skip-connection is on. With pipeline parallelism the model is this
rank's stage and the taken-over batch runs through the stage's 1F1B schedule (``_pipeline_backward``).
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from typing import Optional

import torch

from runner.data import BatchSource, derive_seed, seed_step
from runner.model import GPT
from runner.parallel.pipeline import GPTStage, OneFOneB
from runner.recovery.ndb.config import NDBConfig
from runner.recovery.ndb.params import attention_param_names
from runner.recovery.ndb.takeover import TakeoverForward


class NDBRuntime:
    def __init__(self, gpt: GPT | GPTStage, cfg: NDBConfig, seed: int, data_rank: Callable[[int], int],
                 pipeline: Optional[Callable[[], OneFOneB]] = None) -> None:
        """``data_rank``: the rank whose data and seeds a logical rank uses (its DP coordinate). ``pipeline``
        (pp > 1, ``gpt`` is this rank's stage): builds the stage's 1F1B schedule, once the groups exist."""
        self.cfg, self.seed, self.data_rank = cfg, seed, data_rank
        self._pipeline_factory = pipeline
        self._pipeline: Optional[OneFOneB] = None
        self.forward = TakeoverForward(gpt, cfg)
        names = attention_param_names(gpt)
        self.attention = {id(p) for n, p in gpt.named_parameters() if n in names}
        self.step_times: dict[bool, list[float]] = {False: [], True: []}
        self.rss_before_kib: int | None = None
        self.ranks_taken_over: set[int] = set()

    def backward(self, source: BatchSource, step: int, logical_rank: int,
                 device: torch.device) -> tuple[float, list[int]]:
        """Accumulate the taken-over micro-batch's (approximate) gradients; returns its loss and sample id."""
        if self.rss_before_kib is None:
            self.rss_before_kib = _max_rss_kib()
        self.ranks_taken_over.add(logical_rank)
        data_rank = self.data_rank(logical_rank)
        batch = source.batch(step, data_rank)
        seed_step(derive_seed(self.seed, step, data_rank, 1), device)
        idx, targets = batch["idx"].to(device), batch["targets"].to(device)
        if self._pipeline_factory is not None:
            return self._pipeline_backward(idx, targets, step), batch["sample"].tolist()
        loss = self.forward(idx, targets, step)
        loss.backward()
        return float(loss.detach()), batch["sample"].tolist()

    def _pipeline_backward(self, idx: torch.Tensor, targets: torch.Tensor, step: int) -> float:
        """pp > 1: the taken-over batch through the stage's 1F1B schedule, a second pass of the step with the
        cheapened stage forward; its loss (the last stage's) summed over the pipeline, so every stage has it.

        The pass accumulates its gradients apart (its micro-batches' sum, the tied embedding's exchange between
        first and last stage) and adds them to the own pass's once complete: own + taken-over, as the DP sum of
        two replicas adds them (with every approximation off, bit-identical to the fault-free run at dp = 2)."""
        if self._pipeline is None:
            assert self._pipeline_factory is not None
            self._pipeline = self._pipeline_factory()
        params = [p for p in self._pipeline.stage.parameters() if p.requires_grad]
        own = [p.grad for p in params]
        for p in params:
            p.grad = None
        loss = self._pipeline.step(idx, targets, stage_forward=lambda x: self.forward.stage(x, step))
        for p, mine in zip(params, own):
            if mine is not None:
                p.grad = mine if p.grad is None else mine + p.grad
        total = torch.zeros(1, device=idx.device) if loss is None else loss.detach().reshape(1).float()
        self._pipeline.group.allreduce([total])
        return float(total[0])

    def divisor(self, param: torch.Tensor, dp: int, takeovers: int) -> int:
        if takeovers and self.cfg.attention_skipped and id(param) in self.attention:
            return dp - takeovers
        return dp

    def record_step(self, seconds: float, taking_over: bool) -> None:
        self.step_times[taking_over].append(seconds)

    def stats(self) -> dict:
        """The neighbour's step time and peak memory before and after it took over."""
        def mean(xs: list[float]) -> float | None:
            return sum(xs[1:]) / (len(xs) - 1) if len(xs) > 1 else None  # first step: warm-up or recovery

        return {"extra_ranks": sorted(self.ranks_taken_over), "step_time_before_s": mean(self.step_times[False]),
                "step_time_after_s": mean(self.step_times[True]),
                "peak_rss_before_kib": self.rss_before_kib, "peak_rss_after_kib": _max_rss_kib(),
                "steps_taken_over": len(self.step_times[True])}


def _max_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
