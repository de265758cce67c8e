"""Fault classification and the action the policy table allows.

A pure function of what the controller observed, so the policy is unit-tested without processes
(and the config check replays configured faults through it). The fault is put in one class of the
policy table (runner/config/policy.py), and the first action of that class's row that can act now
is taken (each action says why it cannot: ``obstacle`` in its technique's ``action.py``, found through
``runner/recovery/registry.py``); when none can, the run fails with the reason and with what would have handled it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from runner.config import policy
from runner.planning.topology import Topology
from runner.recovery.actions import Situation
from runner.recovery.registry import action_class, offering, replicates_shards, restart_owner, titles, with_

# restart_owner: the config check
__all__ = ["Decision", "classify", "decide", "decide_straggler", "restart_owner", "shards_without_copy"]


@dataclass
class Decision:
    fault: str  # what was seen: transient | process_crash | hang | node_loss (the controller relabels partition)
    action: str  # retry | restart_rank | swap_spare | takeover | restart_all | fail
    victims: list[int] = field(default_factory=list)  # logical ranks
    reason: str = ""
    fault_class: str = ""  # the policy row it was decided by


def classify(*, dead: list[int], hung: bool, lost_nodes: list[int], lost_ranks: list[int], survivors: list[int],
             spares: int) -> tuple[str, str, list[int]]:
    """(the fault seen, its policy class, the logical ranks it took)."""
    if lost_nodes:
        victims = sorted(set(lost_ranks) | set(dead))
        if not survivors:
            return "node_loss", "replica_lost", victims
        return "node_loss", "node_loss_spare_free" if spares >= len(victims) else "node_loss_no_spare", victims
    if dead:
        fault = "hang" if hung else "process_crash"
        return fault, fault if survivors else "replica_lost", sorted(dead)
    return "transient", "transient", []


def decide(*, ft: list[str], cfg, can_restart: bool = True, dead: list[int], hung: bool, lost_nodes: list[int],
           lost_ranks: list[int], survivors: list[int], restarts_left: int, spares: int = 0,
           full_restarts_left: int = 0, nodes_up: Optional[int] = None, no_snapshots: Sequence[int] = ()) -> Decision:
    """``nodes_up``: the job's nodes still up after this fault (default: parallel.nodes less ``lost_nodes``);
    ``no_snapshots``: logical ranks NDB neighbours compute, which write no flash snapshots of their own."""
    fault, cls, victims = classify(dead=dead, hung=hung, lost_nodes=lost_nodes, lost_ranks=lost_ranks,
                                   survivors=survivors, spares=spares)
    lost_shards = shards_without_copy(cfg, ft, victims, covered=no_snapshots)
    if lost_shards and cls != "transient":
        cls = "replica_lost"  # ZeRO-1: no live process holds these ranks' optimizer shards
    replicating = with_(ft, "replicates_shards")
    replicator = titles(replicating or offering("replicates_shards"))  # in prose: DeadPool
    if replicating and no_snapshots:
        copies = (f"any copy: {replicator}'s replication is suspended while {titles(with_(ft, 'covers_ranks'))} "
                  f"covers logical rank(s) {sorted(no_snapshots)}, so a failure after the takeover cannot be recovered "
                  "from a replica")
    elif replicating or not lost_shards or Topology.from_cfg(cfg).replica_groups == 1:
        copies = f"their only copy ({replicator}'s replica on the next node)"
    else:
        copies = "every copy (the same shard in the other DP replica groups)"
    what = _what(fault, cls, victims, lost_nodes, spares, lost_shards, copies)
    row = policy.table(cfg, ft)[cls]
    situation = Situation(ft=ft, cfg=cfg, can_restart=can_restart, victims=victims, lost_nodes=lost_nodes,
                          restarts_left=restarts_left, spares=spares, full_restarts_left=full_restarts_left,
                          nodes_up=nodes_up, no_snapshots=list(no_snapshots))
    skipped: list[str] = []
    for action in row:
        taker = action_class(action)
        why_not = taker.obstacle(situation)
        if why_not is None:
            passed = f" ({'; '.join(skipped)})" if skipped else ""
            return Decision(fault, action, victims, f"{what}: {taker.does} [policy.{cls}]{passed}", cls)
        skipped.append(f"{action} impossible: {why_not}")
    if skipped:
        return Decision(fault, "fail", victims, f"{what}, and no action of policy.{cls}={row} can act: "
                        f"{'; '.join(skipped)}", cls)
    if lost_shards:
        return Decision(fault, "fail", victims, f"{what}, so there is nothing to rebuild them from: add "
                        f"{_add('restarts_from_snapshots')} for snapshots to fall back on", cls)
    return Decision(fault, "fail", victims, _unhandled(fault, cls, victims, lost_nodes, spares, ft), cls)


def decide_straggler(*, ft: list[str], cfg, kind: str, rank: int, host_ranks: list[int], can_restart: bool,
                     restarts_left: int, spares: int) -> Decision:
    """The straggler row's first action that can act on a straggler of ``kind`` (rank, host, link) at logical
    ``rank``, whose host computes ``host_ranks``. ``swap_spare`` moves the whole host (a slow GPU, a throttled
    host, its link: the hardware is the cause); ``restart_rank`` restarts the one rank's process (a leak: the
    process is the cause), so it passes over a host or link. When nothing in the row can act the straggler is
    reported: it slows the job, it fails nobody."""
    row = policy.table(cfg, ft)["straggler"]
    skipped: list[str] = []
    what = f"{kind} straggler at logical rank {rank}"
    for action in row:
        if action == "report":
            break
        victims = host_ranks if action == "swap_spare" else [rank]
        if action == "restart_rank" and kind != "rank":
            skipped.append(f"restart_rank impossible: a restart does not make a slow {kind} faster")
            continue
        situation = Situation(ft=ft, cfg=cfg, can_restart=can_restart, victims=victims, lost_nodes=[],
                              restarts_left=restarts_left, spares=spares)
        why_not = action_class(action).obstacle(situation)
        if why_not is None:
            passed = f" ({'; '.join(skipped)})" if skipped else ""
            moved = f"logical ranks {victims}" if action == "swap_spare" else f"logical rank {rank}"
            return Decision("straggler", action, victims, f"{what}, {moved} handed over at a committed step: "
                            f"{action_class(action).does} [policy.straggler]{passed}", "straggler")
        skipped.append(f"{action} impossible: {why_not}")
    passed = f" ({'; '.join(skipped)})" if skipped else ""
    return Decision("straggler", "report", [], f"{what}: reported, nothing done [policy.straggler]{passed}",
                    "straggler")


def shards_without_copy(cfg, ft: list[str], victims: list[int], covered: Sequence[int] = ()) -> list[int]:
    """ZeRO-1: the failed ranks whose optimizer shard no live process holds. Its copies are the replica
    a technique in ``ft`` keeps on the holder (``Topology.replica_holder``), if one does, else the same shard
    in the other DP replica groups (``Topology.shard_copies``), if there are any. While NDB neighbours compute
    the ``covered`` ranks, the holders of their replicas carry their shards and DeadPool replicates nothing
    (``ShardReplication``): no failed rank's shard has a copy."""
    if not victims or not cfg.get("parallel", {}).get("zero", 0):
        return []
    topology = Topology.from_cfg(cfg)
    if replicates_shards(ft):
        return sorted(victims) if covered else topology.shards_without_copy(victims)
    lost = set(victims)
    return sorted(v for v in lost if all(c in lost for c in topology.shard_copies(v)))


