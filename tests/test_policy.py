"""The policy table in config: rows are checked, and a mix that cannot handle a configured fault is refused."""

from __future__ import annotations

import pytest

from runner.config import ConfigError
from runner.config.validate import validate
from tests.test_config import _compose

MIX = ["parallel.nodes=3", "parallel.procs_per_node=2", "parallel.spares=2", "trainer.global_batch_size=12"]
TWO_NODE_LOSSES = ["fault=kill_node", "fault.node=1", "fault.step=5",
                   "+fault.extra=[{kind: kill_node, node: 2, step: 9}]"]


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate(_compose("+recipe=gpt_tiny", *overrides))
    assert "\n" not in str(err.value)  # one paragraph
    return str(err.value)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["+policy.crash=[restart_rank]"], "policy.crash is not a fault class"),
        (["ft=flashrecovery", "policy.process_crash=[reboot]"], "reboot, which is not an action"),
        (["ft=[flashrecovery,ndb]", "policy.node_loss_no_spare=[restart_rank]"], "cannot handle node_loss_no_spare"),
        (["ft=flashrecovery", "policy.process_crash=[takeover]"], "takeover, which needs ft=ndb"),
        (["ft=flashrecovery", "ft.flashrecovery.retry_transient=false", "policy.transient=[retry]"], "retry_transient"),
        (["trainer.sdc_factor=0", "policy.silent_corruption=[recompute]"], "needs the corruption guard"),
        (["ft=flashrecovery", "policy.hang=[restart_rank,restart_rank]"], "lists an action twice"),
    ],
)
def test_policy_rows_are_checked(overrides, expected):
    assert expected in _problems(*overrides)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["ft=deadpool", "parallel.spares=0"], "parallel.spares=0 and nothing after it"),
        (["ft=flashrecovery", "parallel.nodes=2", "fault=kill_node"], "fault (kill_node of node 1 at step 20)"),
        (["ft=flashrecovery", "fault=kill_all"], "add ft=flash_ckpt"),
        (["ft=flashrecovery", "fault=kill_rank", "fault.rank=0", "fault.step=5",
          "+fault.extra=[{kind: kill_rank, rank: 1, step: 5}]"], "every data-parallel replica"),  # same step: together
        ([*MIX, "ft=[flashrecovery,deadpool]", *TWO_NODE_LOSSES], "fault.extra[0] (kill_node of node 2 at step 9)"),
        (["ft=flashrecovery", "ft.flashrecovery.max_restarts=1", "fault=kill_rank", "fault.step=5",
          "+fault.extra=[{kind: hang_rank, rank: 0, step: 8}]"], "restart budget spent"),
        (["fault=bitflip", "trainer.sdc_factor=0"], "corruption guard off"),
        (["ft=[ndb,flash_ckpt]", "parallel.nodes=2", "fault=kill_node", "fault.node=1", "fault.step=5",
          "+fault.extra=[{kind: kill_all, rank: 0, step: 9}]"], "no snapshot step is common"),  # NDB covers 2, 3
        (["ft=flashrecovery", "fault=chaos", "fault.kinds=[kill_node]"], "fault.kinds has kill_node"),
        (["ft=flashrecovery", "fault=chaos", "fault.kinds=[slow_rank]"], "chaos draws from"),
    ],
)
def test_a_mix_that_cannot_handle_a_configured_fault_is_refused(overrides, expected):
    problems = _problems(*overrides)
    assert expected in problems
    if "at step" in expected:
        assert "policy.reject_unhandled=false" in problems  # how to inject a fixed fault anyway


@pytest.mark.parametrize(
    "overrides",
    [
        [*MIX, "ft=[flashrecovery,deadpool,ndb]", *TWO_NODE_LOSSES],  # spares for the first, NDB for the second
        ["ft=[deadpool,flash_ckpt]"],  # no spares, but snapshots handle a lost node
        ["fault=kill_rank"],  # ft=[] is a baseline: a fault ends it by design
        ["ft=flashrecovery", "fault=kill_all", "policy.reject_unhandled=false"],
        ["ft=[flashrecovery,ndb]", "policy.process_crash=[takeover,restart_rank]", "fault=kill_rank"],
    ],
)
def test_mixes_that_handle_their_faults_pass(overrides):
    validate(_compose("+recipe=gpt_tiny", *overrides))
