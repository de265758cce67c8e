"""The decision table, without processes: every fault class against every mix of strategies.

Each case builds what the controller would observe for one fault class on 3 nodes of 2 ranks and
checks the action ``decide`` takes: the first one of the seeds' row that the mix provides, the next
one when a budget is spent, and ``fail`` (with a reason) when nothing in the mix can act.
"""

from __future__ import annotations

from itertools import combinations

import pytest
from omegaconf import OmegaConf

from runner.control.decision import decide
from runner.recovery import registry
from runner.recovery.registry import action_class

TECHNIQUES = ("flashrecovery", "deadpool", "ndb", "flash_ckpt")
MIXES = [list(m) for n in range(len(TECHNIQUES) + 1) for m in combinations(TECHNIQUES, n)]
ALL = [0, 1, 2, 3, 4, 5]
# fault class -> what the controller observed (3 nodes x 2 ranks; node 1 holds ranks 2 and 3)
OBSERVED = {
    "transient": dict(dead=[], hung=False, lost_nodes=[], lost_ranks=[], survivors=ALL),
    "process_crash": dict(dead=[2], hung=False, lost_nodes=[], lost_ranks=[], survivors=[0, 1, 3, 4, 5]),
    "hang": dict(dead=[2], hung=True, lost_nodes=[], lost_ranks=[], survivors=[0, 1, 3, 4, 5]),
    "node_loss_spare_free": dict(dead=[], hung=False, lost_nodes=[1], lost_ranks=[2, 3], survivors=[0, 1, 4, 5],
                                 spares=2),
    "node_loss_no_spare": dict(dead=[], hung=False, lost_nodes=[1], lost_ranks=[2, 3], survivors=[0, 1, 4, 5]),
    "replica_lost": dict(dead=ALL, hung=False, lost_nodes=[], lost_ranks=[], survivors=[]),
}
# fault class -> (action, the strategies that provide it), in the seeds' order
SEEDS = {
    "transient": [("retry", {"flashrecovery", "deadpool"}), ("restart_all", {"flash_ckpt"})],
    "process_crash": [("restart_rank", {"flashrecovery", "deadpool"}), ("takeover", {"ndb"}),
                      ("restart_all", {"flash_ckpt"})],
    "hang": [("restart_rank", {"flashrecovery", "deadpool"}), ("takeover", {"ndb"}), ("restart_all", {"flash_ckpt"})],
    "node_loss_spare_free": [("swap_spare", {"deadpool"}), ("takeover", {"ndb"}), ("restart_all", {"flash_ckpt"})],
    "node_loss_no_spare": [("takeover", {"ndb"}), ("restart_all", {"flash_ckpt"})],
    "replica_lost": [("restart_all", {"flash_ckpt"})],
}
BUDGETED = {"restart_rank", "restart_all"}  # the actions a spent budget blocks


def _cfg():
    return OmegaConf.create({
        "parallel": {"nodes": 3, "procs_per_node": 2, "zero": 0},
        "ft": {"flashrecovery": {"max_restarts": 3, "retry_transient": True},
               "deadpool": {"max_restarts": 3, "crash_action": "restart"},
               "ndb": {}, "flash_ckpt": {"max_restarts": 3}},
    })


def _expected(ft: list[str], cls: str, spent: bool) -> str:
    for action, providers in SEEDS[cls]:
        if providers & set(ft) and not (spent and action in BUDGETED):
            return action
    return "fail"


@pytest.mark.parametrize("spent", [False, True], ids=["budgets_left", "budgets_spent"])
@pytest.mark.parametrize("cls", list(OBSERVED))
@pytest.mark.parametrize("ft", MIXES, ids=lambda ft: "+".join(ft) or "none")
def test_every_fault_class_against_every_mix(ft, cls, spent):
    left = 0 if spent else 3
    decision = decide(ft=ft, cfg=_cfg(), restarts_left=left, full_restarts_left=left, **OBSERVED[cls])
    assert decision.fault_class == cls
    assert decision.action == _expected(ft, cls, spent), decision.reason
    if decision.action == "fail":
        assert decision.reason
    else:
        assert f"[policy.{cls}]" in decision.reason and action_class(decision.action).does in decision.reason
        if spent and any(a in BUDGETED and p & set(ft) for a, p in SEEDS[cls][:1]):
            assert "impossible: restart budget spent" in decision.reason  # the blocked one says why


@pytest.mark.parametrize("ft", [m for m in MIXES if m])
def test_the_registry_brings_every_action_the_policy_offers_a_mix(ft):
    from runner.config.policy import table

    provided = {cls.name for t in ft for cls in registry.TECHNIQUES[t].actions}
    offered = {a for row in table(_cfg(), ft).values() for a in row if a not in ("recompute", "report")}  # no strategy
    assert offered <= provided


def test_a_launcher_that_owns_the_processes_blocks_restarts():
    ft = ["flashrecovery", "flash_ckpt"]
    decision = decide(ft=ft, cfg=_cfg(), can_restart=False, restarts_left=3, full_restarts_left=3,
                      **OBSERVED["process_crash"])
    assert decision.action == "fail" and decision.reason.count("the launcher owns the processes") == 2
