"""What a module logs (``self.log``, ``self.log_dict``) and the learning rate reach metrics.jsonl, the CSV logger and
the W&B run under their own names, once per committed step, with the committed values: a rank killed mid-run
changes none of them (real processes, FlashRecovery, compared with the fault-free run), epoch values and what a
validation_step that only logs (Lightning's idiom) logs included."""

from __future__ import annotations

import csv

import pytest

from tests.conftest import run_cli
from tests.test_wandb_run import _number, read_wandb_run

MAX_STEPS, LOG_EVERY, VAL_EVERY = 20, 3, 5
USER = ["+recipe=gpt_tiny", "model._target_=tests.regressors.LoggingValidatingRegressor",
        "data._target_=tests.regressors.RegressionData", "trainer.global_batch_size=8",
        f"trainer.max_steps={MAX_STEPS}", "parallel.nodes=2", "parallel.procs_per_node=2", "ft=[flashrecovery]",
        f"trainer.log_every_n_steps={LOG_EVERY}", f"trainer.val_check_interval={VAL_EVERY}",
        "trainer.progress_bar=false"]
KILLED = ["fault=kill_rank", "fault.rank=1", "fault.step=6"]
# LoggingRegressor's values at every step (on_step), and at the epoch's end (on_epoch: its last step)
STEP_NAMES = {"train/lr", "my/mae", "my/rank_loss", "my/pred_max", "my/loss_mean", "my/loss_peak", "my/both_step"}
EPOCH_NAMES = {"my/epoch_loss", "my/both_epoch"}
LOGGED = STEP_NAMES | EPOCH_NAMES
# what its validation_step logs (sync_dist: over every rank's validation batches), at steps 5, 10, 15 and after fit
VAL_NAMES = {"val/mse", "val/worst"}
VAL_STEPS = [*range(VAL_EVERY, MAX_STEPS, VAL_EVERY), MAX_STEPS]
# what stays the same whichever rank dies: the values reduced over the ranks (sync_dist) and the learning rate
SYNCED = {"train/lr", "my/mae", "my/loss_mean", "my/loss_peak", "my/epoch_loss"}


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    run = run_cli(*USER, "logger=csv", run_dir=tmp_path_factory.mktemp("ff") / "run", quiet=False)
    assert run.summary["status"] == "completed", run.output[-3000:]
    return run


def killed(run_dir, logger: str):
    run = run_cli(*USER, *KILLED, f"logger={logger}", run_dir=run_dir, quiet=False)
    s = run.summary
    assert s["status"] == "completed" and len(s["recoveries"]) == 1, run.output[-3000:]
    return run


def logged(record: dict, names: set[str] = LOGGED) -> dict:
    return {k: v for k, v in record.items() if k in names}


