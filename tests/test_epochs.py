"""``trainer.max_epochs`` over a finite dataset: Lightning's epochs (current_epoch, the epoch hooks, the sampler's
set_epoch) on real processes, every row once per epoch over the DP ranks, in the sampler's order, and the same
rows, epochs and checksum after a rank is killed mid-epoch (or at an epoch boundary) or a run is resumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runner.config import ConfigError
from runner.config.validate import validate
from runner.data import IndexedDatasetSource, StepLoader, shuffle_seed
from tests.conftest import run_cli
from tests.test_config import _compose

ROWS, BATCH, DP, EPOCHS = 68, 8, 2, 2  # 8 steps an epoch: 64 rows, the last 4 left out (drop_last)
STEPS_PER_EPOCH = ROWS // BATCH
SAMPLER_SEED = 7  # tests.regressors.IndexedData's DistributedSampler seed
EPOCHS_OF = ["model._target_=tests.regressors.IndexRecordingRegressor", "data._target_=tests.regressors.IndexedData",
             f"+data.kwargs.rows={ROWS}", f"trainer.global_batch_size={BATCH}", "trainer.max_steps=100",
             f"trainer.max_epochs={EPOCHS}"]
EPOCHS_RUN = [*EPOCHS_OF, "ft=[flashrecovery]"]
SHUFFLED = [*EPOCHS_RUN, "+data.kwargs.sampler=distributed"]


def train(tmp: Path, *overrides: str):
    """A run whose module records the rows of every step and the epochs of its hooks under ``tmp / 'rows'``."""
    run = run_cli(*overrides, f"+model.kwargs.record_dir={tmp / 'rows'}", run_dir=tmp / "run")
    assert run.summary["status"] == "completed", run.output[-3000:]
    return run, Records(tmp / "rows")


class Records:
    """What every process of a run (a replacement's too) recorded."""

    def __init__(self, folder: Path) -> None:
        self.by_process = [[json.loads(line) for line in f.read_text().splitlines()]
                           for f in sorted(folder.glob("*.jsonl"))]

    def rows(self) -> dict[tuple[int, int], list[int]]:
        """The rows of each (step, data rank); a step that recovery ran again read the same rows."""
        out: dict[tuple[int, int], list[int]] = {}
        for entry in (e for p in self.by_process for e in p if e["kind"] == "step"):
            key = (entry["step"], entry["rank"])
            assert out.setdefault(key, entry["idx"]) == entry["idx"], f"step {key} read other rows when run again"
            assert entry["epoch"] == entry["step"] // STEPS_PER_EPOCH, entry
            assert entry["batch_idx"] == entry["step"] % STEPS_PER_EPOCH, entry
        return out

    def epoch_order(self, epoch: int) -> list[int]:
        """The rows of ``epoch`` in the order its steps and ranks read them."""
        rows = self.rows()
        return [i for step in range(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH)
                for rank in range(DP) for i in rows[(step, rank)]]

    def hooks(self, kind: str) -> list[list[tuple]]:
        """Per process, the (epoch, global_step[, sampler epoch]) its on_train_epoch_start or _end saw."""
        return [[(e["epoch"], e["step"], *([e["sampler_epoch"]] if kind == "epoch_start" else []))
                 for e in p if e["kind"] == kind] for p in self.by_process]


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    return train(tmp_path_factory.mktemp("sequential"), *EPOCHS_RUN)


@pytest.fixture(scope="module")
def shuffled(tmp_path_factory):
    return train(tmp_path_factory.mktemp("shuffled"), *SHUFFLED)


def test_max_epochs_trains_every_row_once_an_epoch_and_lightning_sees_each_epoch(sequential):
    run, records = sequential
    s = run.summary
    assert s["global_step"] == EPOCHS * STEPS_PER_EPOCH  # before trainer.max_steps=100
    assert (s["samples_committed"], s["samples_lost"], s["samples_duplicated"]) == (EPOCHS * STEPS_PER_EPOCH * BATCH,
                                                                                     0, 0)
    assert len(records.by_process) == DP
    ends = [(e, (e + 1) * STEPS_PER_EPOCH) for e in range(EPOCHS)]
    assert records.hooks("epoch_end") == [ends] * DP
    assert records.hooks("epoch_start") == [[(e, e * STEPS_PER_EPOCH, None) for e in range(EPOCHS)]] * DP
    for epoch in range(EPOCHS):  # unshuffled: the dataset's own order, the rows past the last full step left out
        assert records.epoch_order(epoch) == list(range(STEPS_PER_EPOCH * BATCH))
    assert_epoch_values(run, records)


def assert_epoch_values(run, records: Records) -> None:
    """An on_epoch value is per epoch: at each epoch's last step, the mean over that epoch's rows only."""
    logged = {m["step"]: m for m in run.metrics() if "epoch_metrics" in m}
    assert sorted(logged) == [(e + 1) * STEPS_PER_EPOCH - 1 for e in range(EPOCHS)]
    for epoch in range(EPOCHS):
        order = records.epoch_order(epoch)
        assert logged[(epoch + 1) * STEPS_PER_EPOCH - 1]["rows/mean_index"] == pytest.approx(sum(order) / len(order))


def test_a_shuffling_sampler_draws_a_permutation_per_epoch_and_is_set_to_each_epoch(shuffled):
    run, records = shuffled
    assert run.summary["global_step"] == EPOCHS * STEPS_PER_EPOCH
    orders = [records.epoch_order(e) for e in range(EPOCHS)]
    assert orders[0] != orders[1]
    for epoch, order in enumerate(orders):  # the DistributedSampler's own permutation of the epoch, drop_last
        g = torch.Generator().manual_seed(SAMPLER_SEED + epoch)
        assert order == torch.randperm(ROWS, generator=g).tolist()[: STEPS_PER_EPOCH * BATCH]
    starts = [(e, e * STEPS_PER_EPOCH, e) for e in range(EPOCHS)]  # Lightning called its set_epoch(e)
    assert records.hooks("epoch_start") == [starts] * DP
    assert_epoch_values(run, records)


def assert_same_training(run, records: Records, clean) -> None:
    clean_run, clean_records = clean
    s, c = run.summary, clean_run.summary
    assert len(s["recoveries"]) == 1 and s["recoveries"][0]["rpo_steps"] == 0, s["recoveries"]
    assert (s["global_step"], s["param_checksum"], s["samples_committed"]) == (
        c["global_step"], c["param_checksum"], c["samples_committed"])
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    assert records.rows() == clean_records.rows()
    assert_epoch_values(run, records)


@pytest.mark.parametrize("step", [10, pytest.param(STEPS_PER_EPOCH, marks=pytest.mark.slow)],
                         ids=["mid_epoch", "first_step_of_an_epoch"])
def test_a_rank_killed_in_an_epoch_is_replaced_in_that_epoch_and_trains_the_same(shuffled, tmp_path, step):
    run, records = train(tmp_path, *SHUFFLED, "fault=kill_rank", "fault.rank=1", f"fault.step={step}")
    assert_same_training(run, records, shuffled)
    survivor, killed, replacement = _by_role(records)
    ends = [(e, (e + 1) * STEPS_PER_EPOCH) for e in range(EPOCHS)]
    assert [(e["epoch"], e["step"]) for e in survivor if e["kind"] == "epoch_end"] == ends
    epoch = step // STEPS_PER_EPOCH  # the replacement continues the victim's epoch: its end hooks from there on
    assert [(e["epoch"], e["step"]) for e in replacement if e["kind"] == "epoch_end"] == ends[epoch:]
    first = next(e for e in replacement if e["kind"] == "step")
    assert (first["step"], first["epoch"], first["batch_idx"]) == (step, epoch, step % STEPS_PER_EPOCH)
    assert killed and all(e["step"] <= step for e in killed if e["kind"] == "step")


@pytest.mark.slow
def test_every_rank_restored_from_a_snapshot_mid_epoch_trains_the_same(shuffled, tmp_path):
    run, records = train(tmp_path, *EPOCHS_OF, "+data.kwargs.sampler=distributed", "ft=[flash_ckpt]",
                         "ft.flash_ckpt.every_n_steps=3", "ft.flash_ckpt.persist_every_n_steps=0", "fault=kill_rank",
                         "fault.rank=1", "fault.step=11")
    s, c = run.summary, shuffled[0].summary
    assert [(r["action"], r["rpo_steps"]) for r in s["recoveries"]] == [("restart_all", 2)]  # from step 9's snapshot
    assert (s["global_step"], s["param_checksum"]) == (c["global_step"], c["param_checksum"])
    assert records.rows() == shuffled[1].rows()
    assert_epoch_values(run, records)


def _by_role(records: Records) -> tuple[list, list, list]:
    """The survivor (rank 0), the killed rank 1 and its replacement (which started at the kill)."""
    def first_step(process: list) -> int:
        return next(e["step"] for e in process if e["kind"] == "step")

    rank0 = [p for p in records.by_process if any(e["kind"] == "step" and e["rank"] == 0 for e in p)]
    rank1 = sorted((p for p in records.by_process if p not in rank0), key=first_step)
    assert len(rank0) == 1 and len(rank1) == 2, [len(p) for p in records.by_process]
    return rank0[0], rank1[0], rank1[1]


@pytest.mark.slow
def test_a_run_resumed_mid_epoch_from_its_checkpoint_trains_the_same(shuffled, tmp_path):
    first, _ = train(tmp_path / "first", *SHUFFLED, "trainer.max_steps=10")
    assert first.summary["global_step"] == 10
    assert "trainer.max_steps=10 ends the run before trainer.max_epochs=2 (2 x 8 steps)" in first.output
    resumed, records = train(tmp_path / "resumed", *SHUFFLED, f"runner.resume={first.dir}")
    s, c = resumed.summary, shuffled[0].summary
    assert (s["global_step"], s["param_checksum"]) == (c["global_step"], c["param_checksum"])
    rows = shuffled[1].rows()
    assert records.rows() == {key: idx for key, idx in rows.items() if key[0] >= 10}
    ends = [(e, (e + 1) * STEPS_PER_EPOCH) for e in range(EPOCHS)]
    assert records.hooks("epoch_end") == [ends[1:]] * DP
    last = STEPS_PER_EPOCH * EPOCHS - 1  # the epoch value over the whole epoch, the first run's steps included
    clean_values = {m["step"]: m for m in shuffled[0].metrics()}
    assert [m for m in resumed.metrics() if m["step"] == last][0]["rows/mean_index"] == clean_values[last][
        "rows/mean_index"]


def test_max_epochs_with_the_built_in_data_is_refused_at_config_time():
    with pytest.raises(ConfigError, match=r"trainer.max_epochs=2 counts passes over a finite training set, but the "
                                          r"built-in data \(data.kind=synthetic\) draws each step's batch afresh"):
        validate(_compose("+recipe=gpt_tiny", "trainer.max_epochs=2"), for_training=False)


def test_a_fault_after_the_last_epoch_fails_the_run_before_its_first_step(tmp_path):
    """The configuration check passes a fault before trainer.max_steps=100; the epochs end the run at step 16,
    which the workers learn from the training set: the run fails naming the fault instead of completing without
    it, and no step was trained."""
    end = EPOCHS * STEPS_PER_EPOCH
    run = run_cli(*EPOCHS_RUN, "fault=kill_rank", "fault.rank=1", f"fault.step={end}",
                  f"+model.kwargs.record_dir={tmp_path / 'rows'}", run_dir=tmp_path / "run")
    assert run.returncode != 0
    assert run.summary["status"] == "failed", run.summary
    assert (f"fault 0 (kill_rank at step {end}) would never fire: trainer.max_epochs ends this run after step "
            f"{end - 1}") in run.summary["error"]
    assert run.summary["samples_committed"] == 0 and not run.summary["recoveries"]


def test_the_sampler_says_the_order_and_any_other_is_refused():
    rows = list(range(10))
    loader = torch.utils.data.DataLoader(rows, batch_size=2)
    assert shuffle_seed(loader, seed=3) is None
    assert shuffle_seed(torch.utils.data.DataLoader(rows, shuffle=True), seed=3) == shuffle_seed(
        torch.utils.data.DataLoader(rows, shuffle=True), seed=3) != shuffle_seed(
        torch.utils.data.DataLoader(rows, shuffle=True), seed=4)
    weighted = torch.utils.data.WeightedRandomSampler([1.0] * 10, 10)
    with pytest.raises(TypeError, match="sampler is a WeightedRandomSampler"):
        shuffle_seed(torch.utils.data.DataLoader(rows, sampler=weighted), seed=3)


def test_a_finite_step_loader_runs_from_the_committed_step_to_its_epochs_end():
    source = IndexedDatasetSource(list(range(10)), micro_batch=2, dp_size=2, collate=list, shuffle_seed=5)
    assert source.steps_per_epoch == 2  # 10 rows, 4 a step: 2 steps, 2 rows left out
    step = [3]
    loader = StepLoader(source, lambda: step[0], lambda: 1, source.steps_per_epoch)
    assert len(loader) == 2 and list(loader) == [source.batch(3, 1)]  # the rest of epoch 1
    step[0] = 4
    assert list(loader) == [source.batch(4, 1), source.batch(5, 1)]  # all of epoch 2
    epoch2 = source.batch(4, 0) + source.batch(4, 1) + source.batch(5, 0) + source.batch(5, 1)
    assert epoch2 == torch.randperm(10, generator=torch.Generator().manual_seed(5 + 2)).tolist()[:8]
    with pytest.raises(ValueError, match="fewer than one step's trainer.global_batch_size=12"):
        IndexedDatasetSource(list(range(10)), micro_batch=6, dp_size=2, collate=list)
