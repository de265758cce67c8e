"""Pipeline-parallel training on real processes: PP=2 inside each node, DP=2 across nodes (and TP=2 x PP=2 on
2 nodes x 4 ranks, in the slow tier, with the same recoveries).

The fault-free pp=2 run is the reference for the loss curve (against pure DP with the same global batch), for
its checkpoint file (the full model, loadable at any layout) and for the exactness of FlashRecovery and
flash_ckpt at pp=2 (their recovered runs must end with the same checksum). The runs keep the learning rate
constant after warm-up (``trainer.min_lr`` = ``trainer.lr``), so a run resumed from the 10-step file continues
the same schedule, and clip every step's gradient, so the curves also compare the full model's gradient norm.
"""

from __future__ import annotations

import pytest
import torch

from runner.config import ConfigError
from runner.config.validate import trained_pp, validate
from runner.lightning_module import GPTModule
from runner.planning.plan import apply_smoke
from runner.training.checksum import param_checksum
from tests.conftest import CLIPPED_TINY, TP2PP2, TP2PP2_STEPS, Run, run_cli
from tests.test_config import _compose

MAX_STEPS = TP2PP2_STEPS  # every layout's runs, as long as the shared tp2pp2 reference (tests/conftest.py)
PP2 = [*CLIPPED_TINY, "parallel.procs_per_node=2", "parallel.pp=2"]
DP2 = [*CLIPPED_TINY, "parallel.procs_per_node=1"]  # the same DP size and global batch, one rank per replica
# a kill at a snapshot step (every 5) races the snapshot copy it starts, at step 8 step 5's is committed everywhere
KILL_ALL_STEP = 8
VALIDATED = ["trainer.val_check_interval=3", "trainer.limit_val_batches=4"]  # two batches per replica at 3, 6, 9


@pytest.fixture(scope="module")
def pp2(tmp_path_factory) -> Run:
    run = run_cli(*PP2, f"trainer.max_steps={MAX_STEPS}", "checkpoint.every_n_steps=5",
                  run_dir=tmp_path_factory.mktemp("pp2") / "run")
    assert run.summary["status"] == "completed", run.output[-4000:]
    return run


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> Run:
    run = run_cli(*DP2, f"trainer.max_steps={MAX_STEPS}", run_dir=tmp_path_factory.mktemp("dp2") / "run")
    assert run.summary["status"] == "completed", run.output[-4000:]
    return run


def _same_loss_curve(run: Run, reference: Run, what: str) -> None:
    ours, theirs = [m["loss"] for m in run.metrics()], [m["loss"] for m in reference.metrics()]
    assert len(ours) == len(theirs) == run.summary["global_step"]
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert a == pytest.approx(b, rel=0.01), f"step {step}: {what} loss {a} vs tp=1 pp=1 loss {b}"


def _val_losses(run: Run) -> dict[int, float]:
    return {m["step"]: m["val/loss"] for m in run.metrics() if "val/loss" in m}


@pytest.mark.slow  # run time: test_pipeline_parallel.py checks pp=2 against the unsharded model
def test_pp2_dp2_trains_and_matches_pure_data_parallel(pp2, dp2):
    s, ref = pp2.summary, dp2.summary
    assert s["global_step"] == MAX_STEPS and s["final_loss"] < s["initial_loss"] - 0.2
    assert len(pp2.events("worker_started")) == 4  # one process per rank: 2 replicas x 2 stages
    for key in ("samples_committed", "tokens_committed"):  # each replica counted once, not once per stage
        assert s[key] == ref[key]
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    _same_loss_curve(pp2, dp2, "pp=2")
    assert all(m["counts"] == [1, 1] for m in pp2.metrics())  # one count per replica per step


@pytest.mark.slow  # run time: test_tp_checkpoint.py checks the one-file checkpoint at tp=2
def test_a_pp_run_writes_the_full_model_and_optimizer_state_into_one_file(pp2):
    assert [e["at_step"] for e in pp2.events("checkpoint_saved")] == [5, 10]
    path = pp2.dir / "checkpoints" / "last.ckpt"
    module = GPTModule.load_from_checkpoint(path, map_location="cpu")  # the unsharded GPT: every stage in it
    assert param_checksum(module) == pp2.summary["param_checksum"]  # the gathered stages of the run's model
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    names = [n for n, p in module.model.named_parameters() if p.dim() >= 2] + \
            [n for n, p in module.model.named_parameters() if p.dim() < 2]  # the unsharded optimizer's order
    params, state = dict(module.model.named_parameters()), ckpt["optimizer_states"][0]["state"]
    assert sorted(state) == list(range(len(names)))
    for k, name in enumerate(names):
        assert state[k]["exp_avg"].shape == params[name].shape and int(state[k]["step"]) == MAX_STEPS, name
    module.configure_optimizers()["optimizer"].load_state_dict(ckpt["optimizer_states"][0])  # as a pp=1 run does


