"""Gradient accumulation and manual optimization on real processes: same samples, same result, exact recovery."""

from __future__ import annotations

import math

import pytest

from runner.config import ConfigError
from runner.config.validate import validate
from tests.conftest import run_cli
from tests.test_config import _compose
from tests.test_flashrecovery import assert_exact

TWO = ["+recipe=gpt_tiny", "trainer.max_steps=12"]
FOUR = ["+recipe=gpt_tiny", "parallel.nodes=2", "parallel.procs_per_node=2", "trainer.max_steps=20",
        "ft=[flashrecovery]", "trainer.accumulate_grad_batches=2"]
USER = ["+recipe=gpt_tiny", "model._target_=tests.regressors.ValidatedRegressor",
        "data._target_=tests.regressors.RegressionData", "trainer.global_batch_size=8", "trainer.max_steps=10"]
# Accumulating sums each micro-batch's mean gradient / k instead of taking one mean over the rank's whole batch:
# the same terms added in another order, so float32 rounding (relative ~1e-7 per step) is the only difference; a
# dozen Adam steps keep it far below this tolerance.
ROUNDING = 1e-5


def losses(run) -> list[float]:
    rows = run.metrics()
    assert [m["step"] for m in rows] == list(range(len(rows)))
    return [m["loss"] for m in rows]


def accounting(run) -> tuple:
    s = run.summary
    return s["samples_committed"], s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]


@pytest.mark.slow  # run time: two runs each, left out of the default tier
@pytest.mark.parametrize("k", [2, 4])
def test_accumulation_equals_the_bigger_micro_batch(k, tmp_path):
    whole = run_cli(*TWO, run_dir=tmp_path / "whole")
    split = run_cli(*TWO, f"trainer.accumulate_grad_batches={k}", run_dir=tmp_path / "split")
    for run in (whole, split):
        assert run.summary["status"] == "completed", run.output[-3000:]
    assert losses(split) == pytest.approx(losses(whole), rel=ROUNDING)
    assert accounting(split) == accounting(whole) == (96, 0, 0, 0)
    assert [m["counts"] for m in split.metrics()] == [[1, 1]] * 12  # one reduction per optimizer step
    assert split.summary["tokens_committed"] == whole.summary["tokens_committed"]


@pytest.mark.slow
def test_accumulation_over_a_map_style_dataset_equals_the_bigger_micro_batch(tmp_path):
    whole = run_cli(*USER, run_dir=tmp_path / "whole")
    split = run_cli(*USER, "trainer.accumulate_grad_batches=2", run_dir=tmp_path / "split")
    for run in (whole, split):
        assert run.summary["status"] == "completed", run.output[-3000:]
    assert losses(split) == pytest.approx(losses(whole), rel=ROUNDING)
    assert accounting(split) == accounting(whole)


@pytest.mark.slow
def test_accumulation_under_kill_rank_is_bit_identical_to_its_fault_free_run(tmp_path):
    clean = run_cli(*FOUR, run_dir=tmp_path / "clean")
    assert clean.summary["status"] == "completed", clean.output[-3000:]
    killed = run_cli(*FOUR, "fault=kill_rank", "fault.rank=1", "fault.step=9", run_dir=tmp_path / "killed")
    assert_exact(killed, clean.summary, recoveries=1)
    assert losses(killed) == losses(clean)


@pytest.mark.slow
def test_manual_optimization_logs_the_loss_of_the_current_step(tmp_path):
    no_clip = ["trainer.grad_clip=0"]
    auto = run_cli(*USER, *no_clip, run_dir=tmp_path / "auto")
    manual = run_cli(*USER, *no_clip, "model._target_=tests.regressors.ManualRegressor", run_dir=tmp_path / "manual")
    for run in (auto, manual):
        assert run.summary["status"] == "completed", run.output[-3000:]
    assert math.isfinite(losses(manual)[0])
    assert losses(manual) == pytest.approx(losses(auto), rel=1e-6)
    assert manual.summary["param_checksum"] == auto.summary["param_checksum"]


@pytest.mark.parametrize("overrides, expected", [
    (["trainer.grad_clip=0", "trainer.accumulate_grad_batches=2"], "trainer.accumulate_grad_batches=2 needs automatic"),
    ([], "trainer.grad_clip=1.0 needs automatic optimization"),
])
@pytest.mark.slow
def test_manual_optimization_with_what_it_cannot_do_fails_at_start_saying_why(overrides, expected, run_dir):
    run = run_cli(*USER, "model._target_=tests.regressors.ManualRegressor", "trainer.max_steps=2", *overrides,
                  run_dir=run_dir)
    assert run.returncode != 0 and run.summary["status"] == "failed"
    assert expected in run.output
    assert run.metrics() == []


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0 must be >= 1"),
        (["trainer.accumulate_grad_batches=3"], "must be divisible by the data-parallel size 2 x "
                                                "trainer.accumulate_grad_batches=3"),
    ],
)
def test_accumulation_that_cannot_split_the_batch_is_refused(overrides, expected):
    with pytest.raises(ConfigError) as err:
        validate(_compose("+recipe=gpt_tiny", *overrides))
    assert expected in str(err.value)
