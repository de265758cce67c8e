"""The simulator decides as the runner does: sim.json's decisions are runner.control.decision's, budgets included."""
from itertools import combinations, permutations

import pytest
from omegaconf import OmegaConf

from runner.control.decision import decide
from runner.recovery.registry import TECHNIQUES
from runner.sim import report
from runner.sim.failures import FaultClass
from runner.sim.pricing import RESTART
from runner.sim.sweep import policy_for, simulate
from tests.test_sim import load_cfg

F = FaultClass
G = 8  # GPUs (ranks) per node
ALL_SUBSETS = [list(c) for k in range(len(TECHNIQUES) + 1) for c in combinations(TECHNIQUES, k)]
ORDERS = [list(p) for p in permutations(["flashrecovery", "deadpool", "ndb"])]


def runner_cfg(crash_action="restart_in_place", retry_transient=True, sdc_factor=100.0, policy=None):
    """The runner config decide() reads, written out by hand as tests/test_units.py does."""
    return OmegaConf.create({
        "ft": {"flashrecovery": {"max_restarts": 10, "retry_transient": retry_transient},
               "deadpool": {"crash_action": crash_action, "max_restarts": 10},
               "flash_ckpt": {"max_restarts": 5}},
        "parallel": {"nodes": 128, "zero": 0}, "policy": policy or {}, "trainer": {"sdc_factor": sdc_factor},
    })


def expected(ft, cfg, can_restart=True) -> dict[str, str]:
    """What the runner decides for each policy class: a rank of node 1 crashes or hangs, or node 1 is lost."""
    kw = dict(ft=ft, cfg=cfg, can_restart=can_restart, restarts_left=10,
              full_restarts_left=5 if "flash_ckpt" in ft else 0)
    crash = dict(dead=[G], lost_nodes=[], lost_ranks=[], spares=32, nodes_up=128)
    node = dict(dead=[], hung=False, lost_nodes=[1], lost_ranks=list(range(G, 2 * G)), survivors=[0], nodes_up=127)
    row = [a for a in ("recompute",) if cfg.trainer.sdc_factor > 0]
    return {
        "transient": decide(**kw, dead=[], hung=False, lost_nodes=[], lost_ranks=[], survivors=[0], spares=32).action,
        "process_crash": decide(**kw, **crash, hung=False, survivors=[0]).action,
        "hang": decide(**kw, **crash, hung=True, survivors=[0]).action,
        "node_loss_spare_free": decide(**kw, **node, spares=32).action,
        "node_loss_no_spare": decide(**kw, **node, spares=0).action,
        "replica_lost": decide(**kw, **crash, hung=False, survivors=[]).action,
        "silent_corruption": row[0] if row else "fail",
    }


def sim_decisions(mixes, *overrides):
    cfg = load_cfg("cluster.gpus=1024", "job.days=1", "runs=1", f"mixes={mixes}".replace("'", ""), *overrides)
    summary = report.summarize(simulate(cfg, {}), cfg)
    return {label: {cls: d["action"] for cls, d in row.items()} for label, row in summary["decisions"].items()}


def label(ft):
    return ",".join(ft) if ft else "restart (ft=[])"


@pytest.mark.parametrize("variant, overrides, runner", [
    ("defaults", [], dict()),
    ("crash_action=swap", ["decision.deadpool.crash_action=swap"], dict(crash_action="swap")),
    ("no transient retry", ["decision.flashrecovery.retry_transient=false"], dict(retry_transient=False)),
    ("guard off", ["decision.sdc_guard=false"], dict(sdc_factor=0.0)),
    ("own policy row", ["+decision.policy.process_crash=[restart_all]"],
     dict(policy={"process_crash": ["restart_all"]})),
])
def test_sim_json_decisions_are_the_runners_for_every_mix(variant, overrides, runner):
    mixes = ALL_SUBSETS + ORDERS
    if "policy" in runner:  # a row the user sets must be carried out by the mix; ft=[] takes no rows
        mixes = [m for m in mixes if "flash_ckpt" in m]
    got = sim_decisions(mixes, *overrides)
    for ft in mixes:
        assert got[label(ft)] == expected(ft, runner_cfg(**runner)), (variant, ft)


def test_launcher_owned_processes_leave_only_the_requeue():
    got = sim_decisions([["flashrecovery", "deadpool", "ndb", "flash_ckpt"]], "decision.launcher=torchrun")
    assert got["flashrecovery,deadpool,ndb,flash_ckpt"] == expected(
        ["flashrecovery", "deadpool", "ndb", "flash_ckpt"], runner_cfg(), can_restart=False)
    assert got["flashrecovery,deadpool,ndb,flash_ckpt"]["process_crash"] == "takeover"  # NDB restarts nobody


def test_node_loss_is_not_flashrecoverys():
    got = sim_decisions([["flashrecovery"]])["flashrecovery"]
    assert got["process_crash"] == "restart_rank" and got["node_loss_spare_free"] == "fail"


def test_ndb_takeover_blocks_restart_all():
    cfg = load_cfg("cluster.gpus=1024")
    policy = policy_for(cfg, 1024, ["ndb", "flash_ckpt"])
    fresh = dict(restarts_left=0, spare_ranks=0, full_restarts_left=5)
    assert policy.decide(F.transient, takeovers=False, **fresh).action == "restart_all"
    blocked = policy.decide(F.transient, takeovers=True, **fresh)
    assert blocked.action == "fail" and "no snapshot step is common" in blocked.reason


def runs(*overrides, mix):
    """The events of each simulated history."""
    cfg = load_cfg("cluster.gpus=16384", "job.days=20", "runs=2", f"mixes=[{mix}]", *overrides)
    point = next(iter(simulate(cfg, {}).points.values()))
    return [r.events for r in point.runs]


def events(*overrides, mix):
    return [e for run in runs(*overrides, mix=mix) for e in run]


def test_restart_budget_spent_means_the_job_is_requeued():
    spent = events("decision.flashrecovery.max_restarts=0", mix="[flashrecovery]")
    crashes = [e for e in spent if e.fault == "process_crash"]
    assert crashes and all(e.technique == RESTART for e in crashes)
    plenty = events("decision.flashrecovery.max_restarts=100000", mix="[flashrecovery]")
    assert all(e.action == "restart_rank" for e in plenty if e.fault == "process_crash")
    for run in runs("decision.flashrecovery.max_restarts=1", mix="[flashrecovery]"):  # then it fails, is requeued
        ranks = [e.action for e in run if e.action in ("restart_rank", "fail")]
        assert "restart_rank" in ranks and "fail" in ranks
        assert "restart_rank,restart_rank" not in ",".join(ranks)  # one restart per run of the job


def test_flash_ckpt_budget_runs_out_and_requeue_refills_it():
    for run in runs("decision.flash_ckpt.max_restarts=2", mix="[flash_ckpt]"):
        assert {e.action for e in run if e.fault == "node_loss"} == {"restart_all", "fail"}
        between = 0  # never more than 2 restart_all between two requeues
        for e in run:
            if e.action == "restart_all":
                between += 1
                assert between <= 2
            elif e.action == "fail":
                between = 0
