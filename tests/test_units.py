"""Model, data contract and the fault decision tree, without processes."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from runner.control.decision import decide
from runner.data import IndexedDatasetSource, MemmapTokens, SyntheticTokens
from runner.model import GPT, GPTConfig
from runner.planning.model_cost import count_params, flops_per_token, mfu


def test_param_count_matches_the_module():
    for cfg in (GPTConfig(), GPTConfig(n_layer=3, d_model=96, n_head=4, bias=False, vocab_size=100)):
        assert count_params(cfg) == sum(p.numel() for p in GPT(cfg).parameters())


def test_flops_and_mfu():
    cfg = GPTConfig()
    assert flops_per_token(cfg) > 6 * (count_params(cfg) - cfg.seq_len * cfg.d_model)
    assert mfu(flops_per_token(cfg), items_per_s=1000.0, peak_flops=flops_per_token(cfg) * 2000.0) == 0.5


def test_attention_and_ffn_are_separate_submodules():
    block = GPT(GPTConfig()).blocks[0]
    assert {"attn", "ffn"} <= {n for n, _ in block.named_children()}


def test_batch_is_a_pure_function_of_seed_step_and_rank():
    a, b = SyntheticTokens(1, 256, 16, 4), SyntheticTokens(1, 256, 16, 4)
    assert torch.equal(a.batch(7, 2)["idx"], b.batch(7, 2)["idx"])
    assert not torch.equal(a.batch(7, 2)["idx"], a.batch(7, 3)["idx"])
    assert not torch.equal(a.batch(7, 2)["idx"], a.batch(8, 2)["idx"])
    assert a.batch(7, 2)["sample"].tolist() == [7, 2]
    assert torch.equal(a.batch(7, 2)["targets"][:, :-1], a.batch(7, 2)["idx"][:, 1:])


def test_memmap_source(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    src = MemmapTokens(str(path), seed=0, seq_len=8, micro_batch=2, vocab_size=1000)
    batch = src.batch(3, 1)
    assert batch["idx"].shape == (2, 8)
    assert torch.equal(batch["targets"], batch["idx"] + 1)  # consecutive tokens
    assert torch.equal(batch["idx"], src.batch(3, 1)["idx"])


def test_indexed_dataset_source_partitions_steps_and_ranks():
    src = IndexedDatasetSource(list(range(100)), micro_batch=2, dp_size=3, collate=list)
    assert src.batch(0, 0) == [0, 1] and src.batch(0, 2) == [4, 5] and src.batch(1, 0) == [6, 7]


CFG = OmegaConf.create({"ft": {"flashrecovery": {"max_restarts": 2, "retry_transient": True}}})


def test_decision_tree():
    kw = dict(cfg=CFG, hung=False, lost_nodes=[], lost_ranks=[], survivors=[0, 1, 3], restarts_left=2)
    assert decide(ft=["flashrecovery"], dead=[2], **kw).action == "restart_rank"
    assert decide(ft=["flashrecovery"], dead=[], **kw).action == "retry"
    assert decide(ft=[], dead=[2], **kw).action == "fail"
    assert decide(ft=["flashrecovery"], dead=[2], **{**kw, "hung": True}).fault == "hang"
    assert decide(ft=["flashrecovery"], dead=[0, 1], **{**kw, "survivors": []}).reason.startswith("every data-parallel")
    assert decide(ft=["flashrecovery"], dead=[2, 3, 1], **kw).action == "fail"  # restart budget
    node = decide(ft=["flashrecovery"], dead=[], **{**kw, "lost_nodes": [1], "lost_ranks": [2, 3]})
    assert (node.fault, node.action, node.victims) == ("node_loss", "fail", [2, 3])


def test_a_recovery_is_logged_with_its_rto_phases_and_rpo():
    from runner.control.run_logger import recovery_row

    entry = {"id": 0, "step": 12, "rto_s": 0.2, "detect_s": 0.01, "decide_s": 0.05, "replace_s": 0.06,
             "rebuild_s": 0.03, "restore_s": 0.05, "survivors_ready_s": None, "rpo_steps": 0}
    row = recovery_row(entry)
    assert row["recovery/id"] == 0 and row["recovery/rto_s"] == 0.2 and row["recovery/rpo_steps"] == 0
    assert row["recovery/restore_s"] == 0.05 and "recovery/survivors_ready_s" not in row


def test_rto_phases_add_up_when_the_controller_saw_a_replacement_ready_after_its_group_formed():
    """On a loaded host the controller polls a replacement's readiness after the new group already formed: that
    phase ends where the next begins (rebuild 0), and the phases still add up to the RTO."""
    from runner.control.records import Recovery
    from runner.report.summary import recovery_entry

    rec = Recovery(id=0, t_detect=10.1, t_detect_mono=0.0, fault="crash", victims=[1], action="restart_rank",
                   t_decide=10.2, t_ready=10.9, full_gen=1)
    events = [{"kind": "fault_injected", "t": 10.0, "t_fault": 10.0, "step": 9, "at_step": 9},
              {"kind": "group_formed", "t": 10.6, "gen": 1}, {"kind": "group_formed", "t": 10.7, "gen": 1}]
    metrics = [{"step": s, "t": 1.0 + s, "gen": 0} for s in range(9)] + [{"step": 9, "t": 11.0, "gen": 1}]
    entry = recovery_entry(rec, events, metrics)
    phases = [entry[k] for k in ("detect_s", "decide_s", "replace_s", "rebuild_s", "restore_s")]
    assert phases == pytest.approx([0.1, 0.1, 0.7, 0.0, 0.1]) and entry["rto_s"] == pytest.approx(1.0)
    assert sum(phases) == pytest.approx(entry["rto_s"], abs=1e-9)


def test_decision_tree_with_ndb():
    kw = dict(cfg=CFG, hung=False, lost_ranks=[], survivors=[0, 1, 3], restarts_left=2)
    crash = decide(ft=["ndb"], dead=[2], lost_nodes=[], **kw)
    assert (crash.action, crash.victims) == ("takeover", [2])
    assert decide(ft=["flashrecovery", "ndb"], dead=[2], lost_nodes=[], **kw).action == "restart_rank"
    node = decide(ft=["flashrecovery", "ndb"], dead=[], lost_nodes=[1], **{**kw, "lost_ranks": [2, 3]})
    assert (node.fault, node.action, node.victims) == ("node_loss", "takeover", [2, 3])


def test_decision_tree_with_deadpool():
    cfg = OmegaConf.create({"ft": {"deadpool": {"crash_action": "restart_in_place", "max_restarts": 3}}})
    kw = dict(cfg=cfg, hung=False, survivors=[0, 1], restarts_left=3)
    node = decide(ft=["deadpool"], dead=[], lost_nodes=[1], lost_ranks=[2, 3], spares=2, **kw)
    assert (node.action, node.victims) == ("swap_spare", [2, 3])
    assert decide(ft=["deadpool"], dead=[], lost_nodes=[1], lost_ranks=[2, 3], spares=1, **kw).action == "fail"
    both = decide(ft=["deadpool", "ndb"], dead=[], lost_nodes=[1], lost_ranks=[2, 3], spares=1, **kw)
    assert both.action == "takeover"
    assert decide(ft=["deadpool"], dead=[2], lost_nodes=[], lost_ranks=[], spares=2, **kw).action == "restart_rank"
    assert decide(ft=["deadpool"], dead=[], lost_nodes=[], lost_ranks=[], spares=2, **kw).action == "retry"


def test_gradient_guard_rejects_a_flipped_exponent_and_keeps_its_history_clean():
    from runner.recovery.sdc import GradientGuard

    guard = GradientGuard(factor=100.0, window=10)
    for scale in (1.0, 1.2, 0.9, 1.1, 1.0):
        assert guard.verdict([torch.full((4,), scale)])[0]
    flipped = torch.ones(4)
    flipped[:1].view(torch.int32).bitwise_xor_(1 << 30)
    assert guard.verdict([flipped])[0] is False
    assert guard.verdict([torch.tensor([float("inf")])])[0] is False
    assert guard.verdict([torch.full((4,), 3.0)])[0]  # a real, moderate rise is accepted
    assert len(guard.norms) == 6


def test_decision_tree_falls_back_to_a_restart_from_snapshots():
    cfg = OmegaConf.create({"ft": {"flashrecovery": {"max_restarts": 2, "retry_transient": True},
                                   "flash_ckpt": {"max_restarts": 1}}, "parallel": {"nodes": 2}})
    kw = dict(cfg=cfg, hung=False, lost_nodes=[], lost_ranks=[], survivors=[], restarts_left=2, full_restarts_left=1)
    assert decide(ft=["flash_ckpt"], dead=[0, 1, 2, 3], **kw).action == "restart_all"
    assert decide(ft=["flashrecovery", "flash_ckpt"], dead=[0, 1], **kw).action == "restart_all"  # no replica left
    assert decide(ft=["flashrecovery", "flash_ckpt"], dead=[1], **{**kw, "survivors": [0]}).action == "restart_rank"
    node = decide(ft=["flash_ckpt"], dead=[], **{**kw, "lost_nodes": [1], "lost_ranks": [2, 3]})
    assert (node.fault, node.action, node.victims) == ("node_loss", "restart_all", [2, 3])
    assert decide(ft=["flash_ckpt"], dead=[], **{**kw, "lost_nodes": [0, 1]}).action == "fail"  # no node left
    spent = decide(ft=["flash_ckpt"], dead=[0], **{**kw, "full_restarts_left": 0})
    assert spent.action == "fail" and "ft.flash_ckpt.max_restarts=1" in spent.reason
    assert decide(ft=["flash_ckpt"], dead=[0], **kw, can_restart=False).action == "fail"  # torchrun owns processes


def test_policy_table_defaults_follow_the_seeds_within_ft():
    from runner.config.policy import table

    cfg = OmegaConf.create({"ft": {"flashrecovery": {"retry_transient": True}, "deadpool": {"crash_action": "swap"},
                                   "ndb": {}, "flash_ckpt": {}}})
    full = table(cfg, ["flashrecovery", "deadpool", "ndb", "flash_ckpt"])
    assert full["process_crash"] == ["swap_spare", "restart_rank", "takeover", "restart_all"]  # crash_action=swap
    assert full["node_loss_spare_free"] == ["swap_spare", "takeover", "restart_all"]
    assert full["node_loss_no_spare"] == ["takeover", "restart_all"] and full["replica_lost"] == ["restart_all"]
    assert full["silent_corruption"] == ["recompute"]
    only_fr = table(cfg, ["flashrecovery"])
    assert only_fr["process_crash"] == ["restart_rank"] and only_fr["node_loss_no_spare"] == []
    no_retry = OmegaConf.create({"ft": {"flashrecovery": {"retry_transient": False}}})
    assert table(no_retry, ["flashrecovery"])["transient"] == []


def test_a_policy_row_sets_the_order_and_a_blocked_action_falls_through():
    cfg = OmegaConf.create({"ft": {"flashrecovery": {"max_restarts": 1}, "ndb": {}},
                            "policy": {"process_crash": ["takeover", "restart_rank"]}})
    kw = dict(cfg=cfg, ft=["flashrecovery", "ndb"], hung=False, lost_nodes=[], lost_ranks=[], survivors=[0, 1, 3])
    first = decide(dead=[2], restarts_left=1, **kw)
    assert (first.action, first.fault_class) == ("takeover", "process_crash")
    assert "[policy.process_crash]" in first.reason
    seeds = OmegaConf.create({"ft": {"flashrecovery": {"max_restarts": 1}, "ndb": {}}})
    spent = decide(**{**kw, "cfg": seeds}, dead=[2], restarts_left=0)  # restart budget spent: NDB is next
    assert spent.action == "takeover" and "restart_rank impossible: restart budget spent" in spent.reason


def test_fault_classes():
    from runner.control.decision import classify

    kw = dict(hung=False, lost_ranks=[], survivors=[0, 1])
    assert classify(dead=[], lost_nodes=[], spares=0, **kw)[1] == "transient"
    assert classify(dead=[2], lost_nodes=[], spares=0, **{**kw, "hung": True})[:2] == ("hang", "hang")
    assert classify(dead=[2], lost_nodes=[], spares=0, **{**kw, "survivors": []})[1] == "replica_lost"
    node = dict(dead=[], lost_nodes=[1], **{**kw, "lost_ranks": [2, 3]})
    assert classify(spares=2, **node) == ("node_loss", "node_loss_spare_free", [2, 3])
    assert classify(spares=1, **node)[1] == "node_loss_no_spare"  # one spare cannot take two ranks
    assert classify(spares=2, **{**node, "survivors": []})[1] == "replica_lost"


def test_restart_all_needs_a_node_left_and_a_snapshot_of_every_rank():
    cfg = OmegaConf.create({"ft": {"flash_ckpt": {"max_restarts": 3}}, "parallel": {"nodes": 3}})
    kw = dict(cfg=cfg, ft=["flash_ckpt"], dead=[], hung=False, lost_ranks=[4, 5], survivors=[0, 1],
              restarts_left=0, full_restarts_left=3)
    assert decide(lost_nodes=[2], **kw).action == "restart_all"
    last = decide(lost_nodes=[2], nodes_up=0, **kw)  # the other nodes were lost before
    assert last.action == "fail" and "no node left" in last.reason
    covered = decide(lost_nodes=[2], no_snapshots=[3], **kw)  # NDB computes rank 3: it writes no snapshots
    assert covered.action == "fail" and "no snapshot step is common" in covered.reason


def test_a_committed_step_without_a_record_is_written_by_a_member_that_holds_it(tmp_path):
    from types import SimpleNamespace

    from runner.callbacks.metrics import CommitMetrics
    from runner.plumbing.events import JsonLines
    from runner.plumbing.protocol import Layout

    path = tmp_path / "metrics.jsonl"
    comm = SimpleNamespace(wid=5, gen=1, layout=Layout(gen=1, members=[9, 5], logical=[0, 1], dp=2))
    events = SimpleNamespace(emit=lambda kind, **details: None)
    metrics = CommitMetrics(JsonLines(path), events, comm, tokens_per_sample=1, micro_batch=1)
    extras = torch.tensor([1.0, 1.0, 2.0, 0.0], dtype=torch.float64)

    def steps() -> list[int]:
        return [json.loads(x)["step"] for x in path.read_text().splitlines()]

    metrics.on_commit(7, extras, 0.0)  # the writer, worker 9, commits step 7 too ... and dies before writing it
    assert steps() == []
    comm.gen, comm.layout = 2, Layout(gen=2, members=[11, 5], logical=[0, 1], dp=2, joiners=[11])
    metrics.on_commit(8, extras, 0.0)  # 9's replacement is joining: worker 5 writes, step 7 first
    assert steps() == [7]
    metrics.on_train_end(None, None)  # step 8's record once its step is over (here: the end of training)
    assert steps() == [7, 8]
    comm.gen, comm.layout = 3, Layout(gen=3, members=[11, 5], logical=[0, 1], dp=2)
    metrics.on_commit(9, extras, 0.0)  # 11 writes again, and does
    JsonLines(path).write({"step": 9, "counts": [1, 1]})
    comm.gen = 4
    metrics.on_commit(10, extras, 0.0)  # a new generation, step 9 in the file: nothing more
    comm.gen = 5
    metrics.on_commit(11, extras, 0.0)  # 11 was a laggard at step 10 (adopted it, wrote nothing): 5 writes it
    assert steps() == [7, 8, 9, 10]


def test_a_record_half_written_is_not_read_until_its_line_is_whole(tmp_path):
    """A poll of metrics.jsonl while its writer is in the middle of a record reads the complete records only (a
    netns chaos test read a record cut after its 220th character and failed on it)."""
    from runner.plumbing.events import read_jsonl

    path = tmp_path / "metrics.jsonl"
    whole = json.dumps({"step": 21, "loss": 4.5}) + "\n"
    half = json.dumps({"step": 22, "loss": 4.4, "counts": [1, 1]})
    path.write_text(whole + half[:20])
    assert read_jsonl(path) == [{"step": 21, "loss": 4.5}]
    path.write_text(whole + half + "\n")
    assert [r["step"] for r in read_jsonl(path)] == [21, 22]


def test_runner_deterministic_turns_on_deterministic_kernels_in_a_worker(monkeypatch):
    from runner.training.worker import deterministic_kernels

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")  # unset here, restored afterwards
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        deterministic_kernels()
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_text_written_atomically_replaces_the_old_whole_or_not_at_all(tmp_path, monkeypatch):
    """summary.json's writer: a reader that sees the file sees all of it, and a write that fails leaves the old
    text and no temporary file."""
    from runner.plumbing import durable

    path = tmp_path / "summary.json"
    durable.write_text_atomic(path, json.dumps({"status": "running"}))
    durable.write_text_atomic(path, json.dumps({"status": "completed"}))
    assert json.loads(path.read_text()) == {"status": "completed"}

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(durable.os, "fsync", no_space)
    with pytest.raises(OSError, match="No space"):
        durable.write_text_atomic(path, json.dumps({"status": "failed"}))
    assert json.loads(path.read_text()) == {"status": "completed"}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
