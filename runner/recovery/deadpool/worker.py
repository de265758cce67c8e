"""DeadPool's worker side: under ZeRO-1, every update's shard is replicated to a neighbour on another node (the
neighbour replays the update, or the owner copies the shard, over a side group of its own), and the worker reports
what that costs. Spares need nothing here: they join as any replacement does."""

from __future__ import annotations

from lightning.pytorch import LightningModule

from runner.recovery.common.hooks import WorkerContext, WorkerHooks
from runner.recovery.deadpool.replication import ShardReplication
from runner.recovery.deadpool.replicator import ShardReplicator
from runner.training.zero import ZeroOne


class DeadPoolWorker:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self._replication: ShardReplication | None = None  # built once the optimizer is sharded

    def hooks(self, module: LightningModule) -> WorkerHooks:
        if not self.ctx.cfg.parallel.zero:
            return WorkerHooks()
        return WorkerHooks(shard_replication=self._replicate, side_group=True, final_record=self._final_record)

    def _replicate(self, zero: ZeroOne) -> ShardReplication:
        comm, cfg = self.ctx.comm, self.ctx.cfg.ft.deadpool
        replicator = ShardReplicator(zero, self.ctx.topology, comm.collective_timeout.total_seconds(),
                                     mode=cfg.replication, verify_every_n_steps=cfg.verify_every_n_steps)
        self._replication = ShardReplication(replicator, comm, self.ctx.events)
        return self._replication

    def _final_record(self) -> dict:
        if self._replication is None:
            return {}
        replicator = self._replication.replicator
        return {"replication": {"bytes_per_step": replicator.bytes_per_step, "bytes_sent": replicator.bytes_sent,
                                "buffer_bytes": replicator.memory_bytes()}}
