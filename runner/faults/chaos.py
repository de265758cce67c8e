"""fault=chaos: when the next fault comes, of which kind, and whom it hits.

Inter-arrival times are exponential with mean ``fault.mtbf_s``, counted from the moment the
previous fault settled (its recovery finished), so faults never pile onto each other. The controller offers, at
each draw, the victims that the mix can handle right now for each kind; a kind with none is not
drawn. Every draw takes the same three numbers from one ``random.Random`` seeded from ``seed``,
so the same seed and the same run give the same faults. Bounded by ``fault.max_faults`` and by
``fault.until_s`` seconds of training.
"""

from __future__ import annotations

import random
import signal
from dataclasses import dataclass
from typing import Optional

# Faults the victim's own process carries out: the controller writes the order under ORDER_KEY and
# sends SIGNAL; the worker reads the order at its next step start (no polling of the store).
SIGNAL = signal.SIGUSR1
ORDER_KEY = "chaos/{wid}"
WORKER_SIDE = ("transient", "partition", "bitflip")


@dataclass
class Draw:
    index: int  # 0, 1, ... in drawing order
    kind: str
    victim: int  # logical rank, or node for kill_node
    candidates: dict  # kind -> victims the mix could handle when this fault was drawn


class Chaos:
    def __init__(self, fault, seed: int) -> None:
        self.kinds = list(fault.kinds)
        self.mtbf_s, self.max_faults, self.until_s = fault.mtbf_s, fault.max_faults, fault.until_s
        self.rng = random.Random(f"chaos/{seed}")
        self.drawn = 0
        self.t0: Optional[float] = None
        self.next_at: Optional[float] = None  # None while the last fault has not settled
        self.gap = 0.0  # drawn with each fault: the wait after it settles

    def start(self, now: float) -> None:
        """Training has begun: the clock for ``until_s`` and the first gap start now."""
        self.t0 = now
        self.next_at = now + self.rng.expovariate(1.0 / self.mtbf_s)

    def settled(self, now: float) -> None:
        """The last fault's recovery is over: the next one comes ``gap`` seconds from now."""
        self.next_at = now + self.gap

    @property
    def over(self) -> bool:
        if self.next_at is None:
            return self.drawn >= self.max_faults
        assert self.t0 is not None  # next_at is first set by start(), with t0
        return self.drawn >= self.max_faults or self.next_at - self.t0 > self.until_s

    def due(self, now: float) -> bool:
        return self.next_at is not None and not self.over and now >= self.next_at

    def draw(self, now: float, candidates: dict[str, list[int]]) -> Optional[Draw]:
        """Pick a kind among those with a victim, then a victim; None (and no number used) if there is none."""
        kinds = [k for k in self.kinds if candidates.get(k)]
        if not kinds:
            return None
        u_kind, u_victim = self.rng.random(), self.rng.random()
        kind = kinds[int(u_kind * len(kinds))]
        victims = sorted(candidates[kind])
        self.gap = self.rng.expovariate(1.0 / self.mtbf_s)
        self.drawn += 1
        self.next_at = None
        return Draw(self.drawn - 1, kind, victims[int(u_victim * len(victims))], candidates)
