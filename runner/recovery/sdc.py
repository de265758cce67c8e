"""Silent data corruption guard: a cheap fingerprint of every committed reduction.

After the all-reduce every rank holds the same summed gradient, so every rank reaches the same
verdict without another collective: a non-finite value, or a norm more than ``factor`` times the
median of the last ``window`` accepted norms, means one rank's contribution was corrupted (a bit
flip in memory or in a kernel). The step is then dropped and recomputed from the same batch and
the same per-step seed, so a transient corruption leaves no trace in the model.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch

MIN_HISTORY = 5  # accepted steps before the median means anything: a younger guard only rejects non-finite norms


class GradientGuard:
    def __init__(self, factor: float, window: int, min_history: int = MIN_HISTORY) -> None:
        self.factor, self.min_history = factor, min_history
        self.norms: deque[float] = deque(maxlen=window)

    def verdict(self, flats: list[torch.Tensor]) -> tuple[bool, float, float]:
        """(accepted, norm, median of recent norms); an accepted norm joins the history."""
        norm = math.sqrt(sum(float(torch.linalg.vector_norm(f, dtype=torch.float64)) ** 2 for f in flats))
        median = statistics.median(self.norms) if self.norms else float("nan")
        suspicious = not math.isfinite(norm) or (
            len(self.norms) >= self.min_history and norm > self.factor * median
        )
        if not suspicious:
            self.norms.append(norm)
        return not suspicious, norm, median

    def adopt(self, norms: list[float]) -> None:
        """A replacement or laggard takes a replica's history, so every rank keeps reaching the same verdict."""
        self.norms.clear()
        self.norms.extend(norms)