@pytest.mark.parametrize("override, says", [
    ("model.dropout=0.1", "set model.dropout=0 or parallel.pp=1"),
    ("trainer.accumulate_grad_batches=2", "set trainer.accumulate_grad_batches=1 and trainer.micro_batches"),
    ("trainer.micro_batches=3", "must split into that many equal micro-batches"),
])
def test_a_mix_pipeline_parallelism_does_not_train_is_refused(override, says):
    cfg = _compose(*PP2, *override.split())
    with pytest.raises(ConfigError, match="Invalid configuration") as refused:
        validate(cfg)
    assert says in str(refused.value)


def test_the_mixes_pipeline_parallelism_trains_with_keep_their_pp_in_smoke_mode():
    for ft in ("ft=[]", "ft=[flashrecovery]", "ft=[flash_ckpt]", "ft=[deadpool]", "ft=[ndb]",
               "ft=[ndb] ft.ndb.repair_after_s=0"):
        cfg = _compose(*PP2, *ft.split())
        validate(cfg)
        assert trained_pp(cfg) == 2
    cfg = _compose(*PP2, "model.dropout=0.1", "runner.smoke=true")
    assert trained_pp(cfg) == 1
    changes = apply_smoke(cfg)
    assert cfg.parallel.pp == 1 and any("parallel.pp 2 -> 1 (training runs pp <= 1" in c for c in changes)


def test_validation_at_pp2_is_accepted_and_keeps_the_pipeline():
    cfg = _compose(*PP2, *VALIDATED)
    validate(cfg)
    assert trained_pp(cfg) == 2


@pytest.fixture(scope="module")
def dp2_validated(tmp_path_factory) -> Run:
    run = run_cli(*DP2, *VALIDATED, f"trainer.max_steps={MAX_STEPS}", run_dir=tmp_path_factory.mktemp("dp2val") / "run")
    assert run.summary["status"] == "completed", run.output[-4000:]
    return run


@pytest.fixture(scope="module")
def pp2_validated(tmp_path_factory) -> Run:
    run = run_cli(*PP2, *VALIDATED, f"trainer.max_steps={MAX_STEPS}", run_dir=tmp_path_factory.mktemp("pp2val") / "run")
    assert run.summary["status"] == "completed", run.output[-4000:]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2", "tp2pp2"])
def test_validation_through_the_stages_logs_the_val_loss_of_pure_data_parallel_and_trains_nothing(
        layout, dp2_validated, request, run_dir):
    """Each replica's validation batches (the same as at pp=1) run forward only through its stages. The pipeline's
    weights differ from the pp=1 run's by the rounding of their gradient sums (over micro-batches, and of the tied
    embedding's gradient across stages), so val/loss is compared within 1e-5, float32 rounding, not bit for bit;
    and the run's training is the one without validation, bit for bit."""
    reference = request.getfixturevalue(layout)
    run = request.getfixturevalue("pp2_validated") if layout == "pp2" else run_cli(
        *TP2PP2, *VALIDATED, f"trainer.max_steps={MAX_STEPS}", run_dir=run_dir)
    assert run.summary["status"] == "completed", run.output[-4000:]
    ours = _val_losses(run)
    assert sorted(ours) == [3, 6, 9]
    assert ours == pytest.approx(_val_losses(dp2_validated), rel=1e-5)
    # the final weights, validated after the last step through the stages too
    assert run.summary["val"]["val/loss"] == pytest.approx(dp2_validated.summary["val"]["val/loss"], rel=1e-5)
    assert run.summary["param_checksum"] == reference.summary["param_checksum"]
    assert [m["loss"] for m in run.metrics()] == [m["loss"] for m in reference.metrics()]


