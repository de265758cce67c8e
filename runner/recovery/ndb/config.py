"""NDB knobs, one field per key of ``conf/ft/ndb.yaml`` (flat and typed so a schema can mirror it).

The approximations exist for ablations: each switch works on its own, and ``exact_reference``
overrides all three to give the naive "neighbour does both exactly" baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

NEIGHBOUR_POLICIES = ("ring_next", "ring_prev")


@dataclass
class NDBConfig:
    """What the neighbour approximates on the taken-over micro-batch, and when."""

    neighbour: str = "ring_next"
    skip_attention: bool = True
    recompute_ffn: bool = True
    lowrank_ffn: bool = True
    rank_ratio: float = 0.2
    svd_every: int = 50
    warmup_steps: int = 1000
    dynamic_rank: bool = False
    base_rank: int | None = None
    exact_reference: bool = False
    repair_after_s: float = -1.0

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
