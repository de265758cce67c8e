"""ZeRO-1 over the DP group of a tensor-parallel run, and Megatron-style mixed precision: bf16 parameters and
gradients, fp32 master weights and Adam moments in the ZeRO-1 shard (``trainer.master_weights``).

Unit tests on real optimizers; one real-process run in the default tier (tp=2 dp=2 with ZeRO-1 and master
weights), the comparisons against other runs are slow."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from runner.config import ConfigError
from runner.config.validate import validate
from runner.lightning_module import GPTModule
from runner.model import GPTConfig
from runner.planning.memory import MASTER_WEIGHTS, PRECISIONS, Layout, rank_memory, stage_params
from runner.planning.plan import make_plan
from runner.training.shard_state import ShardState, UpdateRecord, replay
from runner.training.zero import MASTER_KEY, ZeroOne
from tests.conftest import run_cli
from tests.test_config import _compose
from tests.test_deadpool import assert_exact

TP2 = ["+recipe=gpt_tiny", "parallel.nodes=2", "parallel.procs_per_node=2", "parallel.tp=2"]
MASTER = ["parallel.zero=1", "trainer.precision=bf16-true", "trainer.master_weights=true"]


def _modules() -> tuple[torch.nn.Module, torch.nn.Module]:
    """An fp32 module and its bf16 copy, with bf16-exact fp32 weights (both start from the same values)."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.bfloat16().float())
    return ref, copy.deepcopy(ref).bfloat16()


def _adamw(module: torch.nn.Module) -> torch.optim.AdamW:
    decay = [p for p in module.parameters() if p.dim() >= 2]
    rest = [p for p in module.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)


def _step(module: torch.nn.Module, opt: torch.optim.Optimizer, grads: list[torch.Tensor]) -> None:
    for p, g in zip(module.parameters(), grads):
        p.grad = g.to(p.dtype)
    opt.step()


def test_master_weights_step_fp32_masters_and_round_them_into_the_bf16_parameters():
    """The sharded optimizer steps fp32 masters exactly as an fp32 AdamW steps fp32 weights with the same
    (bf16) gradients; the module's bf16 parameters are the masters rounded, and only the masters of its
    own shard exist."""
    ref, half = _modules()
    ref_opt = _adamw(ref)
    zero = ZeroOne(half, _adamw(half), dp=2, master_weights=True)
    zero.shard_for(0)
    own = zero.plan.flat_shard(0)
    assert sorted(zero.masters) == sorted(own) and 0 < len(own) < len(zero.params)
    torch.manual_seed(1)
    for _ in range(3):
        grads = [torch.randn_like(p).bfloat16() for p in ref.parameters()]
        _step(ref, ref_opt, grads)
        _step(half, zero.optimizer, grads)
        assert all(p.grad is None for p in zero.masters.values())  # the fp32 gradient lives for the update only
    ref_params = list(ref.parameters())
    for i in own:
        assert zero.masters[i].dtype == torch.float32
        assert torch.equal(zero.masters[i], ref_params[i].detach())
        assert torch.equal(zero.params[i].detach(), ref_params[i].detach().bfloat16())
        state = zero.optimizer.state[zero.masters[i]]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert not torch.equal(zero.masters[own[0]], zero.params[own[0]].detach().float())  # the masters hold more bits


def test_master_weights_travel_in_the_optimizer_state_dict_and_load_back_exactly():
    _, half = _modules()
    zero = ZeroOne(half, _adamw(half), dp=2, master_weights=True)
    zero.shard_for(1)
    torch.manual_seed(2)
    for _ in range(2):
        _step(half, zero.optimizer, [torch.randn_like(p) for p in half.parameters()])
    saved = copy.deepcopy(zero.optimizer.state_dict())
    masters = [saved["state"][k][MASTER_KEY] for k in sorted(saved["state"])]
    assert all(m.dtype == torch.float32 for m in masters)
    assert "master_weight" not in zero.optimizer.state[next(iter(zero.masters.values()))]  # only in the state_dict

    fresh = copy.deepcopy(half)  # the same bf16 parameters (a checkpoint's state_dict), new masters
    other = ZeroOne(fresh, _adamw(fresh), dp=2, master_weights=True)
    other.shard_for(1)
    other.optimizer.load_state_dict(saved)
    for i, master in zip(other.plan.flat_shard(1), masters):
        assert torch.equal(other.masters[i], master)
    assert all(MASTER_KEY not in s for s in other.optimizer.state.values())
    grads = [torch.randn_like(p) for p in half.parameters()]
    _step(half, zero.optimizer, grads)
    _step(fresh, other.optimizer, grads)
    assert all(torch.equal(a, b) for a, b in zip(half.parameters(), fresh.parameters()))


