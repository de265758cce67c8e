"""A fifth technique is its package and one registry line: a toy technique registered here, and no other file
changed, has its options checked against its schema and its own checks, its action offered by the policy and
chosen by the decision, built by the controller's registry, and its capabilities read by the Topology and the plan."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf, open_dict

from runner.config import ConfigError, policy
from runner.config.validate import validate
from runner.control.decision import decide
from runner.planning.topology import Topology, spare_count
from runner.recovery.actions import RecoveryAction
from runner.recovery.registry import TECHNIQUES, build_actions, registered
from runner.recovery.technique import Technique
from tests.test_config import _compose


@dataclass
class ToyOptions:
    """The toy's ``ft.toy.*`` options."""

    patience: int = 3
    """Steps it waits for a lost host (>= 1)."""


class Wait(RecoveryAction):
    """Wait for a lost host to come back (a toy: nothing is done)."""

    name = "wait_for_host"
    does = "wait for the lost host to come back"
    handles = ("node_loss_no_spare",)


def toy_problems(cfg, for_training: bool) -> list[str]:
    """The toy's own check, as a technique's ``checks.py`` holds it."""
    patience = cfg.ft.toy.patience
    return [] if patience >= 1 else [f"ft.toy.patience={patience} must be >= 1."]


TOY = Technique(name="toy", title="Toy", options=ToyOptions, actions=(Wait,),
                worker="runner.recovery.flashrecovery.worker:FlashRecoveryWorker", uses_spares=True,
                checks=f"{__name__}:toy_problems")
NODE_LOSS = dict(dead=[], hung=False, lost_nodes=[1], lost_ranks=[2, 3], survivors=[0, 1])


def _with_toy(**options):
    cfg = _compose("+recipe=gpt_tiny", "parallel.nodes=2", "parallel.procs_per_node=2", "ft=flashrecovery",
                   "policy.node_loss_no_spare=[wait_for_host]")
    with open_dict(cfg):
        cfg.ft.toy = OmegaConf.create(options)
    return cfg


def test_a_registered_technique_is_validated_offered_decided_and_built(tmp_path):
    with registered(TOY):
        cfg = _with_toy(patience=5)
        validate(cfg)  # its options against its schema, its own checks, the policy row naming its action
        ft = list(cfg.ft)
        assert policy.table(cfg, ft)["node_loss_no_spare"] == ["wait_for_host"]
        decision = decide(ft=ft, cfg=cfg, restarts_left=1, **NODE_LOSS)
        assert decision.action == "wait_for_host" and Wait.does in decision.reason
        assert set(build_actions(ft, cfg, Topology.from_cfg(cfg), tmp_path)) == {"retry", "restart_rank",
                                                                                  "wait_for_host"}
        assert spare_count(cfg) == 2  # it uses spares: one spare node by default, as for DeadPool
    assert "toy" not in TECHNIQUES


@pytest.mark.parametrize(("options", "expected"), [
    ({"patience": 0}, "ft.toy.patience=0 must be >= 1"),  # its own check
    ({"patients": 3}, "ft.toy.patients"),  # a key its schema lacks
])
def test_a_registered_techniques_options_are_checked(options, expected):
    with registered(TOY):
        with pytest.raises(ConfigError, match=expected):
            validate(_with_toy(**options))


def test_an_unregistered_technique_is_refused():
    with pytest.raises(ConfigError, match=r"ft.toy is not a config key.*ft takes flashrecovery, deadpool, ndb"):
        validate(_with_toy(patience=5))