def csv_rows(run) -> list[dict]:
    with open(run.dir / "csv" / "metrics.csv", newline="") as f:
        return [{k: _number(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def logger_rows(rows: list[dict], names: set[str] = LOGGED) -> dict[int, dict]:
    """The rows holding logged values, by step (a step's second row would fail the test)."""
    out: dict[int, dict] = {}
    for row in rows:
        values = logged(row, names)
        if values:
            assert row["global_step"] not in out, f"step {row['global_step']} logged twice"
            out[row["global_step"]] = values
    return out


def test_every_value_logged_at_a_step_is_in_its_record(fault_free):
    records = fault_free.metrics()
    assert [m["step"] for m in records] == list(range(MAX_STEPS))
    for m in records:
        assert STEP_NAMES <= set(m) and "my/bar_only" not in m  # logger=False stays in the progress bar
        assert m["train/lr"] == 0.05 * 0.5 ** (m["step"] // 4)  # StepLR(step_size=4, gamma=0.5), per step
        # sync_dist: the DP mean, as the runner's own loss; reduce_fx="max": the largest rank's; no sync: rank 0's
        assert m["my/loss_mean"] == pytest.approx(m["loss"], rel=1e-6)
        assert m["my/loss_peak"] >= m["my/rank_loss"] == m["my/both_step"]
    assert any(m["my/loss_peak"] > m["my/loss_mean"] for m in records)
    last = records[-1]
    assert EPOCH_NAMES <= set(last) and sorted(last["epoch_metrics"]) == sorted(EPOCH_NAMES)
    assert not any(EPOCH_NAMES & set(m) for m in records[:-1])
    # on_epoch: the mean of the epoch's steps, over every rank's batches with sync_dist, rank 0's own without
    assert last["my/epoch_loss"] == pytest.approx(sum(m["loss"] for m in records) / MAX_STEPS, rel=1e-5)
    assert last["my/both_epoch"] == pytest.approx(sum(m["my/rank_loss"] for m in records) / MAX_STEPS, rel=1e-5)
    # the logging-only validation_step: its values in the records of the steps that validated and after fit
    validated = [m for m in fault_free.records() if VAL_NAMES & set(m)]
    assert [m["step"] for m in validated] == VAL_STEPS and all(VAL_NAMES <= set(m) for m in validated)
    assert [m["step"] for m in fault_free.after_fit()] == [MAX_STEPS]
    assert all(m["val/worst"] ** 2 >= m["val/mse"] for m in validated)  # the largest error, the mean squared one


def test_a_killed_rank_changes_no_logged_value_in_metrics_jsonl_or_csv(fault_free, tmp_path):
    run = killed(tmp_path / "run", "csv")
    assert run.summary["param_checksum"] == fault_free.summary["param_checksum"]
    records = run.metrics()
    assert [m["step"] for m in records] == list(range(MAX_STEPS))  # the redone step once
    assert [logged(m) for m in records] == [logged(m) for m in fault_free.metrics()]

    assert [logged(m, VAL_NAMES) for m in run.records()] == [logged(m, VAL_NAMES) for m in fault_free.records()]
    val_rows = logger_rows(csv_rows(run), VAL_NAMES)
    assert sorted(val_rows) == VAL_STEPS and val_rows == logger_rows(csv_rows(fault_free), VAL_NAMES)

    rows = logger_rows(csv_rows(run))
    assert rows == logger_rows(csv_rows(fault_free))
    # every LOG_EVERY steps all of them, the epoch's values at its last step whatever the cadence
    assert sorted(rows) == [*range(0, MAX_STEPS, LOG_EVERY), MAX_STEPS - 1]
    by_step = {m["step"]: logged(m) for m in records}
    for step, values in rows.items():
        want = by_step[step] if step % LOG_EVERY == 0 else {k: by_step[step][k] for k in EPOCH_NAMES}
        assert values == pytest.approx(want, rel=1e-6), step


def test_the_wandb_run_of_a_killed_rank_holds_the_fault_free_values(fault_free, tmp_path):
    run = killed(tmp_path / "run", "wandb")
    assert run.summary["param_checksum"] == fault_free.summary["param_checksum"]
    wandb_rows = read_wandb_run(run.dir).rows
    assert logger_rows(wandb_rows) == logger_rows(csv_rows(fault_free))
    assert logger_rows(wandb_rows, VAL_NAMES) == logger_rows(csv_rows(fault_free), VAL_NAMES)
    assert [m["step"] for m in run.metrics()] == list(range(MAX_STEPS))


def test_synced_values_stay_the_same_when_the_rank_that_records_them_dies(fault_free, tmp_path):
    """Rank 0 writes the records; its replacement joins with the epoch's accumulations of a survivor. Without
    sync_dist a value is the recording rank's own, which is another rank's for a while (docs/outputs.md)."""
    run = run_cli(*USER, "fault=kill_rank", "fault.rank=0", "fault.step=6", run_dir=tmp_path / "run")
    assert run.summary["param_checksum"] == fault_free.summary["param_checksum"], run.output[-3000:]
    records = run.metrics()
    assert [m["step"] for m in records] == list(range(MAX_STEPS))
    assert [logged(m, SYNCED) for m in records] == [logged(m, SYNCED) for m in fault_free.metrics()]


def test_a_logged_name_the_runner_records_itself_is_refused(tmp_path):
    run = run_cli(*USER, "parallel.nodes=1", "parallel.procs_per_node=1", "ft=[]", "trainer.max_steps=2",
                  "model._target_=tests.regressors.LossLoggingRegressor", run_dir=tmp_path / "run")
    assert run.returncode != 0
    assert "The module logs ['loss'], a name the runner gives a field of metrics.jsonl" in run.output


def test_a_step_the_corruption_guard_recomputes_is_accumulated_once(fault_free, tmp_path):
    """The recomputed step's training_step logs again: its epoch values (synced or not) count it once."""
    run = run_cli(*USER, "fault=bitflip", "fault.rank=1", "fault.step=14", run_dir=tmp_path / "run")
    assert run.summary["sdc_recomputed_steps"] == [14], run.output[-3000:]
    assert run.summary["param_checksum"] == fault_free.summary["param_checksum"]
    assert [logged(m) for m in run.metrics()] == [logged(m) for m in fault_free.metrics()]
