"""DeadPool's controller side: the pool of hot spares and the swap of a spare into a failed rank.

Spares are started with the job on nodes of their own (``Topology.spare_place``), and on every host that
joins the running job later (``launcher.join``), load everything a rank needs and wait, warm, for a logical
rank (``spare_ready`` once they do). A swap gives each failed rank a ready spare, which joins
the next generation and takes its state from a replica (ZeRO-1 shards from the neighbour that
replicated them). A spare that dies, or whose node is lost, leaves the pool.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from runner.recovery.actions import RecoveryAction, Situation


class SwapSpare(RecoveryAction):
    """Warm spares take the failed logical ranks."""

    name = "swap_spare"
    handles = ("process_crash", "hang", "node_loss_spare_free", "straggler")
    does = "warm spares take their places, state from a replica (DeadPool)"

    def __init__(self, cfg, topo, run_dir) -> None:
        super().__init__(cfg, topo, run_dir)
        self.spares: list[int] = []  # wids: started, warm, not yet given a logical rank
        self.warming: list[int] = []  # spares not yet seen ready

    @staticmethod
    def obstacle(s: Situation) -> Optional[str]:
        if s.spares < len(s.victims):
            return f"only {s.spares} ready spare(s) for {len(s.victims)} rank(s)"
        return None

    def on_start(self, ctx) -> None:
        for i in range(self.topo.spares):  # hot spares live on nodes of their own
            self.spares.append(ctx.members.spawn(-1, *self.topo.spare_place(i), role="spare", first_gen=0).wid)
        self.warming = list(self.spares)

    def on_host_joined(self, ctx, node: int) -> None:
        """A spare host joined the running job: a warm spare in each of its slots, for a later generation."""
        for local in range(self.topo.procs_per_node):
            wid = ctx.members.spawn(-1, node, local, role="spare", first_gen=ctx.members.gen + 1).wid
            self.spares.append(wid)
            self.warming.append(wid)

    def poll(self, ctx, now: float) -> None:
        for wid in [w for w in self.warming if w in self.spares and ctx.store.check([f"ready/{w}"])]:
            self.warming.remove(wid)
            ctx.events.emit("spare_ready", wid=wid, node=ctx.members.workers[wid].node)
        self.warming = [w for w in self.warming if w in self.spares]  # the rest died, or were given a rank

    def on_exit(self, ctx, wid: int, code: int) -> bool:
        if wid not in self.spares:
            return False
        self.spares.remove(wid)
        ctx.members.workers[wid].dead = True
        ctx.events.emit("spare_lost", wid=wid, code=code, spares_left=len(self.spares))
        return True

    def on_nodes_lost(self, ctx, nodes: list[int]) -> None:
        workers = ctx.members.workers
        for wid in [w for w in self.spares if workers[w].node in nodes]:
            self.spares.remove(wid)
            workers[wid].dead = True
            ctx.events.emit("spare_lost", wid=wid, node=workers[wid].node, spares_left=len(self.spares))

    def decide_inputs(self, ctx, lost_nodes: list[int]) -> dict:
        workers = ctx.members.workers
        return {"spares": len([s for s in self._ready(ctx) if workers[s].node not in lost_nodes])}

    def act(self, ctx, decision, lost_nodes: list[int]) -> None:
        members, workers = ctx.members, ctx.members.workers
        hosts = [(lrank, self._host_of(members, lrank)) for lrank in decision.victims]
        chosen = pick_spares(hosts, [(wid, workers[wid].node) for wid in self._ready(ctx)])
        for lrank, wid in zip(decision.victims, chosen):
            members.covered_by.pop(lrank, None)  # a rank a neighbour covered until now gets a process of its own
            self.spares.remove(wid)
            spare = members.workers[wid]
            spare.logical, spare.role, spare.ready = lrank, "joiner", True  # warm: it joins this generation
            members.assigned[lrank] = wid
            ctx.events.emit("spare_assigned", logical=lrank, wid=wid, node=spare.node, spares_left=len(self.spares))

    def _host_of(self, members, lrank: int) -> int:
        """The host of the process that held ``lrank`` last (its launch node if none did)."""
        wid = members.assigned.get(lrank)
        return members.workers[wid].node if wid is not None else self.topo.node_of(lrank)

    def _ready(self, ctx) -> list[int]:
        """Spares whose node is beating and whose process has loaded everything."""
        silent = ctx.detector.silent_nodes_now()
        return [wid for wid in self.spares if ctx.members.workers[wid].node not in silent
                and ctx.store.check([f"ready/{wid}"])]


def pick_spares(victims: list[tuple[int, int]], ready: list[tuple[int, int]]) -> list[int]:
    """The spare (wid) each failed rank gets, in the order of ``victims`` ((logical rank, its host) pairs), from
    ``ready`` ((wid, its host) pairs, in the pool's order). The failed ranks of one host go together, in their
    order, to the first spare host with enough ready spares left, so a spare host takes every (dp, pp, tp)
    coordinate of a lost host and a tensor-parallel group, which lives inside a host, stays inside one; ranks that
    no single host can take get the pool's next spares."""
    left, got = list(ready), {}
    groups: dict[int, list[int]] = {}
    for lrank, host in victims:
        groups.setdefault(host, []).append(lrank)
    for ranks in groups.values():
        counts = Counter(host for _, host in left)
        fit = next((host for host in counts if counts[host] >= len(ranks)), None)
        chosen = [spare for spare in left if fit is None or spare[1] == fit][:len(ranks)]
        for lrank, spare in zip(ranks, chosen):
            got[lrank] = spare[0]
            left.remove(spare)
    return [got[lrank] for lrank, _ in victims]
