"""The replica check: do the data-parallel replicas still hold the same parameters, every N committed steps?

It rides in the step's gradient all-reduce, in the accounting slot of the last exact bucket
(``runner.training.reducer``), so it costs no collective of its own: on a check step each member writes a
32-bit fingerprint of its committed parameters into the two slots of its DP coordinate (16 bits each,
plus one, so that an absent member reads 0), every other slot 0; the reduction's sum then holds
every member's fingerprint, exact in float32 (each slot has one contributor, below 2**24), and every
member reaches the same verdict from the same sum. Between checks the slots stay 0 and no
fingerprint is taken. The group is the reduction's (the DP group of a model slice with tp*pp > 1), so
only ranks that hold the same slice are compared.

The fingerprint is a hash of the int64 sums of each parameter's bit patterns: any single flipped bit
changes its tensor's sum, so it is caught with certainty up to the 2**-32 chance that the hash
collides; two replicas that drifted apart (many elements) likewise. Equal values in swapped
positions within one tensor are not told apart (no fault makes them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

SLOTS_PER_REPLICA = 2  # the fingerprint's high and low 16 bits, each plus one
_MASK64 = (1 << 64) - 1
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> same-width integers


def due(step: int, every_n_steps: int) -> bool:
    """Whether step ``step``'s reduction carries the check (0 = never)."""
    return every_n_steps > 0 and step % every_n_steps == 0


def fingerprint(params: Iterable[Tensor]) -> int:
    """A 32-bit hash of the parameters' exact bits, in the given order."""
    h = 0
    for i, p in enumerate(params):
        bits = p.detach().reshape(-1).view(_INT_VIEW[p.element_size()])
        h = _mix(h ^ _mix((int(bits.sum(dtype=torch.int64)) + i) & _MASK64))
    return h >> 32


def encode(fp: int, dp_rank: int, dp_size: int) -> Tensor:
    """This member's slots: ``fp`` at its DP coordinate, zeros elsewhere (summed over the group, every member's)."""
    slots = torch.zeros(SLOTS_PER_REPLICA * dp_size, dtype=torch.float64)
    slots[SLOTS_PER_REPLICA * dp_rank] = (fp >> 16) + 1
    slots[SLOTS_PER_REPLICA * dp_rank + 1] = (fp & 0xFFFF) + 1
    return slots


def decode(reduced: Tensor) -> dict[int, int]:
    """Each present member's fingerprint by DP coordinate, from the reduced slots."""
    values = [int(v) for v in reduced.tolist()]
    out = {}
    for r in range(len(values) // SLOTS_PER_REPLICA):
        hi, lo = values[SLOTS_PER_REPLICA * r], values[SLOTS_PER_REPLICA * r + 1]
        if hi > 0 and lo > 0:
            out[r] = ((hi - 1) << 16) | (lo - 1)
    return out


@dataclass(frozen=True)
class Verdict:
    """The check's outcome for one group: which DP coordinates disagree with the majority, if there is one."""

    fingerprints: dict[int, int]  # DP coordinate -> fingerprint
    majority: Optional[int]  # the fingerprint more than half the members hold; None when none does

    @property
    def diverged(self) -> bool:
        return len(set(self.fingerprints.values())) > 1

    @property
    def disagreeing(self) -> list[int]:
        """The members outside the majority (every member when there is none)."""
        return sorted(r for r, fp in self.fingerprints.items() if fp != self.majority)

    @property
    def source(self) -> Optional[int]:
        """The member the disagreeing ones restore from: the lowest DP coordinate of the majority."""
        return None if self.majority is None else min(r for r, fp in self.fingerprints.items() if fp == self.majority)


def verdict(fingerprints: dict[int, int]) -> Verdict:
    counts = Counter(fingerprints.values())
    fp, n = counts.most_common(1)[0] if counts else (None, 0)
    return Verdict(fingerprints, fp if 2 * n > len(fingerprints) else None)


def _mix(x: int) -> int:
    """splitmix64's finaliser: every input bit moves about half the output bits."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
