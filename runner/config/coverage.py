"""Config-time check that the fault-tolerance mix can handle the faults the run is configured to face.

"Configured to face" means the faults in ``fault`` and ``fault.extra``, and with ``fault=chaos``
every kind in ``fault.kinds``. They are replayed, in trigger order, through the same decision
function the controller uses, on a static model of the job: ranks on their initial nodes, spares
and restart budgets used up as the actions before would use them. Faults at the same step hit
together. A fault whose decision would be ``fail`` makes the config invalid. ``ft=[]`` is a
baseline without fault tolerance and faces nothing (a fault ends it by design), except silent
corruption, which the gradient guard handles without a technique. ``policy.reject_unhandled=false``
turns the fault check off, to watch a mix fail at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from runner.config import policy
from runner.control.decision import Decision, decide
from runner.planning.topology import spare_count
from runner.recovery.registry import offering, restart_owner, with_

STOP_EVERY_RANK = ("kill_all", "wipe_shm", "corrupt_snapshot")


@dataclass
class _Job:
    """What the replay tracks between faults."""

    spares: int
    restarts: int
    full_restarts: int
    lost_nodes: set = field(default_factory=set)
    taken_over: set = field(default_factory=set)  # ranks NDB neighbours compute


def mix_problems(cfg: DictConfig, ft: list[str], faults: list[DictConfig], dp: int) -> list[str]:
    """The user's policy rows, a DeadPool without spares, and every configured fault the mix cannot handle;
    ``faults`` is the main fault, then ``fault.extra``."""
    out = policy.row_problems(cfg, ft)
    if out:
        return out  # the replay would only repeat the rows' problems
    spare_users = with_(ft, "uses_spares")
    if spare_users and not spare_count(cfg) and not policy.table(cfg, ft)["node_loss_no_spare"]:
        others = " or ".join(f"ft={n}" for n in (*offering("covers_ranks"), *offering("restarts_from_snapshots")))
        out.append(f"ft={spare_users[0]} swaps failed ranks for hot spares, but parallel.spares=0 and nothing after it "
                   f"in ft handles a lost node: set parallel.spares >= 1 (or add {others}).")
    if cfg.policy.reject_unhandled:
        out += _unhandled_faults(cfg, ft, faults, dp)
    return out


def _unhandled_faults(cfg: DictConfig, ft: list[str], faults: list[DictConfig], dp: int) -> list[str]:
    out = []
    labelled = [("fault" if i == 0 else f"fault.extra[{i - 1}]", f) for i, f in enumerate(faults) if f.kind != "none"]
    if not policy.table(cfg, ft)["silent_corruption"]:
        out += [f"{where}: a bitflip with the corruption guard off (trainer.sdc_factor=0) would silently enter the "
                "model; set trainer.sdc_factor > 0 (default 100)." for where, f in labelled if f.kind == "bitflip"]
        if faults[0].kind == "chaos" and "bitflip" in faults[0].kinds:
            out.append("fault.kinds has bitflip but the corruption guard is off (trainer.sdc_factor=0): set "
                       "trainer.sdc_factor > 0 or take bitflip out of fault.kinds.")
    if not ft:
        return out
    job = _fresh(cfg, ft)
    for group in _in_trigger_order([(w, f) for w, f in labelled if f.kind != "chaos"]):
        for decision in _replay(cfg, ft, dp, job, [f for _, f in group]):
            if decision.action == "fail":
                where = " and ".join(f"{w} ({_describe(f)})" for w, f in group)
                out.append(f"{where} would end the run: {decision.reason.rstrip('.')}. Change ft, parallel.spares or "
                           "policy, or set policy.reject_unhandled=false to inject it anyway and watch the run fail.")
                break
    if faults[0].kind == "chaos":
        for kind in faults[0].kinds:
            probe = OmegaConf.create({"kind": kind, "rank": dp - 1, "node": cfg.parallel.nodes - 1, "step": 0,
                                      "during": "step"})
            failed = [d for d in _replay(cfg, ft, dp, _fresh(cfg, ft), [probe]) if d.action == "fail"]
            if failed:
                out.append(f"fault.kinds has {kind}, which this mix cannot handle even once: {failed[0].reason}. "
                           f"Take {kind} out of fault.kinds or change ft, parallel.spares or policy.")
    return out


def _fresh(cfg: DictConfig, ft: list[str]) -> _Job:
    owner, snapshots = restart_owner(ft), with_(ft, "restarts_from_snapshots")
    return _Job(spares=spare_count(cfg), restarts=cfg.ft[owner].max_restarts if owner else 0,
                full_restarts=cfg.ft[snapshots[0]].max_restarts if snapshots else 0)


def _in_trigger_order(labelled: list[tuple[str, DictConfig]]) -> list[list[tuple[str, DictConfig]]]:
    """Faults at the same step form one group; then faults timed in seconds; then those during a recovery."""
    by_step: dict[int, list] = {}
    later, during_recovery = [], []
    for where, f in labelled:
        if f.during == "recovery":
            during_recovery.append([(where, f)])
        elif f.step >= 0:
            by_step.setdefault(f.step, []).append((where, f))
        else:
            later.append((f.after_s, [(where, f)]))
    return [by_step[s] for s in sorted(by_step)] + [g for _, g in sorted(later, key=lambda x: x[0])] + during_recovery


def _replay(cfg: DictConfig, ft: list[str], dp: int, job: _Job, group: list[DictConfig]) -> list[Decision]:
    """The decisions the controller would take for faults that hit together, applied to ``job``."""
    ppn, nodes = cfg.parallel.procs_per_node, cfg.parallel.nodes
    dead: set[int] = set()
    lost: set[int] = set()
    hung = transient = False
    for f in group:
        if f.kind in ("kill_rank", "hang_rank", "partition"):  # a partition: retried, then its rank isolated
            dead.add(f.rank)
            hung = hung or f.kind == "hang_rank"
            transient = transient or f.kind == "partition"
        elif f.kind == "kill_node" and f.node not in job.lost_nodes:
            lost.add(f.node)
        elif f.kind in STOP_EVERY_RANK:
            dead |= set(range(dp))
        elif f.kind == "transient":
            transient = True
    steps: list[tuple[set[int], set[int]]] = [(set(), set())] if transient else []
    steps += [(dead, lost)] if dead or lost else []
    decisions = []
    for dead_now, lost_now in steps:
        lost_ranks = [r for n in sorted(lost_now) for r in range(n * ppn, (n + 1) * ppn)]
        survivors = [r for r in range(dp) if r not in dead_now and r not in lost_ranks]
        d = decide(ft=ft, cfg=cfg, can_restart=cfg.launcher.kind in ("auto", "local"), dead=sorted(dead_now),
                   hung=hung, lost_nodes=sorted(lost_now), lost_ranks=lost_ranks, survivors=survivors,
                   restarts_left=job.restarts, spares=job.spares, full_restarts_left=job.full_restarts,
                   nodes_up=nodes - len(job.lost_nodes | lost_now), no_snapshots=sorted(job.taken_over))
        decisions.append(d)
        job.lost_nodes |= lost_now
        job.taken_over -= set(d.victims)
        if d.action == "swap_spare":
            job.spares -= len(d.victims)
        elif d.action == "restart_rank":
            job.restarts -= len(d.victims)
        elif d.action == "takeover":
            job.taken_over |= set(d.victims)
        elif d.action == "restart_all":
            job.full_restarts -= 1
            job.taken_over.clear()
        elif d.action == "fail":
            break
    return decisions


def _describe(f: DictConfig) -> str:
    where = f"node {f.node}" if f.kind == "kill_node" else f"rank {f.rank}"
    when = ("during a recovery" if f.during == "recovery" else f"at step {f.step}" if f.step >= 0
            else f"after {f.after_s:g}s")
    return f"{f.kind} of {where} {when}"
