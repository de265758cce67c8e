"""FlashRecovery's worker side adds no hook to the step: a restarted rank takes its state from a live replica
through the recovery loop every worker runs (``rejoin.ReplicaRecovery``, its ``join``)."""

from __future__ import annotations

from lightning.pytorch import LightningModule

from runner.recovery.common.hooks import WorkerContext, WorkerHooks


class FlashRecoveryWorker:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    def hooks(self, module: LightningModule) -> WorkerHooks:
        return WorkerHooks()
