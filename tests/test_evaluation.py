"""Validation and test as Lightning does them, on real processes: what validation_step and on_validation_epoch_end log
is recorded once per validation (metrics.jsonl, the logger, ``trainer.callback_metrics`` at a callback's
on_validation_end), the final weights are validated after the last step and tested with ``runner.test_after_fit``,
and a rank killed mid-run (FlashRecovery, at a validation step) changes none of those values."""

from __future__ import annotations

import csv
import json

import pytest

from runner.config import ConfigError
from runner.config.validate import validate
from runner.training.validation import StepValidation
from tests.conftest import run_cli
from tests.test_config import _compose

STEPS = 9
USER = ["model._target_=tests.regressors.EvaluatedRegressor", "data._target_=tests.regressors.RegressionTestData",
        "trainer.global_batch_size=8", f"trainer.max_steps={STEPS}", "trainer.val_check_interval=3",
        "runner.test_after_fit=true", "parallel.nodes=2", "parallel.procs_per_node=2", "ft=[flashrecovery]"]
# the validation batches of 8 rows (5 of them) over 4 ranks: rank 0 takes two, the others one
VAL_NAMES = {"val/loss", "val/mae", "val/rows", "val/worst", "val/count", "val/rank0_mae", "val/ranks"}


def evaluated(tmp_path, *more: str):
    seen = tmp_path / "seen.jsonl"
    run = run_cli(*USER, f"+model.kwargs.seen={seen}", *more, run_dir=tmp_path / "run", quiet="logger=csv" not in more)
    assert run.summary["status"] == "completed", run.output[-3000:]
    return run, [json.loads(line) for line in seen.read_text().splitlines()]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    """With the CSV logger, and rank 0's progress bar (whose own validation hooks are not called)."""
    return evaluated(tmp_path_factory.mktemp("ff"), "logger=csv", "trainer.progress_bar=true")


def validations(run) -> dict[int, dict]:
    """Every record holding a validation's values, by step (the one after fit at the step after the last)."""
    return {m["step"]: {k: v for k, v in m.items() if k.startswith("val/")} for m in run.records()
            if "val_metrics" in m}


def test_what_validation_logs_is_recorded_once_per_validation_and_after_the_last_step(fault_free):
    run, _ = fault_free
    found = validations(run)
    assert sorted(found) == [3, 6, STEPS]
    for values in found.values():
        assert set(values) == VAL_NAMES  # val/hidden is logged with logger=False
        assert values["val/count"] == 40  # reduce_fx=sum over every rank's batches, sync_dist
        assert values["val/rows"] == 8  # a batch-size-weighted mean of 8s
        assert values["val/ranks"] == 4  # on_validation_epoch_end: once per rank, summed
        assert values["val/worst"] > values["val/mae"]  # reduce_fx=max
    assert found[STEPS]["val/loss"] < found[3]["val/loss"]
    [after] = run.after_fit()
    assert after["step"] == STEPS and run.summary["val"] == found[STEPS]
    with open(run.dir / "csv" / "metrics.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("val/mae")]
    assert [int(row["global_step"]) for row in rows] == [3, 6, STEPS]  # the logger: once per validation


def test_callbacks_see_the_committed_values_at_on_validation_end(fault_free):
    """The hooks run once the step that carried the validation committed (global_step one more), and after fit."""
    run, seen = fault_free
    found = validations(run)
    assert [s["global_step"] for s in seen] == [4, 7, STEPS]
    for i, (s, (step, values)) in enumerate(zip(seen, sorted(found.items()))):
        assert {k: s[k] for k in values} == pytest.approx(values, rel=1e-6), step
        assert "val/hidden" in s  # logger=False still reaches callback_metrics
        # Lightning's EarlyStopping checked val/loss at each on_validation_end (before the recording callback)
        assert s["early_stopping_best"] == min(x["val/loss"] for x in seen[: i + 1])


def test_test_after_fit_reports_what_test_step_logs(fault_free):
    run, _ = fault_free
    test = run.summary["test"]
    assert set(test) == {"test/mae", "test/count"} and test["test/count"] == 40
    [after] = run.after_fit()
    assert {k: after[k] for k in test} == test


@pytest.mark.slow
def test_a_rank_killed_at_a_validation_step_changes_no_evaluation_value(fault_free, tmp_path):
    run, seen = evaluated(tmp_path, "fault=kill_rank", "fault.rank=1", "fault.step=6")
    reference, reference_seen = fault_free
    assert len(run.summary["recoveries"]) == 1, run.output[-3000:]
    assert run.summary["param_checksum"] == reference.summary["param_checksum"]
    assert validations(run) == validations(reference)
    assert seen == reference_seen
    assert (run.summary["val"], run.summary["test"]) == (reference.summary["val"], reference.summary["test"])


def test_a_fraction_of_an_epoch_validates_within_each_epoch_as_lightning_counts():
    """An epoch of 32 steps and 0.3 of it: every 9 steps within the epoch (Lightning's int(32 * 0.3)), again from
    the epoch's start."""
    validation = StepValidation(0.3, 0)
    validation.set_epoch_steps(32)
    assert [s for s in range(1, 80) if validation.due(s)] == [9, 18, 27, 41, 50, 59, 73]


def test_a_fraction_of_an_epoch_of_a_user_dataset(run_dir):
    """256 rows of 8 per step: 32 steps an epoch, a quarter of it every 8 steps."""
    run = run_cli("model._target_=tests.regressors.ValidatedRegressor", "data._target_=tests.regressors.RegressionData",
                  "trainer.global_batch_size=8", "trainer.max_steps=17", "trainer.val_check_interval=0.25",
                  "trainer.progress_bar=false", run_dir=run_dir)
    assert run.summary["status"] == "completed", run.output[-3000:]
    assert sorted(m["step"] for m in run.records() if "val/loss" in m) == [8, 16, 17]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["+recipe=gpt_tiny", "trainer.val_check_interval=0.5", "trainer.limit_val_batches=4"],
         "the built-in data has no epochs"),
        (["model._target_=tests.regressors.ValidatedRegressor", "data._target_=tests.regressors.RegressionData",
          "trainer.val_check_interval=1.5"], "a fraction of an epoch in (0, 1]"),
        (["+recipe=gpt_tiny", "runner.test_after_fit=true"], "the built-in GPT has none"),
        (["model._target_=tests.regressors.ValidatedRegressor", "data._target_=tests.regressors.RegressionTestData",
          "runner.test_after_fit=true"], "ValidatedRegressor has no test_step()"),
        (["model._target_=tests.regressors.EvaluatedRegressor", "data._target_=tests.regressors.RegressionData",
          "runner.test_after_fit=true"], "neither RegressionData nor EvaluatedRegressor defines test_dataloader()"),
    ],
)
def test_evaluation_keys_that_cannot_work_are_refused(overrides, expected):
    with pytest.raises(ConfigError) as err:
        validate(_compose(*overrides))
    assert expected in str(err.value)
