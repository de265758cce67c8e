"""NDB knobs: the schema of ``ft.ndb`` (``conf/ft/ndb.yaml`` sets only what differs from these defaults).

The approximations exist for ablations: each switch works on its own, and ``exact_reference``
overrides all three to give the naive "neighbour does both exactly" baseline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, get_args

NeighbourPolicy = Annotated[str, Literal["ring_next", "ring_prev"]]
NEIGHBOUR_POLICIES = get_args(get_args(NeighbourPolicy)[1])


@dataclass
class NDBConfig:
    """What the neighbour approximates on the taken-over micro-batch, and when."""

    neighbour: NeighbourPolicy = "ring_next"
    """The live DP rank that takes over: the first after (ring_next) or before (ring_prev) the failed one."""
    skip_attention: bool = True
    """Attention branch forward-only (no_grad) on the taken-over micro-batch; the residual carries the gradient."""
    recompute_ffn: bool = True
    """Keep only each FFN branch's input, recompute the branch in backward."""
    lowrank_ffn: bool = True
    """Rank-r FFN weight gradients (G_y^T X V) V^T; input and bias gradients stay exact."""
    rank_ratio: float = 0.2
    """In (0, 1]: r = ceil(rank_ratio x min(out, in)) per FFN linear."""
    svd_every: int = 50
    """Steps between SVD refreshes of the cached bases V (>= 1)."""
    warmup_steps: int = 1000
    """Exact FFN weight gradients before this global step (>= 0)."""
    dynamic_rank: bool = False
    """r = max(base, step // 1000), capped at min(out, in)."""
    base_rank: int | None = None
    """Fixed rank (>= 1) for every FFN linear; null = use rank_ratio."""
    exact_reference: bool = False
    """Naive baseline: the extra micro-batch computed exactly (overrides the three switches)."""
    repair_after_s: float = -1.0
    """-1 = the failed rank stays out; >= 0 = restart it (at tp*pp > 1 its whole replica) after this many seconds,
    sync it from a DP peer and end the takeover."""

    def __post_init__(self) -> None:
        if self.neighbour not in NEIGHBOUR_POLICIES:
            raise ValueError(
                f"ndb.neighbour={self.neighbour!r}: choose one of {NEIGHBOUR_POLICIES}."
            )
        if not 0.0 < self.rank_ratio <= 1.0:
            raise ValueError(f"ndb.rank_ratio={self.rank_ratio} must lie in (0, 1].")
        if self.svd_every < 1:
            raise ValueError(f"ndb.svd_every={self.svd_every} must be >= 1 (steps between SVDs).")
        if self.warmup_steps < 0:
            raise ValueError(f"ndb.warmup_steps={self.warmup_steps} must be >= 0.")
        if self.repair_after_s < 0 and self.repair_after_s != -1.0:
            raise ValueError(f"ndb.repair_after_s={self.repair_after_s}: use -1 (never) or >= 0 seconds.")
        if self.base_rank is not None and self.base_rank < 1:
            raise ValueError(
                f"ndb.base_rank={self.base_rank} must be >= 1, or null to use rank_ratio."
            )

    @property
    def attention_skipped(self) -> bool:
        """Whether the extra micro-batch leaves attention-branch parameters without gradient."""
        return self.skip_attention and not self.exact_reference

    def lowrank_active(self, step: int) -> bool:
        """Low-rank FFN Wgrads apply only after warm-up (early training is too sensitive)."""
        return self.lowrank_ffn and not self.exact_reference and step >= self.warmup_steps
