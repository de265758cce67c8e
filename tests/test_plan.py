"""The plan is a promise: memory per rank itemised and checked against runner.gpu_memory_gib, the big recipes
fit, an over-full layout is refused with a change that fits, and ft=deadpool gets a spare node by default."""

from __future__ import annotations

import re

import pytest
import torch

from runner.config import ConfigError
from runner.config.validate import validate
from runner.model import GPTConfig
from runner.planning.memory import PRECISIONS, GiB, Layout, rank_memory, stage_memory, stage_params
from runner.planning.model_cost import count_params
from runner.planning.plan import make_plan, memory_problem
from tests.conftest import run_cli
from tests.test_config import _compose

GPT13B = GPTConfig(vocab_size=50304, seq_len=2048, n_layer=40, n_head=40, d_model=5120, bias=False)


@pytest.mark.parametrize("recipe", ["gpt13b", "gpt1_2b"])
@pytest.mark.parametrize("ft", ["ft=[]", "ft=deadpool", "ft=[flashrecovery,deadpool]", "ft=[ndb,deadpool]"])
def test_the_big_recipes_fit_an_80_gib_gpu(recipe, ft):
    cfg = _compose(f"+recipe={recipe}", ft)
    validate(cfg, for_training=False)
    plan = make_plan(cfg)
    assert cfg.runner.gpu_memory_gib == 80
    assert plan.bytes_per_rank <= 80 * GiB and memory_problem(cfg, plan) is None
    assert plan.params > cfg.runner.cpu_max_params  # planned at GPU scale: one sample per micro-batch
    assert plan.layout.micro_batch == 1


@pytest.mark.parametrize("overrides, change", [
    (["+recipe=gpt13b", "parallel.tp=1"], "parallel.tp=2"),
    (["+recipe=gpt13b", "parallel.tp=1", "runner.gpu_memory_gib=45"], "parallel.tp=4"),
    (["+recipe=gpt13b", "parallel.tp=1", "runner.gpu_memory_gib=25"], "parallel.tp=8"),
    (["+recipe=gpt1_2b", "parallel.zero=0", "runner.gpu_memory_gib=25"], "parallel.zero=1"),
    (["+recipe=gpt13b", "parallel.tp=1", "parallel.zero=0", "parallel.procs_per_node=2", "parallel.nodes=32",
      "runner.gpu_memory_gib=45"], "parallel.tp=2 parallel.pp=2 parallel.zero=1"),
])
def test_an_over_full_layout_is_refused_with_the_smallest_change_that_fits(overrides, change):
    cfg = _compose(*overrides)
    problem = memory_problem(cfg, make_plan(cfg))
    assert problem is not None and "\n" not in problem
    assert f"more than runner.gpu_memory_gib={cfg.runner.gpu_memory_gib:g}" in problem
    suggested = re.search(r"set ((?:parallel\.\w+=\d+ ?)+)", problem)
    assert suggested and suggested.group(1).strip() == change, problem
    fixed = _compose(*overrides, *change.split())
    validate(fixed, for_training=False)
    assert memory_problem(fixed, make_plan(fixed)) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host gpt_small trains on its GPUs")
def test_a_run_that_trains_on_cpu_here_has_no_gpu_memory_to_fit():
    cfg = _compose("+recipe=gpt_small", "runner.gpu_memory_gib=1")
    plan = make_plan(cfg)
    assert plan.bytes_per_rank > GiB and memory_problem(cfg, plan) is None
    on_cpu = _compose("+recipe=gpt13b", "parallel.tp=1", "runner.device=cpu")
    assert memory_problem(on_cpu, make_plan(on_cpu)) is None


def test_no_layout_that_fits_says_what_else_to_change():
    cfg = _compose("+recipe=gpt13b", "runner.gpu_memory_gib=4")
    problem = memory_problem(cfg, make_plan(cfg))
    assert problem and "No tp, pp and zero of these 64 ranks fits" in problem


def test_stage_parameters_add_up_to_the_model_and_tensor_parallel_splits_the_blocks():
    assert sum(stage_params(GPT13B, 1, 1, s) for s in range(1)) == count_params(GPT13B)
    head_copy = GPT13B.vocab_size * GPT13B.d_model  # the last stage's copy of the tied embedding
    assert sum(stage_params(GPT13B, 1, 4, s) for s in range(4)) == count_params(GPT13B) + head_copy
    embeddings = (GPT13B.vocab_size + GPT13B.seq_len) * GPT13B.d_model
    blocks = count_params(GPT13B) - embeddings
    assert stage_params(GPT13B, 8, 1, 0) - embeddings == pytest.approx(blocks / 8, rel=1e-3)


