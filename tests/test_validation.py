"""Validation on real processes: val/loss at the configured steps, sharded over DP, exact across a recovery."""

from __future__ import annotations

import math

import numpy as np
import pytest

from runner.config import ConfigError
from runner.config.validate import validate
from tests.conftest import run_cli
from tests.test_config import _compose

FOUR = ["+recipe=gpt_tiny", "parallel.nodes=2", "parallel.procs_per_node=2", "trainer.max_steps=16",
        "ft=[flashrecovery]"]
# 6 validation batches over 4 ranks: ranks 0 and 1 take two, ranks 2 and 3 one
VAL = ["trainer.val_check_interval=5", "trainer.limit_val_batches=6"]
USER = ["+recipe=gpt_tiny", "model._target_=tests.regressors.ValidatedRegressor",
        "data._target_=tests.regressors.RegressionData", "trainer.global_batch_size=8", "trainer.max_steps=9"]


def val_losses(run) -> dict[int, float]:
    """By step: the validations at steps, and the final weights' after fit (at the step after the last)."""
    return {m["step"]: m["val/loss"] for m in run.records() if "val/loss" in m}


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    run = run_cli(*FOUR, *VAL, run_dir=tmp_path_factory.mktemp("ff") / "run")
    assert run.summary["status"] == "completed", run.output[-3000:]
    return run


def test_val_loss_appears_at_the_configured_interval(fault_free):
    losses = val_losses(fault_free)
    assert sorted(losses) == [5, 10, 15, 16]  # 16: the final weights, validated once after the last step
    assert all(math.isfinite(v) and 0 < v < 10 for v in losses.values())
    assert losses[15] < losses[5]  # the model learns the held-out chain too
    assert fault_free.summary["val"] == {"val/loss": losses[16]}


@pytest.mark.slow
def test_validation_does_not_change_training(fault_free, run_dir):
    plain = run_cli(*FOUR, run_dir=run_dir)
    assert plain.summary["param_checksum"] == fault_free.summary["param_checksum"]
    assert not val_losses(plain)


@pytest.mark.slow
def test_a_replacement_validates_its_share_and_val_loss_stays_exact(fault_free, run_dir):
    # the kill is at a validation step: the survivors' shares ride in the retried reduction, the joiner computes
    # the killed rank's share from the same committed weights
    run = run_cli(*FOUR, *VAL, "fault=kill_rank", "fault.rank=2", "fault.step=10", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed" and len(s["recoveries"]) == 1, run.output[-3000:]
    assert s["param_checksum"] == fault_free.summary["param_checksum"]
    assert val_losses(run) == val_losses(fault_free)


@pytest.mark.slow
def test_a_user_validation_step_is_sharded_and_averaged_over_ranks(tmp_path):
    """The whole val_dataloader (5 batches) over 2 ranks averages to what one rank computes alone: the same
    samples train both (the steps' rows do not depend on the layout), so the weights agree up to the order of
    the gradient sums, and the validation losses up to float32 rounding of that."""
    one = run_cli(*USER, "parallel.procs_per_node=1", "trainer.val_check_interval=3", run_dir=tmp_path / "one")
    two = run_cli(*USER, "trainer.val_check_interval=3", run_dir=tmp_path / "two")
    for run in (one, two):
        assert run.summary["status"] == "completed", run.output[-3000:]
    assert sorted(val_losses(two)) == [3, 6, 9]
    assert val_losses(two) == pytest.approx(val_losses(one), rel=1e-5)


@pytest.mark.slow
def test_a_validation_step_without_an_interval_is_reported_at_start(run_dir):
    run = run_cli(*USER, "trainer.max_steps=2", run_dir=run_dir)
    assert run.summary["status"] == "completed"
    warned = [line for line in run.output.splitlines() if "validation_step is not run" in line]
    assert len(warned) == 1 and "trainer.val_check_interval" in warned[0]


@pytest.mark.slow
def test_memmap_data_validates_on_its_separate_held_out_file(tmp_path):
    rng = np.random.default_rng(0)
    train, held_out = tmp_path / "train.bin", tmp_path / "val.bin"
    rng.integers(0, 256, 20_000, dtype=np.uint16).tofile(train)
    rng.integers(0, 256, 5_000, dtype=np.uint16).tofile(held_out)
    data = ["data.kind=memmap", f"data.path={train}", f"data.val_path={held_out}"]
    run = run_cli("+recipe=gpt_tiny", "trainer.max_steps=7", *data, "trainer.val_check_interval=3",
                  "trainer.limit_val_batches=2", run_dir=tmp_path / "run")
    assert run.summary["status"] == "completed", run.output[-3000:]
    losses = val_losses(run)
    assert sorted(losses) == [3, 6, 7] and all(math.isfinite(v) for v in losses.values())


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["trainer.val_check_interval=5"], "set trainer.limit_val_batches"),
        (["trainer.limit_val_batches=4"], "trainer.limit_val_batches=4 is ignored without validation"),
        (["trainer.val_check_interval=-1"], "must be >= 0"),
        (["data.val_path=/tmp/val.bin"], "data.val_path=/tmp/val.bin is read only by validation"),
        (["data.kind=memmap", "data.path=/etc/hostname", "trainer.val_check_interval=5",
          "trainer.limit_val_batches=4"], "data.val_path=None is not a file"),
    ],
)
def test_validation_keys_that_cannot_work_are_refused(overrides, expected):
    cfg = _compose("+recipe=gpt_tiny", *overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert expected in str(err.value)


def test_a_validation_step_that_logs_and_returns_nothing_records_what_it_logs(tmp_path):
    """Lightning's idiom: validation runs at its steps and after the last, adds no val/loss of the runner's, and
    what it logs is recorded under its own name, the mean over all 5 validation batches of both ranks."""
    run = run_cli(*USER, "model._target_=tests.regressors.LoggingOnlyRegressor", "trainer.val_check_interval=3",
                  run_dir=tmp_path / "run")
    assert run.returncode == 0, run.output[-3000:]
    assert (run.summary["status"], run.summary["global_step"]) == ("completed", 9)
    assert not val_losses(run)
    logged = {m["step"]: m["val_loss"] for m in run.records() if "val_loss" in m}
    assert sorted(logged) == [3, 6, 9] and all(math.isfinite(v) for v in logged.values())
    assert run.summary["val"] == {"val_loss": logged[9]}
    assert "not recorded" not in run.output
