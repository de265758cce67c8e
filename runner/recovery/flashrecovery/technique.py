"""FlashRecovery as the runner sees it: retry a transient fault, restart a failed rank in place."""

from __future__ import annotations

from runner.recovery.common.restart import RestartRank, Retry
from runner.recovery.flashrecovery.config import FlashRecoveryConfig
from runner.recovery.technique import Technique

TECHNIQUE = Technique(
    name="flashrecovery",
    title="FlashRecovery",
    options=FlashRecoveryConfig,
    actions=(Retry, RestartRank),
    worker="runner.recovery.flashrecovery.worker:FlashRecoveryWorker",
    restarts_rank_alone=True,
    owns_restart_budget=True,
    standby_option="standby",
    switched_by={"retry": "retry_transient"},
    checks="runner.recovery.flashrecovery.checks:config_problems",
)
