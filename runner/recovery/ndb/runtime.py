"""NDB inside a training step: the neighbour's extra micro-batches and how their gradients average.

The strategy asks ``backward`` for each logical rank this process has taken over (the batch comes
from the same step-indexed source at that rank's data rank, its DP coordinate, so it is exactly the batch
the failed rank would have used, and with tp*pp > 1 every rank of the neighbour replica reads the same one),
then divides every summed gradient by ``divisor``: attention-branch parameters only count the
micro-batches that computed them when the skip-connection is on.
"""

from __future__ import annotations

import resource
from collections.abc import Callable

import torch

from runner.data import BatchSource, derive_seed, seed_step
from runner.model import GPT
from runner.recovery.ndb.config import NDBConfig
from runner.recovery.ndb.params import attention_param_names
from runner.recovery.ndb.takeover import TakeoverForward


class NDBRuntime:
    def __init__(self, gpt: GPT, cfg: NDBConfig, seed: int, data_rank: Callable[[int], int]) -> None:
        """``data_rank``: the rank whose data and seeds a logical rank uses (its DP coordinate)."""
        self.cfg, self.seed, self.data_rank = cfg, seed, data_rank
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
        loss = self.forward(batch["idx"].to(device), batch["targets"].to(device), step)
        loss.backward()
        return float(loss.detach()), batch["sample"].tolist()

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
