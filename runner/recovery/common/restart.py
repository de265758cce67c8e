"""Retry a transient collective error; restart a failed rank in place: the controller actions FlashRecovery
brings, and DeadPool too (it restarts a crashed rank in place rather than spend a spare).

A retry publishes a new generation of the same members; a restart spawns the failed rank again where
it last ran (a joiner: its state comes from a live replica). In-place restarts are bounded by
``max_restarts`` of the technique that owns the budget (FlashRecovery, else DeadPool, which restarts a
crashed rank the same way).

With ``ft.flashrecovery.standby`` each host keeps one warm replacement (a worker started as a spare:
imports, store connections, model and Trainer built, waiting for a logical rank). A restart on that host
hands it the failed rank instead of starting a process, so the complete generation is published at the
decision: no start-up and no survivors-only group on the way. The host gets a new standby once the
replacement trains, so that its start-up does not compete with the recovery for the CPU.
"""

from __future__ import annotations

from typing import Optional

from runner.recovery.actions import LAUNCHER_OWNS, RecoveryAction, Situation


class Retry(RecoveryAction):
    """A collective failed with every process alive: rebuild the group and retry the step."""

    name = "retry"
    handles = ("transient",)
    does = "rebuild the group and retry the step; nobody restarts"


class RestartRank(RecoveryAction):
    """Restart each failed rank in place, on the node and slot of whoever computed it last."""

    name = "restart_rank"
    handles = ("process_crash", "hang", "straggler")
    does = "restart in place, state from a surviving replica"

    def __init__(self, cfg, topo, run_dir) -> None:
        super().__init__(cfg, topo, run_dir)
        self.restarts = 0
        from runner.recovery.registry import standby_options  # the registry lists the techniques built on this

        self.standby = bool(standby_options(list(cfg.ft), cfg.ft))
        self.standbys: dict[int, int] = {}  # node -> the wid of its parked standby (ready or still starting)
        self.used: dict[int, int] = {}  # node -> the wid that took its standby's place, until it trains

    def on_start(self, ctx) -> None:
        if self.standby and ctx.fleet.can_spawn:  # a launcher that restarts ranks itself needs none
            for node in range(self.topo.nodes):
                self._park(ctx, node, first_gen=0)

    def _park(self, ctx, node: int, first_gen: int) -> None:
        """Start ``node``'s standby, in a slot after its ranks' (a spare: it waits, warm, for a logical rank)."""
        members = ctx.members
        self.standbys[node] = members.spawn(-1, node, self.topo.procs_per_node, role="spare", first_gen=first_gen).wid

    def poll(self, ctx, now: float) -> None:
        """A host whose standby took a rank gets a new one once no recovery is open and that rank trains."""
        if ctx.incidents.active is not None:
            return
        for node, wid in list(self.used.items()):
            worker = ctx.members.workers[wid]
            if worker.dead or worker.synced:
                del self.used[node]
                if node not in ctx.detector.nodes_lost:
                    self._park(ctx, node, first_gen=ctx.members.gen + 1)

    def on_exit(self, ctx, wid: int, code: int) -> bool:
        node = next((n for n, w in self.standbys.items() if w == wid), None)
        if node is None:
            return False
        del self.standbys[node]
        ctx.members.workers[wid].dead = True
        ctx.events.emit("standby_lost", wid=wid, node=node, code=code)
        return True

    def on_nodes_lost(self, ctx, nodes: list[int]) -> None:
        for node in [n for n in self.standbys if n in nodes]:
            ctx.members.workers[self.standbys.pop(node)].dead = True

    @staticmethod
    def obstacle(s: Situation) -> Optional[str]:
        if not s.can_restart:
            return LAUNCHER_OWNS
        if s.restarts_left < len(s.victims):
            from runner.recovery.registry import restart_owner

            return (f"restart budget spent (ft.{restart_owner(s.ft)}.max_restarts); raise it if failures are expected "
                    "this often")
        return None

    def decide_inputs(self, ctx, lost_nodes: list[int]) -> dict:
        from runner.recovery.registry import restart_owner

        owner = restart_owner(ctx.ft)
        return {"restarts_left": (self.cfg.ft[owner].max_restarts if owner else 0) - self.restarts}

    def act(self, ctx, decision, lost_nodes: list[int]) -> None:
        members = ctx.members
        for lrank in decision.victims:
            home = members.workers[members.covered_by.pop(lrank, members.assigned[lrank])]  # who computed it last
            self.restarts += 1
            wid = self.standbys.get(home.node)
            if wid is not None and home.node not in lost_nodes and ctx.store.check([f"ready/{wid}"]):
                del self.standbys[home.node]
                self.used[home.node] = wid
                standby = members.workers[wid]
                standby.logical, standby.role, standby.ready = lrank, "joiner", True  # warm: it joins this generation
                members.assigned[lrank] = wid
                ctx.events.emit("standby_assigned", logical=lrank, wid=wid, node=home.node)
            else:
                members.spawn(lrank, home.node, home.local_rank, role="joiner", first_gen=members.gen + 1)