def test_a_copy_of_a_master_weight_shard_replays_and_restores_the_fp32_masters_exactly():
    """What DeadPool's replica holds and a joiner loads: the masters (not the bf16 parameters) and their moments; a
    replay of a recorded update (bf16 gradients) makes the owner's very update, and loading the copy into a fresh
    rank gives it the owner's masters, so both step alike afterwards."""
    _, half = _modules()
    zero = ZeroOne(half, _adamw(half), dp=2, master_weights=True)
    zero.shard_for(1)
    own = zero.plan.flat_shard(1)
    assert all(a is zero.masters[i] for a, i in zip(zero.own_optimizer_params(), own))
    torch.manual_seed(3)
    _step(half, zero.optimizer, [torch.randn_like(p) for p in half.parameters()])
    base = ShardState(1, [p.detach().clone() for p in zero.own_optimizer_params()],
                      copy.deepcopy(dict(enumerate(zero.optimizer.state[p] for p in zero.own_optimizer_params()))), 1)
    grads = [torch.randn_like(p) for p in half.parameters()]
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in zero.optimizer.param_groups]
    _step(half, zero.optimizer, grads)
    groups = [g for g, idx in enumerate(zero.plan.shard(1)) for _ in idx]
    shard_grads = [list(half.parameters())[i].grad for i in own]
    replayed = replay(zero.optimizer, base, groups, [UpdateRecord(2, shard_grads, hyper)])
    assert all(torch.equal(a, zero.masters[i]) for a, i in zip(replayed.params, own))

    fresh = copy.deepcopy(half)
    other = ZeroOne(fresh, _adamw(fresh), dp=2, master_weights=True)
    other.shard_for(1)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()  # a joiner's own values are all overwritten
    other.load_own(replayed.params)
    other.optimizer.load_state_dict({"state": other.shard_state_dict(replayed.params, replayed.state),
                                     "param_groups": other.optimizer.state_dict()["param_groups"]})
    assert all(torch.equal(other.masters[i], zero.masters[i]) for i in own)
    assert all(torch.equal(fresh.get_parameter(n), half.get_parameter(n)) for n in (other.names[i] for i in own))
    grads = [torch.randn_like(p) for p in half.parameters()]
    _step(half, zero.optimizer, grads)
    _step(fresh, other.optimizer, grads)
    assert all(torch.equal(other.masters[i], zero.masters[i]) for i in own)

def test_master_weights_need_bf16_parameters():
    ref, _ = _modules()
    with pytest.raises(ValueError, match="trainer.precision=bf16-true"):
        ZeroOne(ref, _adamw(ref), dp=2, master_weights=True)


def test_the_plan_counts_bf16_weights_and_gradients_and_fp32_masters_and_moments_in_the_shard():
    gpt = GPTConfig(vocab_size=50304, seq_len=2048, n_layer=40, n_head=40, d_model=5120, bias=False)
    for tp, dp in ((8, 8), (2, 32), (1, 64)):
        n = stage_params(gpt, tp, 1, 0)
        mem = rank_memory(gpt, MASTER_WEIGHTS, Layout(tp, 1, dp, 1, 1, 16, False))
        assert (mem.params, mem.grads) == (2 * n, 2 * n)
        assert mem.master == pytest.approx(4 * n / dp) and mem.moments == pytest.approx(8 * n / dp)
        fp32 = rank_memory(gpt, PRECISIONS["bf16-mixed"], Layout(tp, 1, dp, 1, 1, 16, False))
        assert mem.activations == fp32.activations
        assert fp32.total - mem.total == pytest.approx(4 * n - 4 * n / dp)  # 16 - 12/dp bytes vs 8 + 8/dp
    cfg = _compose("+recipe=gpt13b")
    assert cfg.trainer.master_weights and cfg.trainer.precision == "bf16-true"
    plan = make_plan(cfg)
    assert plan.memory.params == 2 * stage_params(gpt, 8, 1, 0) and plan.memory.master > 0
    assert "fp32 master weights" in plan.precision


