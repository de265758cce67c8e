"""The flash checkpoint's controller side: restart every rank from the newest snapshot all of them hold.

The run's snapshots live in shared memory under one job id (``flash_job_id``). A restart kills what is
left and starts every logical rank again with role ``restore``; ranks of a lost node start on its
partner node (which holds their memory copies), or on the first node still up
(``Topology.restart_place``). Each node agent runs a persister that writes snapshots to disk, and the
fork server loads the copy kernels ahead. When every worker is gone the snapshots are removed (under
torchrun/SLURM only once the run completed: the launcher's restart of a failed attempt resumes from them).
The config check and the decision read only the class (``name``, ``obstacle``): the persister and the
segment removal, which load torch, are imported in the hooks of the controller's run that use them.
"""

from __future__ import annotations

from typing import Optional

from runner.recovery.actions import LAUNCHER_OWNS, HostMemory, NodePersist, RecoveryAction, Situation
from runner.recovery.flash_names import flash_job_id


class RestartAll(RecoveryAction):
    """Kill what is left and restart every logical rank from the snapshots."""

    name = "restart_all"
    handles = ("transient", "process_crash", "hang", "node_loss_spare_free", "node_loss_no_spare",
               "replica_lost")
    does = "restart every rank from the newest flash snapshot all of them hold (flash_ckpt)"
    publishes_survivors = False  # nobody holds state to wait with: only the complete generation is published

    def __init__(self, cfg, topo, run_dir) -> None:
        super().__init__(cfg, topo, run_dir)
        self.job = flash_job_id(run_dir)
        self.full_restarts = 0

    @staticmethod
    def obstacle(s: Situation) -> Optional[str]:
        nodes = s.cfg.parallel.nodes
        up = s.nodes_up if s.nodes_up is not None else nodes - len([n for n in s.lost_nodes if n < nodes])
        if not s.can_restart:
            return LAUNCHER_OWNS
        if up < 1:
            return f"every node was lost (now {s.lost_nodes}): there is no node left to restart the ranks on"
        if s.no_snapshots:
            return (f"logical rank(s) {sorted(s.no_snapshots)} are computed by NDB neighbours, which snapshot only "
                    "their own rank: no snapshot step is common to every rank")
        if s.full_restarts_left < 1:
            return (f"restart budget spent (ft.flash_ckpt.max_restarts={s.cfg.ft.flash_ckpt.max_restarts} restarts "
                    "of every rank); raise it if failures are expected this often")
        return None

    def worker_preload(self) -> list[str]:
        return ["runner.recovery.flash_ckpt.warm_kernels"]

    def node_persister(self) -> Optional[NodePersist]:
        fc = self.cfg.ft.flash_ckpt
        if not fc.persist_every_n_steps:
            return None
        return NodePersist(self.job, self.run_dir / "checkpoints", fc.keep, self.run_dir / "events.jsonl",
                           start="runner.recovery.flash_ckpt.persister:start_node_persister")

    def host_memory(self) -> HostMemory:
        from runner.recovery.flash_ckpt.host_memory import SnapshotMemory  # segment code: torch

        return SnapshotMemory(self.job)

    def decide_inputs(self, ctx, lost_nodes: list[int]) -> dict:
        return {"full_restarts_left": self.cfg.ft.flash_ckpt.max_restarts - self.full_restarts}

    def act(self, ctx, decision, lost_nodes: list[int]) -> None:
        members = ctx.members
        self.full_restarts += 1
        members.kill_all()
        for w in members.live():
            w.dead = True
        members.covered_by.clear()
        for action in ctx.actions:
            action.on_every_rank_restarted()
        ctx.detector.silent_reported |= set(lost_nodes)  # handled here: its silence is no new symptom
        for lrank in range(self.topo.world):
            node, local = self.topo.restart_place(lrank, ctx.detector.silent_reported)
            members.spawn(lrank, node, local, role="restore", first_gen=members.gen + 1)

    def on_end(self, ctx) -> None:
        # no restart can need them now, unless the launcher owns the processes and restarts a failed attempt
        if ctx.fleet.can_spawn or ctx.members.all_done():
            from runner.recovery.flash_ckpt.hygiene import cleanup

            ctx.events.emit("snapshots_removed", segments=len(cleanup(self.job)))
