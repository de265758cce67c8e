"""A user's LightningModule is first-class: it runs with no recipe, the plan counts its own parameters, the run is
named after its class, and throughput and MFU are what the module states (samples/s, tokens/s and MFU only where
it says what a sample is and costs)."""

from __future__ import annotations

import re

import pytest

from runner.config import ConfigError
from runner.config.validate import validate
from runner.planning.module_facts import module_facts
from runner.planning.plan import make_plan
from tests.conftest import run_cli
from tests.test_config import _compose
from tests.test_logging import csv_rows

USER = ["model._target_=tests.regressors.StatedRegressor", "data._target_=tests.regressors.RegressionData",
        "trainer.global_batch_size=8", "trainer.max_steps=4", "trainer.progress_bar=false"]


def test_a_user_module_trains_without_a_recipe_and_is_reported_by_what_it_states(run_dir):
    run = run_cli(*USER, "+model.kwargs.hidden=32", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-3000:]
    params = 8 * 32 + 32 + 32 + 1  # Linear(8, 32) and Linear(32, 1)
    assert "plan for StatedRegressor (tests.regressors.StatedRegressor):" in run.output
    assert re.search(rf"model\s+{params}\s+parameters, {6 * params / 1000:.3g} KFLOP per sample", run.output)
    assert "seq 4" in run.output  # its tokens per sample, not model.seq_len's 64
    assert (s["recipe"], s["model"]) == ("none", "StatedRegressor")
    assert s["run_name"] == "StatedRegressor-noft-none-w1x2"
    assert s["samples_per_s"] == pytest.approx(s["samples_committed"] / s["train_s"])
    assert s["tokens_committed"] == 4 * s["samples_committed"] == 4 * 8 * 4
    assert s["tokens_per_s"] == pytest.approx(4 * s["samples_per_s"])
    peak = 1.0e12 * s["world_size"]  # runner.peak_flops_per_rank's default, every rank
    assert s["mfu"] == pytest.approx(6 * params * s["samples_per_s"] / peak)
    for m in run.metrics():  # each step's record: its own rates, tokens because the module says a sample is 4
        assert m["samples_per_s"] == pytest.approx(8 / m["step_time_s"])
        assert m["tokens_per_s"] == pytest.approx(4 * m["samples_per_s"])


def test_a_module_that_states_no_tokens_reports_samples_per_second_each_step(run_dir):
    run = run_cli("model._target_=tests.regressors.ValidatedRegressor", *USER[1:], "trainer.max_steps=3",
                  "logger=csv", run_dir=run_dir, quiet=False)
    assert run.summary["status"] == "completed", run.output[-3000:]
    records = run.metrics()
    assert [m["step"] for m in records] == [0, 1, 2]
    for m in records:
        assert m["tokens_per_s"] is None and m["samples_per_s"] == pytest.approx(8 / m["step_time_s"])
    rows = [r for r in csv_rows(run) if "train/samples_per_s" in r]
    assert [r["global_step"] for r in rows] == [0, 1, 2]
    assert not any("train/tokens_per_s" in r for r in csv_rows(run))


def test_a_module_that_states_nothing_is_counted_on_the_meta_device_and_has_no_flops():
    cfg = _compose("model._target_=tests.regressors.WideRegressor", "+model.kwargs.hidden=100000000")
    validate(cfg, for_training=False)  # no recipe needed with a _target_
    facts = module_facts(cfg)  # 1 B parameters, 4 GB if they were allocated
    assert (facts.name, facts.params) == ("WideRegressor", 8 * 10**8 + 10**8 + 10**8 + 1)
    assert facts.flops_per_sample is None and facts.tokens_per_sample is None
    plan = make_plan(cfg).render(cfg)
    assert "FLOPs unknown (give the module a flops_per_sample attribute for MFU)" in plan
    assert "activations not counted" in plan and "seq " not in plan


def test_the_console_gives_samples_per_second_and_says_mfu_is_unknown(tmp_path):
    from runner.cli import render_summary

    summary = {"status": "completed", "run_name": "WideRegressor-noft-none-w1x2", "global_step": 4,
               "initial_loss": 1.5, "final_loss": 1.25, "steps_per_s": 3.0, "samples_per_s": 24.0,
               "tokens_per_s": None, "mfu": None, "wall_s": 9.0, "train_s": 2.0,
               "effective_training_time_ratio": 1.0, "samples_committed": 32, "samples_lost": 0,
               "samples_duplicated": 0, "param_checksum": "ab", "recoveries": []}
    text = render_summary(summary, tmp_path)
    assert "3.00 steps/s, 24 samples/s, MFU unknown (the module states no flops_per_sample)" in text
    assert "tokens/s" not in text and "None" not in text


def test_without_a_recipe_or_a_module_the_refusal_offers_both():
    with pytest.raises(ConfigError, match=r"No recipe chosen: add \+recipe=NAME, one of: .*, or train your own "
                                          r"LightningModule with model._target_=package.module.Class."):
        validate(_compose(), for_training=False)