@pytest.mark.parametrize("overrides, says", [
    (["trainer.precision=bf16-true", "trainer.master_weights=true"], "set parallel.zero=1"),
    (["parallel.zero=1", "trainer.master_weights=true"], "set trainer.precision=bf16-true"),
    ([*TP2[1:], *MASTER, "ft=[ndb]"], "only DeadPool's per-step replica keeps a copy of it: add deadpool to ft"),
    ([*MASTER, "ft=[flashrecovery]"], "add deadpool to ft"),
    ([*TP2[1:], "parallel.zero=1", "ft=[flashrecovery]"], "add deadpool to ft"),
])
def test_what_zero_and_master_weights_do_not_train_is_refused(overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        validate(_compose("+recipe=gpt_tiny", *overrides))


@pytest.mark.parametrize("overrides", [
    TP2[1:], [*TP2[1:], "ft=[flash_ckpt]"], [], [*TP2[1:], "ft=[deadpool]"], [*TP2[1:], "ft=[flashrecovery,deadpool]"],
    [*TP2[1:3], "parallel.dp_group_size=2", "ft=[flashrecovery]"],  # dp=4 in two replica groups
    # NDB takes the failed replica over; at each (pp, tp) coordinate the holder of a rank's replica carries its shard
    [*TP2[1:], "ft=[ndb,deadpool]"], [*TP2[1:3], "parallel.pp=2", "ft=[ndb,deadpool]"],
])
def test_zero1_trains_at_tp2_and_with_master_weights(overrides):
    validate(_compose("+recipe=gpt_tiny", "parallel.zero=1", *overrides))
    validate(_compose("+recipe=gpt_tiny", *MASTER, *overrides))


STEPS = 12
CONSTANT_LR = "trainer.min_lr=3e-3"  # the LR is constant after warm-up, so a shorter run is a prefix of a longer one


@pytest.fixture(scope="module")
def tp2_master(tmp_path_factory):
    run = run_cli(*TP2, *MASTER, CONSTANT_LR, f"trainer.max_steps={STEPS}",
                  run_dir=tmp_path_factory.mktemp("tp2m") / "run")
    assert run.summary["status"] == "completed", run.output[-4000:]
    return run


@pytest.fixture(scope="module")
def tp2_zero(tmp_path_factory):
    """The same layout in fp32 with ZeRO-1."""
    run = run_cli(*TP2, "parallel.zero=1", CONSTANT_LR, f"trainer.max_steps={STEPS}",
                  run_dir=tmp_path_factory.mktemp("tp2z") / "run")
    assert run.summary["status"] == "completed", run.output[-4000:]
    return run


@pytest.mark.slow
def test_zero1_with_master_weights_at_tp2_trains_and_its_checkpoint_holds_fp32_masters(tp2_master):
    s = tp2_master.summary
    assert s["global_step"] == STEPS and s["final_loss"] < s["initial_loss"] - 0.2
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    path = tp2_master.dir / "checkpoints" / "last.ckpt"
    ckpt = torch.load(path, weights_only=False)
    params = ckpt["state_dict"]
    assert all(t.dtype == torch.bfloat16 for t in params.values())
    # the unsharded optimizer numbers the parameters with >= 2 dims first (GPTModule.configure_optimizers)
    named = list(GPTModule.load_from_checkpoint(path).named_parameters())
    names = [n for n, p in named if p.dim() >= 2] + [n for n, p in named if p.dim() < 2]
    state = ckpt["optimizer_states"][0]
    assert sorted(state["state"]) == list(range(len(names)))  # every DP shard of every TP slice, gathered
    for k, entry in state["state"].items():
        master, full = entry[MASTER_KEY], params[names[k]]
        assert master.dtype == entry["exp_avg"].dtype == torch.float32
        assert master.shape == full.shape  # the full parameter's, gathered over the TP group
        assert torch.equal(master.bfloat16(), full)  # the parameters are the masters rounded


@pytest.mark.slow
def test_zero1_at_tp2_is_bit_identical_to_replicated_optimizer_state(tp2_zero, run_dir):
    replicated = run_cli(*TP2, CONSTANT_LR, f"trainer.max_steps={STEPS}", run_dir=run_dir)
    assert replicated.summary["status"] == "completed", replicated.output[-4000:]
    assert tp2_zero.summary["param_checksum"] == replicated.summary["param_checksum"]
    files = [torch.load(r.dir / "checkpoints" / "last.ckpt", weights_only=False) for r in (tp2_zero, replicated)]
    sharded, whole = (f["optimizer_states"][0]["state"] for f in files)
    assert sorted(sharded) == sorted(whole)
    assert all(torch.equal(sharded[k][key], whole[k][key]) for k in whole for key in whole[k])


@pytest.mark.slow
def test_master_weights_train_within_a_few_percent_of_fp32(tp2_master, tp2_zero):
    fp32 = [m["loss"] for m in tp2_zero.metrics()]
    bf16 = [m["loss"] for m in tp2_master.metrics()]
    assert len(bf16) == len(fp32) == STEPS
    for step, (a, b) in enumerate(zip(bf16, fp32)):
        assert a == pytest.approx(b, rel=0.02), f"step {step}: bf16 with fp32 masters {a} vs fp32 {b}"


@pytest.mark.slow
def test_master_weights_resume_bit_identically_at_tp2(tp2_master, tmp_path):
    half = STEPS // 2
    first = run_cli(*TP2, *MASTER, CONSTANT_LR, f"trainer.max_steps={half}", run_dir=tmp_path / "first")
    assert first.summary["status"] == "completed", first.output[-4000:]
    resumed = run_cli(*TP2, *MASTER, CONSTANT_LR, f"trainer.max_steps={STEPS}", f"runner.resume={first.dir}",
                      run_dir=tmp_path / "resumed")
    s = resumed.summary
    assert s["status"] == "completed", resumed.output[-4000:]
    assert [e["at_step"] for e in resumed.events("resumed")] == [half]
    assert s["param_checksum"] == tp2_master.summary["param_checksum"]


@pytest.mark.slow
def test_flash_ckpt_kill_all_at_tp2_with_zero1_restores_every_shard_exactly(tp2_zero, run_dir):
    run = run_cli(*TP2, "parallel.zero=1", CONSTANT_LR, f"trainer.max_steps={STEPS}", "ft=[flash_ckpt]",
                  "fault=kill_all", "fault.step=7", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert s["global_step"] == STEPS and len(s["recoveries"]) == 1
    assert s["param_checksum"] == tp2_zero.summary["param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"]) == (0, 0)


@pytest.mark.slow
def test_flash_ckpt_kill_all_with_master_weights_restores_the_fp32_masters_exactly(tp2_master, run_dir):
    run = run_cli(*TP2, *MASTER, CONSTANT_LR, f"trainer.max_steps={STEPS}", "ft=[flash_ckpt]", "fault=kill_all",
                  "fault.step=7", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert s["global_step"] == STEPS and len(s["recoveries"]) == 1
    assert s["param_checksum"] == tp2_master.summary["param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"]) == (0, 0)


# -- recoveries that hand a restored rank its shard: the fp32 masters and moments, not the bf16 parameters ----------
@pytest.mark.slow
def test_master_weights_node_loss_spare_host_gets_the_fp32_shards_exactly(tp2_master, run_dir):
    run = run_cli(*TP2, *MASTER, CONSTANT_LR, f"trainer.max_steps={STEPS}", "ft=[deadpool]", "fault=kill_node",
                  "fault.node=1", "fault.step=6", run_dir=run_dir)
    assert_exact(run, tp2_master.summary)
    rec = run.only_recovery()
    assert (rec["action"], rec["victims"]) == ("swap_spare", [2, 3]) and rec["rpo_steps"] <= 1
    restored = {e["rank"]: e for e in run.events("shard_restored")}
    assert {r: e["holder"] for r, e in restored.items()} == {2: 0, 3: 1}


@pytest.mark.slow
@pytest.mark.parametrize("ft", ["ft=[deadpool]", "ft=[flashrecovery,deadpool]"])
def test_master_weights_kill_during_replication_replays_the_update_on_the_fp32_masters(tp2_master, run_dir, ft):
    # rank 3's copy of update 7 was in flight: its holder, rank 1, replays that update on the fp32 masters
    run = run_cli(*TP2, *MASTER, CONSTANT_LR, f"trainer.max_steps={STEPS}", ft, "fault=kill_rank", "fault.rank=3",
                  "fault.step=6", "fault.during=replication", "ft.deadpool.replication=copy", run_dir=run_dir)
    assert_exact(run, tp2_master.summary)
    (restored,) = run.events("shard_restored")
    assert (restored["rank"], restored["holder"], restored["replayed_updates"]) == (3, 1, 1)


FOUR_GROUPED = [*TP2[:3], *MASTER, "parallel.dp_group_size=2", "ft=[flashrecovery]", CONSTANT_LR,
                f"trainer.max_steps={STEPS}"]  # dp=4 in two replica groups of two, each holding every shard


@pytest.mark.slow
def test_master_weights_kill_rank_takes_the_fp32_shard_from_the_other_replica_group(tmp_path, run_dir):
    fault_free = run_cli(*FOUR_GROUPED, run_dir=tmp_path / "fault_free")
    assert fault_free.summary["status"] == "completed", fault_free.output[-4000:]
    run = run_cli(*FOUR_GROUPED, "fault=kill_rank", "fault.rank=2", "fault.step=6", run_dir=run_dir)
    assert_exact(run, fault_free.summary)
    assert [rec["action"] for rec in run.summary["recoveries"]] == ["restart_rank"]
    assert [(e["rank"], e["holder"], e["replayed_updates"]) for e in run.events("shard_restored")] == [(2, 0, 0)]
