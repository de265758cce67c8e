"""Lightning callbacks from the ``callbacks`` config group: refused at config time when the runner cannot run them
as configured; their state travels with the model's (to a replacement, into last.ckpt and back at a resume); a
stop a callback decides is agreed by every member at a committed step, the same in a fault-free and a recovered
run; a ModelCheckpoint writes from one rank, and its top-k is the same after a recovery."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from runner.config import ConfigError
from runner.config.callbacks import STOCK, refusals
from runner.config.validate import validate
from tests.conftest import ROOT, Run, run_cli
from tests.test_checkpoint import _run_until
from tests.test_config import _compose

USER = ["model._target_=tests.regressors.LoggingRegressor", "data._target_=tests.regressors.RegressionData",
        "trainer.global_batch_size=8", "ft=[flashrecovery]"]
COUNT = ["+callbacks.count._target_=tests.callbacks_under_test.CommittedBatches"]
# a stop decided after the 4th committed step (patience 3: no check improves by 100 on the first): the 5th step's
# reduction carries it, so every member ends at step 5
EARLY = ["+callbacks.early._target_=tests.callbacks_under_test.EveryBatchEarlyStopping",
         "+callbacks.early.monitor=my/loss_mean", "+callbacks.early.min_delta=100", "+callbacks.early.patience=3"]
BEST = ["+callbacks.best._target_=lightning.pytorch.callbacks.ModelCheckpoint", "+callbacks.best.monitor=my/loss_mean",
        "+callbacks.best.every_n_train_steps=1", "+callbacks.best.save_top_k=2"]
STOPPING = [*USER, "trainer.max_steps=12", *COUNT, *EARLY, *BEST]
STOP_STEP = 5


def _callback_state(run: Run) -> dict:
    """The callbacks' state in the run's last.ckpt, the run dir's paths written as <run>."""
    ckpt = torch.load(run.dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return {key: {k: str(v).replace(str(run.dir), "<run>") for k, v in state.items()}
            for key, state in ckpt["callbacks"].items()}


def _counts(run: Run) -> dict[str, int]:
    """Each rank's final count of committed batches (``CommittedBatches``), a replacement's in place of its victim's."""
    return {p.name: json.loads(p.read_text()) for p in run.dir.glob("committed_batches.rank*.json")}


def _top_k(run: Run) -> list[str]:
    return sorted(p.name for p in (run.dir / "checkpoints").glob("*.ckpt"))


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory) -> Run:
    return run_cli(*STOPPING, run_dir=tmp_path_factory.mktemp("callbacks") / "run")


