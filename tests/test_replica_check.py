"""The replica check: the fingerprint and its slots, and real runs whose replicas a flipped parameter bit drives
apart (restored from the majority, failed with the reason, or, with the check off, caught only at the end)."""

from __future__ import annotations

import pytest
import torch

from runner.training import replica_check
from tests.conftest import ONE_BY_TWO, TWO_BY_TWO, run_cli


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(17, 5, generator=g), torch.randn(3, generator=g), torch.randn(8, generator=g).bfloat16()]


def test_any_single_flipped_bit_changes_the_fingerprint() -> None:
    params = _params()
    fp = replica_check.fingerprint(params)
    assert fp == replica_check.fingerprint([p.clone() for p in params])
    assert 0 <= fp < 2**32
    for t in range(len(params)):
        for bit in (0, 7, 13):  # the lowest mantissa bit, others, in float32 and bfloat16 elements
            flipped = [p.clone() for p in params]
            flipped[t].view(-1)[1:2].view(torch.uint8)[bit // 8 : bit // 8 + 1].bitwise_xor_(1 << (bit % 8))
            assert replica_check.fingerprint(flipped) != fp, (t, bit)
    assert replica_check.fingerprint(params[::-1]) != fp  # the order of the tensors counts


def test_slots_summed_in_float32_give_every_members_fingerprint_exactly() -> None:
    """The slots ride in a float32 bucket: each has one contributor, so the group's sum is exact."""
    fps = {0: 0xFFFFFFFF, 1: 0, 3: 0x0001FFFF}  # member 2 absent (a replica NDB took over has no member)
    summed = sum((replica_check.encode(fp, r, 4).float() for r, fp in fps.items()), torch.zeros(8))
    assert replica_check.decode(summed.double()) == fps


def test_verdict_names_the_majority_and_who_disagrees() -> None:
    agree = replica_check.verdict({0: 5, 1: 5, 2: 5})
    assert not agree.diverged
    one_off = replica_check.verdict({0: 5, 1: 9, 2: 5, 3: 5})
    assert (one_off.diverged, one_off.majority, one_off.disagreeing, one_off.source) == (True, 5, [1], 0)
    two = replica_check.verdict({0: 5, 1: 9})
    assert (two.majority, two.disagreeing, two.source) == (None, [0, 1], None)  # two replicas: no majority
    halves = replica_check.verdict({0: 5, 1: 9, 2: 9, 3: 5})
    assert halves.majority is None


def test_due_every_n_steps_and_never_when_off() -> None:
    assert [s for s in range(25) if replica_check.due(s, 10)] == [0, 10, 20]
    assert not any(replica_check.due(s, 0) for s in range(25))


@pytest.fixture(scope="module")
def fault_free(two_by_two):
    """The fault-free run of 4 replicas (tests/conftest.py), with the default check every 10 steps."""
    assert two_by_two.summary["status"] == "completed", two_by_two.output[-3000:]
    return two_by_two.summary


def test_a_flipped_parameter_is_restored_from_the_majority_before_it_reaches_an_update(fault_free, run_dir):
    """Replica 1's parameter bit flips after step 9's update; step 10's check finds it, replica 0 hands its state to
    it, and step 10 is recomputed: no gradient of the diverged replica entered an update, so the run ends with the
    fault-free parameters."""
    run = run_cli(*TWO_BY_TWO, "fault=param_bitflip", "fault.rank=1", "fault.step=9",
                  "trainer.replica_check_every_n_steps=10", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    [event] = run.events("replica_diverged")
    assert (event["step"], event["ranks"], event["action"], event["source"]) == (10, [1], "restore_from_majority", 0)
    assert len(set(event["checksums"].values())) == 2
    assert s["replica_divergences"] == [{"step": 10, "ranks": [1], "action": "restore_from_majority"}]
    assert s["param_checksum"] == fault_free["param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"]) == (0, 0)
    assert s["steps_redone"] == 0  # the recomputation happens inside step 10's commit, which is committed once


def test_two_diverged_replicas_fail_the_run_within_n_steps_with_the_reason(run_dir):
    run = run_cli(*ONE_BY_TWO, "fault=param_bitflip", "fault.rank=1", "fault.step=3",
                  "trainer.replica_check_every_n_steps=5", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "failed", run.output[-4000:]
    assert "replicas diverged: at step 5" in s["error"] and "no majority" in s["error"]
    [event] = run.events("replica_diverged")
    assert (event["step"], event["ranks"], event["action"]) == (5, [0, 1], "fail")
    assert event["step"] - 3 <= 5
    assert [e["status"] for e in run.events("run_end")] == ["failed"]


@pytest.mark.slow
def test_with_the_check_off_the_divergence_is_caught_only_at_the_end(run_dir):
    run = run_cli(*ONE_BY_TWO, "fault=param_bitflip", "fault.rank=1", "fault.step=3",
                  "trainer.replica_check_every_n_steps=0", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "failed", run.output[-4000:]
    assert "replicas ended with different parameters" in s["error"]
    assert run.events("replica_diverged") == [] and s["global_step"] == 30


def test_with_tensor_parallelism_the_slice_that_diverged_fails_the_run(run_dir):
    """tp=2, 2 replicas: only the victim's slice (tp 1) differs, its DP group compares it (no collective of its own)
    and, with no majority, fails the run; the other slice's group saw its replicas agree."""
    run = run_cli("+recipe=gpt_tiny", "trainer.max_steps=12", "parallel.procs_per_node=4", "parallel.tp=2",
                  "fault=param_bitflip", "fault.rank=1", "fault.step=3", "trainer.replica_check_every_n_steps=5",
                  run_dir=run_dir)
    s = run.summary
    assert s["status"] == "failed" and "replicas diverged: at step 5" in s["error"], run.output[-4000:]
    [event] = run.events("replica_diverged")
    assert (event["step"], event["slice"], event["ranks"], event["action"]) == (5, [0, 1], [1, 3], "fail")
