"""The full strategy mix on real processes: one run survives a fault of every class in turn."""

from __future__ import annotations

from tests.conftest import run_cli

MIX = ["+recipe=gpt_tiny", "parallel.nodes=3", "parallel.procs_per_node=2", "parallel.spares=2",
       "ft=[flashrecovery,deadpool,ndb,flash_ckpt]", "trainer.global_batch_size=12", "trainer.max_steps=40"]


def test_full_mix_survives_transient_crash_node_loss_and_node_loss_without_spares(run_dir):
    run = run_cli(*MIX, "fault=transient", "fault.rank=1", "fault.step=5",
                  "+fault.extra=[{kind: kill_rank, rank: 2, step: 10}, {kind: kill_node, node: 1, step: 17},"
                  " {kind: kill_node, node: 2, step: 25}]", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    assert s["samples_committed"] == 40 * 12 and s["global_step"] == 40
    assert s["param_checksum"]  # every replica ends with the same parameters
    assert [(r["fault"], r["action"], r["victims"], r["step"]) for r in s["recoveries"]] == [
        ("transient", "retry", [], 5),
        ("process_crash", "restart_rank", [2], 10),
        ("node_loss", "swap_spare", [2, 3], 17),  # node 1 held rank 2's replacement: both go to the spares
        ("node_loss", "takeover", [4, 5], 25),  # no spare left: NDB
    ]
    assert all(r["rpo_steps"] == 0 for r in s["recoveries"])
    decided = run.events("recovery_decided")
    assert [d["fault_class"] for d in decided] == ["transient", "process_crash", "node_loss_spare_free",
                                                   "node_loss_no_spare"]
    assert all(f"[policy.{d['fault_class']}]" in d["reason"] for d in decided)  # each decision says why
    assert not run.events("recovery_not_needed")  # an old lost node's silence is no new node loss
    assert sorted(e["logical"] for e in run.events("spare_assigned")) == [2, 3]
    assert sorted(e["logical"] for e in run.events("takeover_assigned")) == [4, 5]
    assert all(e["reason"] for e in run.events("takeover_assigned"))
    assert len(run.events("worker_started")) == 6 + 2 + 1  # ranks, spares, one replacement
    assert run.events("run_start")[0]["policy"]["node_loss_no_spare"] == ["takeover", "restart_all"]