def test_a_callback_stop_ends_every_member_at_the_next_committed_step_with_the_state_in_last_ckpt(fault_free):
    s = fault_free.summary
    assert s["status"] == "completed", fault_free.output[-3000:]
    assert s["global_step"] == STOP_STEP and s["samples_lost"] == 0
    assert [e["at_step"] for e in fault_free.events("stop_requested_by_callback")] == [STOP_STEP - 1] * 2
    assert [e["at_step"] for e in fault_free.events("checkpoint_saved")] == [STOP_STEP]
    state = _callback_state(fault_free)
    assert state["CommittedBatches"] == {"batches": str(STOP_STEP)}
    assert _counts(fault_free) == {f"committed_batches.rank{r}.json": STOP_STEP for r in (0, 1)}
    early = next(v for k, v in state.items() if k.startswith("EveryBatchEarlyStopping"))
    assert early["wait_count"] == str(STOP_STEP - 1)
    best = next(v for k, v in state.items() if k.startswith("ModelCheckpoint"))
    assert best["dirpath"] == "<run>/checkpoints"
    assert _top_k(fault_free) == ["epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    kept = torch.load(fault_free.dir / "checkpoints" / "epoch=0-step=4.ckpt", map_location="cpu", weights_only=True)
    assert kept["global_step"] == 4


@pytest.mark.parametrize("rank, step", [(0, 2), (1, STOP_STEP - 1)], ids=["before-the-decision", "at-the-agreed-step"])
def test_a_killed_rank_ends_with_the_fault_free_step_state_and_top_k(fault_free, tmp_path, rank, step):
    """Rank 0 killed before the stop is decided (its replacement gets the callbacks' state from its peer, and as
    logical rank 0 writes last.ckpt), or rank 1 killed at the step whose reduction carries the stop (its replacement
    computes that step and stops with the others)."""
    killed = run_cli(*STOPPING, "fault=kill_rank", f"fault.rank={rank}", f"fault.step={step}", run_dir=tmp_path / "run")
    s, clean = killed.summary, fault_free.summary
    assert s["status"] == "completed", killed.output[-3000:]
    assert len(s["recoveries"]) == 1, s["recoveries"]
    assert (s["global_step"], s["param_checksum"]) == (clean["global_step"], clean["param_checksum"])
    assert (s["samples_lost"], s["samples_duplicated"]) == (0, 0)
    assert _callback_state(killed) == _callback_state(fault_free)
    assert _counts(killed) == _counts(fault_free)  # the replacement's count went on from its peer's
    assert _top_k(killed) == _top_k(fault_free)


# Lightning's own EarlyStopping and ModelCheckpoint on val/loss, as a user configures them: validation every 2 steps
# (at steps 2, 4, 6, ...); no validation improves by 100 on the first, so with patience 2 the stop is decided at the
# third and agreed at the next committed step, well before trainer.max_steps
ON_VAL_LOSS = [*USER, "trainer.max_steps=20", "trainer.val_check_interval=2",
               "+callbacks.early._target_=lightning.pytorch.callbacks.EarlyStopping",
               "+callbacks.early.monitor=val/loss", "+callbacks.early.min_delta=100", "+callbacks.early.patience=2",
               "+callbacks.best._target_=lightning.pytorch.callbacks.ModelCheckpoint",
               "+callbacks.best.monitor=val/loss", "+callbacks.best.save_top_k=2"]


def test_early_stopping_and_top_k_on_val_loss_are_the_same_after_a_rank_is_killed(tmp_path):
    clean = run_cli(*ON_VAL_LOSS, run_dir=tmp_path / "clean")
    killed = run_cli(*ON_VAL_LOSS, "fault=kill_rank", "fault.rank=1", "fault.step=5", run_dir=tmp_path / "killed")
    for run in (clean, killed):
        assert run.summary["status"] == "completed", run.output[-3000:]
    c, k = clean.summary, killed.summary
    assert len(k["recoveries"]) == 1 and not c["recoveries"]
    assert 6 < c["global_step"] < 20  # stopped early, after the third validation
    assert (k["global_step"], k["param_checksum"]) == (c["global_step"], c["param_checksum"])
    assert (k["samples_lost"], k["samples_duplicated"]) == (0, 0)
    stops = [[e["at_step"] for e in run.events("stop_requested_by_callback")] for run in (clean, killed)]
    assert stops[0] and set(stops[0]) == set(stops[1])
    assert _callback_state(killed) == _callback_state(clean)
    kept = [name for name in _top_k(clean) if name != "last.ckpt"]
    assert len(kept) == 2 and _top_k(killed) == _top_k(clean)
    for name in kept:  # the same weights in each kept file, bit for bit
        a, b = (torch.load(run.dir / "checkpoints" / name, map_location="cpu", weights_only=True)["state_dict"]
                for run in (clean, killed))
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def test_a_resumed_run_continues_the_callbacks_state_of_last_ckpt(fault_free, tmp_path):
    """EarlyStopping's wait count and the batch count come back from last.ckpt: the stop is asked for again after
    the first resumed step and agreed at the second."""
    resumed = run_cli(*USER, "trainer.max_steps=12", *COUNT, *EARLY, f"runner.resume={fault_free.dir}",
                      run_dir=tmp_path / "run")
    assert resumed.summary["status"] == "completed", resumed.output[-3000:]
    assert resumed.summary["global_step"] == STOP_STEP + 2
    assert _callback_state(resumed)["CommittedBatches"] == {"batches": str(STOP_STEP + 2)}


@pytest.mark.slow
def test_a_restart_from_flash_snapshots_restores_the_callbacks_state_of_the_snapshot_step(tmp_path):
    """Every rank killed at step 8 restarts from the step-5 snapshots: the count in them is the one after step 5's
    hooks (the configured callbacks run before the snapshot), so every rank ends counting each committed step once."""
    run = run_cli(*USER, "ft=[flash_ckpt]", "ft.flash_ckpt.every_n_steps=5", "trainer.max_steps=12", *COUNT,
                  "fault=kill_all", "fault.step=8", run_dir=tmp_path / "run")
    s = run.summary
    assert s["status"] == "completed", run.output[-3000:]
    assert [r["action"] for r in s["recoveries"]] == ["restart_all"] and s["steps_redone"] == 3
    assert _counts(run) == {f"committed_batches.rank{r}.json": 12 for r in (0, 1)}


@pytest.mark.slow
def test_sigusr2_and_the_same_command_continue_the_callbacks_state(tmp_path):
    command = [*USER, "ft=[]", "trainer.max_steps=200", *COUNT, "runner.resume=auto"]
    run_dir = tmp_path / "run"
    stopped = _run_until(run_dir, step=5, sig=signal.SIGUSR2, overrides=command)
    assert stopped.returncode == 75, stopped.output[-3000:]
    at = stopped.summary["global_step"]
    assert _callback_state(stopped)["CommittedBatches"] == {"batches": str(at)}
    again = run_cli(*command, run_dir=run_dir)
    assert again.returncode == 0, again.output[-3000:]
    assert _callback_state(again)["CommittedBatches"] == {"batches": "200"}


@pytest.mark.parametrize("overrides, expected", [
    (["+callbacks.x._target_=builtins.dict"], "callbacks.x._target_=builtins.dict is a plain class, not a "
                                              "lightning.pytorch.Callback"),
    (["+callbacks.x._target_=no_such_package.Callback"], "callbacks.x._target_=no_such_package.Callback cannot be "
                                                         "imported"),
    (["+callbacks.x=3"], "callbacks.x has no _target_"),
    (["+callbacks.t._target_=lightning.pytorch.callbacks.Timer"], "bound the run with trainer.max_steps"),
    (["+callbacks.bar._target_=lightning.pytorch.callbacks.TQDMProgressBar"], "trainer.progress_bar"),
    (["+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor"], "logs train/lr at every committed"),
    ([*BEST, "+callbacks.best.save_last=true"], "drop save_last"),
    ([*BEST, "+callbacks.best.train_time_interval=1"], "use every_n_train_steps"),
    ([*BEST, "parallel.zero=1"], "holds only its shard"),
])
def test_a_callback_the_runner_cannot_run_as_configured_is_refused(overrides, expected):
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        validate(_compose("+recipe=gpt_tiny", *overrides))


@pytest.mark.parametrize("target", sorted(STOCK))
def test_a_stock_callback_validated_without_an_import_is_one_the_runner_runs(target):
    """The callbacks validation takes without importing Lightning (the default group's model summary): each imports
    to a Callback that no rule refuses, with any arguments."""
    import lightning.pytorch as pl
    from hydra.utils import get_object

    cls = get_object(target)
    assert issubclass(cls, pl.Callback)
    assert not refusals(_compose("+recipe=gpt_tiny"), cls, {})


def test_the_default_callbacks_are_validated_without_importing_lightning():
    code = ("import sys; from tests.test_config import _compose; from runner.config.validate import validate; "
            "validate(_compose('+recipe=gpt_tiny')); print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'lightning'))[:5])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


def test_a_refused_callback_exits_2_before_any_worker_starts(run_dir):
    run = run_cli("+recipe=gpt_tiny", "+callbacks.x._target_=builtins.dict", run_dir=run_dir)
    assert run.returncode == 2
    assert "not a lightning.pytorch.Callback" in run.output
    assert not (run_dir / "events.jsonl").exists()