def test_memory_items_follow_the_precision_zero_and_pipeline():
    def memory(precision="bf16-mixed", **layout):
        args = {"tp": 8, "pp": 1, "dp": 8, "zero": 1, "micro_batch": 1, "micro_batches": 16, "replicates_shards": False,
                **layout}
        return rank_memory(GPT13B, PRECISIONS[precision], Layout(**args))

    mixed = memory()
    # bf16-mixed trains fp32 weights under autocast: fp32 gradients, no separate master copy
    assert mixed.grads == mixed.params and mixed.master == 0
    assert mixed.moments == pytest.approx(2 * mixed.params / 8)  # two fp32 moments, sharded 8 ways by ZeRO-1
    assert memory(zero=0).moments == pytest.approx(8 * mixed.moments)
    assert memory("32-true").activations > mixed.activations > mixed.recomputed
    assert memory("bf16-true").params == pytest.approx(mixed.params / 2)
    assert mixed.replicas == 0 and memory(replicates_shards=True).replicas > 0
    # 1F1B: the first stage keeps pp micro-batches in flight, the last stage one
    first, last = (stage_memory(GPT13B, PRECISIONS["bf16-mixed"], Layout(8, 4, 2, 1, 1, 16, False), s) for s in (0, 3))
    assert first.pipeline >= 3 * first.activations
    assert last.pipeline < first.activations


@pytest.mark.parametrize("precision", [[], ["trainer.precision=bf16-true", "trainer.master_weights=true"]],
                         ids=["fp32", "master_weights"])
def test_with_ndb_deadpool_and_zero1_the_plan_counts_a_carried_shard_per_rank(precision):
    """An NDB takeover's carrier steps a covered rank's shard with moments (and fp32 masters) of its own, cloned
    from DeadPool's replica (``ZeroOne.carry``): the worst case, one such shard on every rank, is in the plan."""
    def plan(*overrides):
        return make_plan(_compose("+recipe=gpt_tiny", "parallel.nodes=2", "parallel.procs_per_node=2", *precision,
                                  *overrides))

    alone, carrying = plan("parallel.zero=1", "ft=[deadpool]"), plan("parallel.zero=1", "ft=[ndb,deadpool]")
    mem = carrying.memory
    assert alone.memory.carried == 0 and mem.carried == pytest.approx(mem.moments + mem.master)  # its own shard's size
    assert mem.master == (0 if not precision else pytest.approx(mem.moments / 2))
    assert carrying.bytes_per_rank == pytest.approx(alone.bytes_per_rank + mem.carried)
    assert plan("ft=[ndb,deadpool]").memory.carried == 0  # no ZeRO-1: a takeover carries nothing
    cfg = _compose("+recipe=gpt_tiny", "parallel.zero=1", "ft=[ndb,deadpool]")
    assert "a shard carried for NDB" in make_plan(cfg).render(cfg)


def test_deadpool_without_spares_gets_one_spare_node_and_explicit_zero_is_still_refused():
    cfg = _compose("+recipe=gpt_tiny", "ft=deadpool", "parallel.nodes=2")
    validate(cfg)
    plan = make_plan(cfg)
    assert (plan.spares, plan.spares_by_default) == (2, True)  # procs_per_node spares: one node
    assert "spares=2 (one spare node by default for ft=deadpool" in plan.render(cfg)
    with pytest.raises(ConfigError, match="parallel.spares=0"):
        validate(_compose("+recipe=gpt_tiny", "ft=deadpool", "parallel.spares=0"))
    assert make_plan(_compose("+recipe=gpt_tiny")).spares == 0


def test_gpt13b_with_deadpool_prints_its_plan_and_exits_3_without_gpus(run_dir):
    run = run_cli("+recipe=gpt13b", "ft=deadpool", run_dir=run_dir, timeout=120)
    assert run.returncode == 3, run.output[-3000:]
    assert "plan for recipe gpt13b" in run.output and "dp=8 tp=8 pp=1 zero=1" in run.output
    assert "spares=8 (one spare node by default for ft=deadpool" in run.output
    assert re.search(r"memory/rank \d+\.\d GiB of runner.gpu_memory_gib=80", run.output)
    assert "needs 64 GPU" in run.output and "runner.smoke=true" in run.output
    assert not (run_dir / "events.jsonl").exists()


def test_an_over_full_layout_exits_2_before_anything_starts(run_dir):
    run = run_cli("+recipe=gpt13b", "parallel.tp=1", run_dir=run_dir, timeout=120)
    assert run.returncode == 2, run.output[-3000:]
    assert "The smallest change that fits: set parallel.tp=2" in run.output
    assert not (run_dir / "events.jsonl").exists()


def test_gpt13b_with_deadpool_in_smoke_mode_trains_with_the_mix_and_tp_shrunk(run_dir):
    run = run_cli("+recipe=gpt13b", "ft=deadpool", "runner.smoke=true", "trainer.max_steps=3", run_dir=run_dir)
    assert run.summary["status"] == "completed", run.output[-3000:]
    assert run.summary["global_step"] == 3
    assert "parallel.tp 8 -> 1 (the smoke model's heads and the ranks per node allow no more)" in run.output
    tiny = count_params(GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=64, bias=False))
    assert f"model       {tiny / 1e3:.3g} K parameters" in run.output  # the real count, not "0.000 B"
    assert "dp=4 tp=1 pp=1 zero=1, spares=1 (one spare node by default" in run.output
    assert len(run.events("worker_started")) == 5  # 4 ranks and the spare: ft=deadpool as asked
