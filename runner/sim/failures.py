"""Failure arrivals: a Poisson process whose rate grows linearly with the GPU count.

The per-GPU rate comes from a reference deployment (Llama 3: 419 unexpected
interruptions in 54 days on 16,384 GPUs); each arrival draws a cause from the
configured mix, and the cause decides the fault class the runner decides on.
"""
import bisect
import enum
import random
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import accumulate

from runner.sim.errors import ConfigError


class FaultClass(str, enum.Enum):
    transient = "transient"
    process_crash = "process_crash"
    hang = "hang"
    node_loss = "node_loss"
    silent_corruption = "silent_corruption"


@dataclass(frozen=True)
class Failure:
    cause: str
    fault: FaultClass
    node_draw: float  # uniform in [0, 1): which running node is hit


class FailureModel:
    """Per-GPU failure rate plus the cause mix, sampled with a caller's RNG."""

    def __init__(self, failures_conf):
        f = failures_conf
        gpu_seconds = f.reference_gpus * f.reference_days * 86400.0
        self.rate_per_gpu_s = f.rate_scale * f.reference_interruptions / gpu_seconds
        causes = [(name, c) for name, c in f.mix.items() if c.count > 0]
        if not causes:
            raise ConfigError("failures.mix needs at least one cause with count > 0")
        self._causes: tuple[tuple[str, FaultClass], ...] = tuple(
            (name, FaultClass(c.fault)) for name, c in causes
        )
        self._cumulative = list(accumulate(c.count for _, c in causes))

    def job_mtbf_s(self, gpus: int) -> float:
        return 1.0 / (self.rate_per_gpu_s * gpus)

    def class_shares(self) -> Mapping[FaultClass, float]:
        total = self._cumulative[-1]
        shares = {fc: 0.0 for fc in FaultClass}
        previous = 0.0
        for (_, fault), cum in zip(self._causes, self._cumulative):
            shares[fault] += (cum - previous) / total
            previous = cum
        return shares

    def next_gap_s(self, rng: random.Random, gpus: int) -> float:
        """Running seconds until the next failure (exponential, mean = job MTBF)."""
        return rng.expovariate(self.rate_per_gpu_s * gpus)

    def draw(self, rng: random.Random) -> Failure:
        """Always consumes exactly two draws so every mix sees the same failures."""
        pick = rng.random() * self._cumulative[-1]
        cause, fault = self._causes[bisect.bisect_right(self._cumulative, pick)]
        return Failure(cause=cause, fault=fault, node_draw=rng.random())