@pytest.mark.slow
def test_a_stage_restarted_at_a_validation_step_leaves_val_loss_exact(pp2_validated, run_dir):
    """The last stage of replica 0 is killed at step 6, which carries a validation: the replica's stages redo the
    step, the validation's forward passes with it, from the same committed weights."""
    run = run_cli(*PP2, *VALIDATED, f"trainer.max_steps={MAX_STEPS}", "ft=[flashrecovery]", "fault=kill_rank",
                  "fault.rank=1", "fault.step=6", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed" and len(s["recoveries"]) == 1, run.output[-4000:]
    assert s["param_checksum"] == pp2_validated.summary["param_checksum"]
    assert _val_losses(run) == _val_losses(pp2_validated)
    assert run.summary["val"] == pp2_validated.summary["val"]


@pytest.mark.slow
def test_tp2_pp2_dp2_on_two_nodes_of_four_matches_pure_data_parallel(tp2pp2, dp2):
    s = tp2pp2.summary
    assert len(tp2pp2.events("worker_started")) == 8
    assert s["samples_committed"] == dp2.summary["samples_committed"]
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    _same_loss_curve(tp2pp2, dp2, "tp=2 pp=2")


@pytest.mark.slow
def test_another_placement_order_trains_the_same_model_with_other_ranks_in_each_group(tp2pp2, run_dir):
    """parallel.order=pp-tp-dp puts a replica's two stages side by side and its TP pairs two ranks apart: the groups
    change, the model and its data do not."""
    run = run_cli(*TP2PP2, "parallel.order=pp-tp-dp", f"trainer.max_steps={TP2PP2_STEPS}", run_dir=run_dir)
    assert run.summary["status"] == "completed", run.output[-4000:]
    assert run.summary["samples_committed"] == tp2pp2.summary["samples_committed"]
    assert run.summary["samples_lost"] == run.summary["samples_duplicated"] == 0
    _same_loss_curve(run, tp2pp2, "order pp-tp-dp")


# the last stage of replica 0 (at tp=2, its second TP slot); the replacement takes its slice from the replica at the
# same (pp, tp) coordinate, and every rank of replica 0 redoes the step
KILLED = {"pp2": (PP2, 1, 3), "tp2pp2": (TP2PP2, 3, 7)}  # layout, killed rank, the rank that serves it


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(KILLED))
def test_flashrecovery_kill_rank_restores_the_stage_exactly(layout, request, run_dir):
    args, killed, source = KILLED[layout]
    run = run_cli(*args, f"trainer.max_steps={MAX_STEPS}", "ft=[flashrecovery]", "fault=kill_rank",
                  f"fault.rank={killed}", "fault.step=5", run_dir=run_dir)
    s, ref = run.summary, request.getfixturevalue(layout).summary
    assert s["status"] == "completed", run.output[-4000:]
    assert s["param_checksum"] == ref["param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    assert s["samples_committed"] == ref["samples_committed"]
    rec = s["recoveries"]
    assert len(rec) == 1 and (rec[0]["victims"], rec[0]["action"], rec[0]["rpo_steps"]) == (
        [killed], "restart_rank", 0)
    assert [e["rank"] for e in run.events("state_sent")] == [source]


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(KILLED))
def test_flash_ckpt_kill_all_restores_each_ranks_own_stage(layout, request, run_dir):
    run = run_cli(*KILLED[layout][0], f"trainer.max_steps={MAX_STEPS}", "ft=[flash_ckpt]", "fault=kill_all",
                  f"fault.step={KILL_ALL_STEP}", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert s["global_step"] == MAX_STEPS and s["param_checksum"] == request.getfixturevalue(layout).summary[
        "param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"]) == (0, 0)
    assert_restored_from_step_5(run)


def assert_restored_from_step_5(run: Run) -> None:
    """Every rank restored its own snapshot of step 5, the newest committed everywhere before the kill."""
    restored = sorted((e["rank"], e["step"]) for e in run.events("snapshot_restored"))
    assert restored == [(r, 5) for r in sorted(run.only_recovery()["victims"])]  # kill_all: every rank