def _what(fault: str, cls: str, victims: list[int], lost_nodes: list[int], spares: int,
          lost_shards: Sequence[int], copies: str) -> str:
    if cls == "transient":
        return "collective error with every process alive"
    if lost_shards:
        return (f"{fault} of logical rank(s) {victims} took the ZeRO-1 optimizer shard(s) of rank(s) "
                f"{list(lost_shards)} together with {copies}")
    if fault == "node_loss":
        return f"node(s) {lost_nodes} lost with logical ranks {victims} ({spares} ready spare(s))"
    if cls == "replica_lost":
        return f"{fault} of logical rank(s) {victims} left no data-parallel replica of the state"
    return f"{fault} of logical rank(s) {victims}"


def _unhandled(fault: str, cls: str, victims: list[int], lost_nodes: list[int], spares: int, ft: list[str]) -> str:
    """The reason when the class's row is empty: what happened and which technique would handle it."""
    mix = f"ft=[{','.join(ft)}]"
    snapshots, takeover, rank_alone = _add("restarts_from_snapshots"), _add("covers_ranks"), _add("restarts_rank_alone")
    if cls == "transient":
        retry = " or ".join(f"ft={n}" for n in offering("restarts_rank_alone"))
        return (f"a collective failed and {mix} does not retry transient errors: add {retry} (with "
                f"retry_transient) or {snapshots}")
    if cls == "replica_lost":
        return (f"every data-parallel replica of the model and optimizer state was lost (logical ranks {victims}); "
                f"{rank_alone} rebuilds from a surviving replica, so there is nothing to restore from: add "
                f"{snapshots} for a snapshot to fall back on")
    if fault == "node_loss" and (spare_users := with_(ft, "uses_spares")):
        return (f"node(s) {lost_nodes} lost with logical ranks {victims}, but ft={spare_users[0]} has only {spares} "
                f"ready spare(s) and nothing after it in ft handles node loss: raise parallel.spares or add {takeover} "
                f"(or {snapshots})")
    if fault == "node_loss":
        return (f"node(s) {lost_nodes} lost with logical ranks {victims}; a process restart in place needs the node, "
                f"and no technique in ft handles node loss: add hot spares (parallel.spares with "
                f"{_add('uses_spares')}), a takeover ({takeover}) or flash snapshots ({snapshots})")
    return (f"logical rank(s) {victims} failed ({fault}) and {mix} has no technique for it; add {rank_alone} to "
            "restart the failed rank in place")


def _add(capability: str) -> str:
    """What a message tells a user to add to ``ft`` for ``capability``: every registered technique that has it."""
    return " or ".join(f"ft={name}" for name in offering(capability))
