"""DeadPool as the runner sees it: warm spares take a lost rank's or host's place; ZeRO-1 shards replicated."""

from __future__ import annotations

from runner.recovery.common.restart import RestartRank, Retry
from runner.recovery.deadpool.action import SwapSpare
from runner.recovery.deadpool.config import DeadPoolConfig
from runner.recovery.technique import Technique

TECHNIQUE = Technique(
    name="deadpool",
    title="DeadPool",
    options=DeadPoolConfig,
    actions=(Retry, RestartRank, SwapSpare),  # a transient fault is retried, a crash restarted in place, not swapped
    worker="runner.recovery.deadpool.worker:DeadPoolWorker",
    uses_spares=True,
    replicates_shards=True,
    owns_restart_budget=True,
    rank_loss_first=lambda options: ("swap_spare",) if options.get("crash_action") == "swap" else (),
    checks="runner.recovery.deadpool.checks:config_problems",
)