@pytest.mark.slow
def test_a_pp_checkpoint_resumes_at_its_own_layout_exactly_and_at_another_one(pp2, tmp_path):
    steps = f"trainer.max_steps={2 * MAX_STEPS}"
    straight = run_cli(*PP2, steps, run_dir=tmp_path / "straight")
    assert straight.returncode == 0, straight.output[-3000:]
    resumed = run_cli(*PP2, steps, f"runner.resume={pp2.dir}", run_dir=tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert [e["at_step"] for e in resumed.events("resumed")] == [MAX_STEPS]
    assert resumed.summary["param_checksum"] == straight.summary["param_checksum"]
    elsewhere = run_cli(*DP2, steps, f"runner.resume={pp2.dir}", run_dir=tmp_path / "dp2")  # tp=1 pp=1
    assert elsewhere.returncode == 0, elsewhere.output[-3000:]
    assert [e["at_step"] for e in elsewhere.events("resumed")] == [MAX_STEPS]
    tail = [m["loss"] for m in straight.metrics()][MAX_STEPS:]
    assert [m["loss"] for m in elsewhere.metrics()] == pytest.approx(tail, rel=0.01)


@pytest.mark.slow
def test_zero1_at_pp2_is_bit_identical_to_pp2_and_its_checkpoint_resumes_at_another_layout(pp2, tmp_path):
    """ZeRO-1 shards each stage's optimizer over the DP group of its (pp, tp) coordinate: the first half with it
    writes the full model and optimizer, and the second half, resumed with it at pp=2, ends on the checksum of the
    pp=2 run without it (the same updates, bit for bit); resumed at tp=pp=1 the loss follows within 1 %."""
    half = MAX_STEPS // 2
    first = run_cli(*PP2, "parallel.zero=1", f"trainer.max_steps={half}", run_dir=tmp_path / "first")
    assert first.summary["status"] == "completed", first.output[-4000:]
    module = GPTModule.load_from_checkpoint(first.dir / "checkpoints" / "last.ckpt", map_location="cpu")
    state = torch.load(first.dir / "checkpoints" / "last.ckpt", weights_only=True)["optimizer_states"][0]["state"]
    assert sorted(state) == list(range(len(list(module.model.parameters()))))  # every shard of every stage
    resumed = run_cli(*PP2, "parallel.zero=1", f"trainer.max_steps={MAX_STEPS}", f"runner.resume={first.dir}",
                      run_dir=tmp_path / "resumed")
    assert resumed.summary["status"] == "completed", resumed.output[-4000:]
    assert [e["at_step"] for e in resumed.events("resumed")] == [half]
    assert resumed.summary["param_checksum"] == pp2.summary["param_checksum"]
    elsewhere = run_cli(*DP2, "parallel.zero=1", f"trainer.max_steps={MAX_STEPS}", f"runner.resume={first.dir}",
                        run_dir=tmp_path / "dp2")
    assert elsewhere.summary["status"] == "completed", elsewhere.output[-4000:]
    tail = [m["loss"] for m in pp2.metrics()][half:]
    assert [m["loss"] for m in elsewhere.metrics()] == pytest.approx(tail, rel=0.01)


@pytest.mark.slow
def test_zero1_at_tp2_pp2_is_bit_identical_to_the_same_layout_without_it(tp2pp2, run_dir):
    """Each (pp, tp) coordinate shards its own slices of its stage over its DP group."""
    run = run_cli(*TP2PP2, "parallel.zero=1", f"trainer.max_steps={MAX_STEPS}", run_dir=run_dir)
    assert run.summary["status"] == "completed", run.output[-4000:]
    assert run.summary["param_checksum"] == tp2pp2.summary["param_checksum"]


@pytest.mark.slow
def test_flash_ckpt_kill_all_at_pp2_with_zero1_restores_every_shard_exactly(pp2, run_dir):
    run = run_cli(*PP2, "parallel.zero=1", f"trainer.max_steps={MAX_STEPS}", "ft=[flash_ckpt]", "fault=kill_all",
                  f"fault.step={KILL_ALL_STEP}", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert s["param_checksum"] == pp2.summary["param_checksum"] and len(s["recoveries"]) == 1
    assert (s["samples_lost"], s["samples_duplicated"]) == (0, 0)
    assert_restored_from_step_5(run)


@pytest.mark.slow
def test_master_weights_at_pp2_train_within_a_few_percent_of_fp32_and_checkpoint_the_masters(pp2, run_dir):
    """bf16 stages with fp32 masters and moments in each stage's ZeRO-1 shard; the file holds every stage's
    masters, of which the bf16 parameters are the rounding."""
    run = run_cli(*PP2, "parallel.zero=1", "trainer.precision=bf16-true", "trainer.master_weights=true",
                  f"trainer.max_steps={MAX_STEPS}", run_dir=run_dir)
    assert run.summary["status"] == "completed", run.output[-4000:]
    bf16, fp32 = [m["loss"] for m in run.metrics()], [m["loss"] for m in pp2.metrics()]
    assert bf16 == pytest.approx(fp32, rel=0.02)
    path = run.dir / "checkpoints" / "last.ckpt"
    named = list(GPTModule.load_from_checkpoint(path, map_location="cpu").named_parameters())
    names = [n for n, p in named if p.dim() >= 2] + [n for n, p in named if p.dim() < 2]
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    state = ckpt["optimizer_states"][0]["state"]
    assert sorted(state) == list(range(len(names)))
    for k, entry in state.items():
        master = entry["master_weight"]
        assert master.dtype == torch.float32 and torch.equal(master.bfloat16(), ckpt["state_dict"][names[k]])


@pytest.mark.slow
def test_flashrecovery_at_pp2_takes_a_zero1_shard_from_the_other_replica_group(tmp_path):
    """pp=2 and dp=4 in two replica groups of two: the restarted rank 3 (stage 1 of replica 1) takes its shard
    from rank 7 (stage 1 of replica 3, the same shard index in the other group)."""
    dp4 = [*CLIPPED_TINY, "parallel.procs_per_node=4", "parallel.pp=2", "ft=[flashrecovery]",
           f"trainer.max_steps={MAX_STEPS}"]
    replicated = run_cli(*dp4, run_dir=tmp_path / "replicated")
    assert replicated.summary["status"] == "completed", replicated.output[-4000:]
    run = run_cli(*dp4, "parallel.zero=1", "parallel.dp_group_size=2", "fault=kill_rank", "fault.rank=3",
                  "fault.step=5", run_dir=tmp_path / "killed")
    s, ref = run.summary, replicated.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert s["param_checksum"] == ref["param_checksum"] and s["samples_committed"] == ref["samples_committed"]
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    assert [(r["victims"], r["action"], r["rpo_steps"]) for r in s["recoveries"]] == [([3], "restart_rank", 0)]
    assert [e["holder"] for e in run.events("shard_restored")] == [7]


def test_micro_batches_without_a_pipeline_are_refused():
    cfg = _compose("+recipe=gpt_tiny", "parallel.nodes=2", "parallel.procs_per_node=2", "trainer.micro_batches=2")
    with pytest.raises(ConfigError, match="Invalid configuration") as refused:
        validate(cfg)
    assert "set trainer.micro_batches=0" in str(refused.value)


@pytest.mark.slow
@pytest.mark.parametrize("approximations", ["off", "all"])
def test_ndb_kill_rank_at_tp2_pp2_the_neighbour_replica_runs_the_replicas_batch_through_its_pipeline(
        approximations, tp2pp2, run_dir):
    # rank 6 (stage 1, TP slot 0 of replica 1) fails: ranks 4, 5 and 7 are stopped, and replica 0's ranks 0-3 each
    # take over the rank at their (pp, tp) coordinate, running replica 1's batch through their 1F1B schedule too
    knobs = ["ft.ndb.exact_reference=true"] if approximations == "off" else ["ft.ndb.warmup_steps=0"]
    run = run_cli(*TP2PP2, f"trainer.max_steps={MAX_STEPS}", "ft=[ndb]", *knobs, "fault=kill_rank", "fault.rank=6",
                  "fault.step=5", run_dir=run_dir)
    s, ref = run.summary, tp2pp2.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert s["global_step"] == MAX_STEPS and len(run.events("worker_started")) == 8  # nobody restarted
    assert sorted((e["wid"], e["failed"]) for e in run.events("replica_stopped")) == [(4, 6), (5, 6), (7, 6)]
    assert sorted((e["logical"], e["neighbour_wid"]) for e in run.events("takeover_assigned")) == [
        (4, 0), (5, 1), (6, 2), (7, 3)]
    (rec,) = s["recoveries"]
    assert (rec["action"], rec["victims"], rec["rpo_steps"]) == ("takeover", [6], 0)
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    assert (s["samples_committed"], s["tokens_committed"]) == (ref["samples_committed"], ref["tokens_committed"])
    assert all(m["counts"] == [1, 1] for m in run.metrics())
    if approximations == "off":  # the taken-over batch computed exactly: the fault-free run, bit for bit
        assert s["param_checksum"] == ref["param_checksum"]
    else:
        assert s["final_loss"] < s["initial_loss"]
        assert abs(s["final_loss"] - ref["final_loss"]) / ref["final_loss"] < 0.01
