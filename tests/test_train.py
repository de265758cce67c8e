"""End-to-end training through the real CLI: processes, gloo collectives and the output contract."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.config.registry import recipe_names
from tests.conftest import TWO_BY_TWO, read_summary, run_cli

SUMMARY_KEYS = {"status", "recipe", "ft", "world_size", "global_step", "initial_loss", "final_loss", "tokens_per_s",
                "steps_per_s", "mfu", "wall_s", "param_checksum", "recoveries", "samples_committed", "samples_lost",
                "samples_duplicated"}


@pytest.fixture(scope="module")
def baseline(two_by_two):
    """The fault-free 2 nodes x 2 ranks run that several tests compare against (shared, tests/conftest.py)."""
    return two_by_two


def test_two_nodes_two_ranks_trains_and_follows_the_contract(baseline):
    s = baseline.summary
    assert baseline.returncode == 0, baseline.output[-3000:]
    assert SUMMARY_KEYS <= set(s)
    assert s["status"] == "completed" and s["world_size"] == 4 and s["global_step"] == 30
    assert s["final_loss"] < s["initial_loss"] - 0.5
    assert s["param_checksum"] and len(s["param_checksum"]) == 64  # one checksum: all ranks identical
    assert s["recoveries"] == [] and s["samples_lost"] == 0 and s["samples_duplicated"] == 0
    assert s["samples_committed"] == 30 * 8
    done = baseline.events("worker_done")
    assert sorted(e["logical_rank"] for e in done) == [0, 1, 2, 3]
    for e in baseline.events():
        assert {"t", "step", "rank", "kind"} <= set(e)
    metrics = baseline.metrics()
    assert [m["step"] for m in metrics] == list(range(30))
    assert all(m["counts"] == [1, 1, 1, 1] for m in metrics)
    assert {"loss", "step_time_s", "tokens_per_s"} <= set(metrics[0])


@pytest.mark.slow
def test_same_seed_same_checksum_other_seed_differs(baseline, tmp_path):
    same = run_cli(*TWO_BY_TWO, run_dir=tmp_path / "same")
    other = run_cli(*TWO_BY_TWO, "seed=7", run_dir=tmp_path / "other")
    assert same.summary["param_checksum"] == baseline.summary["param_checksum"]
    assert other.summary["status"] == "completed"
    assert other.summary["param_checksum"] != baseline.summary["param_checksum"]


def test_a_run_never_writes_into_another_runs_directory(baseline):
    before = (baseline.dir / "summary.json").read_bytes(), (baseline.dir / "events.jsonl").read_bytes()
    again = run_cli(*TWO_BY_TWO, run_dir=baseline.dir, timeout=60)
    assert again.returncode == 2 and "already holds a run" in again.output
    assert ((baseline.dir / "summary.json").read_bytes(), (baseline.dir / "events.jsonl").read_bytes()) == before


@pytest.mark.slow
def test_a_lightning_module_we_did_not_write_trains_through_our_strategy(run_dir):
    run = run_cli("+recipe=gpt_tiny", "model._target_=lightning.pytorch.demos.boring_classes.BoringModel",
                  "trainer.max_steps=12", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-3000:]
    assert s["world_size"] == 2 and s["global_step"] == 12 and s["param_checksum"]
    assert s["samples_lost"] == 0


@pytest.mark.slow
def test_csv_logger_writes_metrics(run_dir):
    run = run_cli("+recipe=gpt_tiny", "trainer.max_steps=4", "logger=csv", "trainer.progress_bar=false",
                  run_dir=run_dir, quiet=False)
    assert run.summary["status"] == "completed"
    assert list(Path(run_dir).glob("csv/**/metrics.csv"))


@pytest.mark.slow
def test_multirun_makes_one_dir_per_job_and_no_duplicate_sweep(tmp_path):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    sweep = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "-m", "+recipe=gpt_tiny", "parallel.nodes=1,2", "trainer.max_steps=3",
         "logger=none", "trainer.progress_bar=false", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = sorted(sweep.glob("*/summary.json"))
    assert [p.parent.name for p in summaries] == ["0", "1"]
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", recipe_names())
def test_every_recipe_runs_two_steps_in_smoke_mode(recipe, run_dir):
    run = run_cli(f"+recipe={recipe}", "runner.smoke=true", "trainer.max_steps=2", run_dir=run_dir)
    assert run.summary["status"] == "completed", run.output[-3000:]
    assert run.summary["global_step"] == 2


@pytest.mark.slow  # run time: test_plan.py's gpt13b run with ft=deadpool checks the same exit 3, plan and advice
def test_big_recipe_on_a_host_without_gpus_prints_the_plan_and_exits(run_dir):
    run = run_cli("+recipe=gpt13b", run_dir=run_dir, timeout=60)
    assert run.returncode == 3
    assert "plan for recipe gpt13b" in run.output and "needs 64 GPU" in run.output
    assert "runner.smoke=true" in run.output
    assert not (run_dir / "events.jsonl").exists()


@pytest.mark.slow
def test_wandb_is_the_default_logger_and_runs_offline(run_dir):
    run = run_cli("+recipe=gpt_tiny", "trainer.max_steps=4", "trainer.progress_bar=false", run_dir=run_dir, quiet=False)
    assert run.summary["status"] == "completed", run.output[-3000:]
    runs = list(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0  # the controller's one run for the job


def _torchrun(tmp_path, *overrides: str):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "runner",
         "+recipe=gpt_tiny", "logger=none", "trainer.progress_bar=false", "trainer.max_steps=16",
         f"hydra.run.dir={tmp_path / 'tr'}", *overrides],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )


@pytest.mark.slow  # run time: a variant of what the default tier covers
def test_under_torchrun_each_process_is_one_rank_with_the_same_result(tmp_path):

    local = run_cli("+recipe=gpt_tiny", "trainer.max_steps=16", run_dir=tmp_path / "local")
    proc = _torchrun(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(tmp_path / "tr")
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert summary["param_checksum"] == local.summary["param_checksum"]


@pytest.mark.slow
def test_under_torchrun_a_transient_error_is_retried_in_place(tmp_path):

    proc = _torchrun(tmp_path, "ft=[flashrecovery]", "fault=transient", "fault.rank=1", "fault.step=5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(tmp_path / "tr")
    assert summary["status"] == "completed" and summary["samples_lost"] == 0
    assert [r["action"] for r in summary["recoveries"]] == ["retry"]


@pytest.mark.slow
def test_a_user_datamodule_plugs_in_through_the_config(run_dir):
    run = run_cli("+recipe=gpt_tiny", "model._target_=lightning.pytorch.demos.boring_classes.BoringModel",
                  "data._target_=lightning.pytorch.demos.boring_classes.BoringDataModule", "trainer.max_steps=6",
                  run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-3000:]
    assert s["global_step"] == 6 and s["samples_lost"] == 0 and s["param_checksum"]
