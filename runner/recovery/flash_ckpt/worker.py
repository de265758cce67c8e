"""flash_ckpt's worker side: the snapshot callback, and a restarted rank's restore from snapshots.

A restarted rank (role ``restore``) maps its snapshots and faults in memory for them (``Prefetch``)
while it builds its model, which is why this side starts before the model exists; the snapshot
kernels are compiled then too (inherited from the fork server; loaded here under torchrun or SLURM).
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import LightningModule

from runner.plumbing import protocol
from runner.recovery.common.hooks import WorkerContext, WorkerHooks
from runner.recovery.flash_ckpt.callback import FlashCheckpoint
from runner.recovery.flash_ckpt.events import Event
from runner.recovery.flash_ckpt.persister import persister_address, settle_node_persister
from runner.recovery.flash_ckpt.prefetch import Prefetch
from runner.recovery.flash_ckpt.restore import invalidate_newer, list_snapshots, newest_common_step
from runner.recovery.flash_ckpt.snapshot_restore import SnapshotRestore
from runner.recovery.flash_names import flash_job_id


class FlashCkptWorker:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.prefetch: Prefetch | None = None
        self.held: list[int] = []  # the steps of this rank's snapshots, for a restarted rank
        if ctx.role == "restore":
            job_id, rank = flash_job_id(ctx.run_dir), ctx.logical_rank
            self._settle_persists(job_id)
            self.held = sorted({c.step for c in list_snapshots(job_id, rank, Path(ctx.run_dir) / "checkpoints")})
            if self.held:
                self.prefetch = Prefetch(job_id, rank)
        from runner.recovery.flash_ckpt.kernels import warm_up  # numba only where flash checkpoints run

        warm_up()

    def _settle_persists(self, job_id: str) -> None:
        """Let this node's persister finish writing for the ranks that died (their requests in flight, their persist
        at breakpoint) before this rank lists its snapshots: every rank then chooses from files that stay as listed.
        A persister that does not settle in time is reported, and the restore goes on with what is on disk."""
        ctx = self.ctx
        settled = settle_node_persister(persister_address(job_id, ctx.node), ctx.cfg.launcher.start_timeout_s)
        if settled is not None and (settled.waited or settled.left):
            ctx.events.emit("persists_settled" if settled.left == 0 else "persists_unsettled", waited=settled.waited,
                            left=settled.left, seconds=round(settled.seconds, 4))

    def hooks(self, module: LightningModule) -> WorkerHooks:
        ctx = self.ctx
        flash = self._callback()
        restore = None
        if ctx.role != "restore" or self._snapshots_to_restore():
            restore = SnapshotRestore(ctx.comm, ctx.events, ctx.recovery, flash.job_id, flash.dir, self.prefetch)
        # the partner copies travel on the side group, beside the main group's collectives; a recovery
        # abandons the exchange in flight on the generation it replaces
        partners = ctx.cfg.ft.flash_ckpt.neighbour_backup and ctx.topology.nodes > 1
        if partners:
            ctx.recovery.on_groups_dropped.append(flash.abandon_exchange)
        return WorkerHooks(callbacks=[flash], restore_snapshot=restore, side_group=partners)

    def _snapshots_to_restore(self) -> bool:
        """Whether this restart restores snapshots, or every rank starts where the run did (``runner.resume``, or
        step 0), as a launcher's restart of a failed attempt does. It starts over when the fault struck before the
        first snapshot was committed everywhere: no rank holds one, or some hold that one step and the others none
        (their copy was in flight, or lost with its node). Where the ranks hold more than one step but none in
        common, the restore's agreement fails the run with the table: starting over would throw away far more than
        the fault did."""
        ctx = self.ctx
        table = protocol.steps_held_by_each_rank(ctx.comm.store, f"restart/{ctx.first_gen}/held", ctx.logical_rank,
                                                 ctx.topology.world, self.held, ctx.cfg.launcher.start_timeout_s)
        held_anywhere = set().union(*table)
        if newest_common_step(table) is not None or len(held_anywhere) > 1:
            return True
        if held_anywhere:  # the first snapshot, of an abandoned timeline now: never restored later
            invalidate_newer(flash_job_id(ctx.run_dir), ctx.logical_rank, -1, Path(ctx.run_dir) / "checkpoints")
        if self.prefetch is not None:
            self.prefetch.close()
            self.prefetch = None
        if ctx.logical_rank == 0:
            reason = "no rank held a snapshot: the fault struck before the first one was taken"
            if held_anywhere:
                lacking = [r for r, steps in enumerate(table) if not steps]
                reason = (f"only the first snapshot (step {min(held_anywhere)}) was held, and rank(s) {lacking} "
                          "held none: the fault struck while it was taken, or took the only copy")
            ctx.events.emit("restart_from_start", resume=ctx.cfg.runner.resume, reason=reason)
        return False

    def _callback(self) -> FlashCheckpoint:
        """Snapshots of this logical rank, a copy on the partner node, persists to <run dir>/checkpoints."""
        ctx = self.ctx
        fc = ctx.cfg.ft.flash_ckpt

        def partner(rank: int):
            return ctx.topology.partner_rank(rank) if fc.neighbour_backup else None

        def on_event(event: Event) -> None:
            if event.kind not in ("committed", "backed_up"):  # one per snapshot and rank would drown the log
                ctx.events.emit(f"snapshot_{event.kind}", snapshot_step=event.step, where=event.where,
                                detail=event.detail)

        job_id = flash_job_id(ctx.run_dir)
        return FlashCheckpoint(fc.every_n_steps, fc.persist_every_n_steps or None, Path(ctx.run_dir) / "checkpoints",
                               overlap=fc.overlap, job_id=job_id, keep=fc.keep, rank=None, partner=partner,
                               on_event=on_event, comm=ctx.comm,  # a spare learns its rank when given one
                               persister_address=persister_address(job_id, ctx.node))
