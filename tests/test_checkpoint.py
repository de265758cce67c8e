"""The run's Lightning checkpoint: written at the end, loadable by Lightning, resumed bit-identically,
written when SIGTERM stops a run, and a bad resume target refused before any worker starts.

The runs keep the learning rate constant after warm-up (``trainer.min_lr`` = ``trainer.lr``): the cosine
schedule's horizon is ``trainer.max_steps``, so only then is a 30-step run the first half of a 60-step one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from runner.lightning_module import GPTModule
from runner.plumbing.events import read_jsonl
from runner.training.checksum import param_checksum
from tests.conftest import QUIET, ROOT, TINY, Run, assert_nothing_left, run_cli


@pytest.fixture(scope="module")
def first30(one_by_two) -> Run:
    """TINY (2 ranks, logger=none, the LR constant after warm-up) for 30 steps with a checkpoint every 10: the shared
    run of tests/conftest.py."""
    return one_by_two


@pytest.fixture(scope="module")
def straight60(tmp_path_factory) -> Run:
    return run_cli(*TINY, "trainer.max_steps=60", run_dir=tmp_path_factory.mktemp("straight60") / "run")


def test_a_run_ends_with_a_lightning_checkpoint_written_also_every_n_steps(first30):
    assert first30.returncode == 0, first30.output[-3000:]
    path = first30.dir / "checkpoints" / "last.ckpt"
    assert path.is_file()
    assert [e["at_step"] for e in first30.events("checkpoint_saved")] == [10, 20, 30]
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    assert {"state_dict", "optimizer_states", "lr_schedulers", "epoch", "global_step", "hyper_parameters",
            "loops", "resilient_runner"} <= set(ckpt)
    assert ckpt["global_step"] == 30 and ckpt["resilient_runner"]["data_step"] == 30
    assert not list(path.parent.glob(".*tmp*")), "a temporary file was left beside the checkpoint"


def test_load_from_checkpoint_rebuilds_the_trained_module(first30):
    module = GPTModule.load_from_checkpoint(first30.dir / "checkpoints" / "last.ckpt", map_location="cpu")
    assert param_checksum(module) == first30.summary["param_checksum"]


def test_plain_lightning_resumes_the_checkpoint_in_one_process(first30, tmp_path):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from runner.config.schema import GPTConfig
    from runner.data import SyntheticTokens

    source = SyntheticTokens(1234, 256, 64, 4)
    batches = [source.batch(step, 0) for step in range(4)]
    path = first30.dir / "checkpoints" / "last.ckpt"
    module = GPTModule(GPTConfig(), lr=3e-3, min_lr=3e-3, warmup_steps=5, max_steps=32, weight_decay=0.1,
                       betas=(0.9, 0.95))  # gpt_tiny's shape and trainer
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=32, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(batches, batch_size=None), ckpt_path=path)
    assert trainer.global_step == 32
    assert trainer.optimizers[0].state_dict()["state"][0]["step"] == 32  # AdamW's state came from the file


@pytest.mark.slow  # run time: a variant of what the default tier covers
def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(first30, straight60, tmp_path):
    assert straight60.returncode == 0, straight60.output[-3000:]
    resumed = run_cli(*TINY, "trainer.max_steps=60", f"runner.resume={first30.dir}", run_dir=tmp_path / "run")
    assert resumed.returncode == 0, resumed.output[-3000:]
    s = resumed.summary
    assert s["param_checksum"] == straight60.summary["param_checksum"]
    assert s["global_step"] == 60 and s["samples_lost"] == 0 and s["samples_committed"] == 30 * 8
    assert [e["at_step"] for e in resumed.events("resumed")] == [30]
    assert min(m["step"] for m in resumed.metrics()) == 30


@pytest.mark.slow
def test_zero1_resume_gathers_and_reshards_the_optimizer_state(tmp_path):
    zero = (*TINY, "parallel.zero=1")
    straight = run_cli(*zero, "trainer.max_steps=60", run_dir=tmp_path / "straight")
    first = run_cli(*zero, "trainer.max_steps=30", run_dir=tmp_path / "first")
    assert straight.returncode == 0 and first.returncode == 0, (straight.output + first.output)[-3000:]
    ckpt = torch.load(first.dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    n_params = sum(1 for _ in GPTModule.load_from_checkpoint(first.dir / "checkpoints" / "last.ckpt").parameters())
    assert len(ckpt["optimizer_states"][0]["state"]) == n_params  # every shard's state, gathered
    resumed = run_cli(*zero, "trainer.max_steps=60", f"runner.resume={first.dir / 'checkpoints' / 'last.ckpt'}",
                      run_dir=tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.summary["param_checksum"] == straight.summary["param_checksum"]


@pytest.mark.slow
def test_sigterm_checkpoints_at_the_next_step_and_the_run_resumes_from_there(first30, tmp_path):
    stopped = _run_until(tmp_path / "stopped", step=10, sig=signal.SIGTERM, overrides=[*TINY, "trainer.max_steps=5000"])
    assert stopped.returncode == 75, stopped.output[-3000:]
    assert "Traceback" not in stopped.output
    lines = [line for line in stopped.output.splitlines() if line.startswith("checkpoint saved: ")]
    assert lines == [f"checkpoint saved: {stopped.dir / 'checkpoints' / 'last.ckpt'} "
                     f"(step {stopped.summary['global_step']}); continue it with the same command plus "
                     f"runner.resume=auto (in this run dir), or runner.resume={stopped.dir} (in a new one)"]
    s = stopped.summary
    assert s["status"] == "stopped" and 10 <= s["global_step"] < 30 and s["samples_lost"] == 0
    assert [e["at_step"] for e in stopped.events("checkpoint_saved")] == [s["global_step"]]
    resumed = run_cli(*TINY, "trainer.max_steps=30", f"runner.resume={stopped.dir}", run_dir=tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.summary["param_checksum"] == first30.summary["param_checksum"]  # its checkpoints change nothing


@pytest.mark.parametrize("damage", ["truncated", "missing", "finished"])
def test_a_bad_resume_target_is_refused_before_any_worker_starts(first30, tmp_path, damage):
    good = first30.dir / "checkpoints" / "last.ckpt"
    target, max_steps, expected = {
        "truncated": (tmp_path / "bad.ckpt", 60, "not a readable checkpoint"),
        "missing": (tmp_path / "nowhere", 60, "no such file or directory"),
        "finished": (first30.dir, 30, "nothing left to train"),
    }[damage]
    if damage == "truncated":
        target.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    before = {p: p.stat().st_mtime_ns for p in first30.dir.rglob("*")}
    run = run_cli(*TINY, f"trainer.max_steps={max_steps}", f"runner.resume={target}", run_dir=tmp_path / "run",
                  timeout=60)
    assert run.returncode == 2 and expected in run.output, run.output[-3000:]
    assert not (tmp_path / "run" / "events.jsonl").exists()  # no worker, no controller
    assert {p: p.stat().st_mtime_ns for p in first30.dir.rglob("*")} == before


def _run_until(run_dir: Path, *, step: int, sig: int, overrides: list[str], timeout: float = 240) -> Run:
    """The CLI in the background; ``sig`` to it once metrics.jsonl holds ``step``; its outputs once it ended."""
    token = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "RR_TEST_TOKEN": token}
    args = [sys.executable, "-m", "runner", *overrides, f"hydra.run.dir={run_dir}", *QUIET]
    with subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            _wait_for_step(run_dir / "metrics.jsonl", step, proc, deadline=time.monotonic() + timeout)
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
    run = Run(subprocess.CompletedProcess(args, proc.returncode, out, err), run_dir)
    assert_nothing_left(token, run)
    return run


def _wait_for_step(metrics: Path, step: int, proc: subprocess.Popen, deadline: float) -> None:
    """Poll the file until a committed step >= ``step`` is in it (the run must still be going)."""
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it was signalled"
        if any(r["step"] >= step for r in read_jsonl(metrics)):
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} in {metrics} in time")


class _NotPlain:
    """An object torch.load(weights_only=True) refuses."""


@pytest.mark.parametrize("content, expected", [
    ({"state_dict": {}}, "lacks optimizer_states, lr_schedulers, loops, global_step"),
    ({"state_dict": {}, "hyper_parameters": _NotPlain()}, "Unsupported global"),
])
def test_a_checkpoint_lightning_cannot_resume_is_refused_with_the_reason(tmp_path, content, expected):
    from runner.checkpoint.resume import resume_checkpoint
    from runner.config import ConfigError

    torch.save(content, tmp_path / "x.ckpt")
    with pytest.raises(ConfigError, match=expected):
        resume_checkpoint(str(tmp_path / "x.ckpt"), tmp_path / "run", max_steps=60)


@pytest.mark.parametrize("case", ["whole_model", "zero", "damaged", "no_layout_record"])
def test_a_run_dir_resumes_from_a_flash_checkpoint_newer_than_last_ckpt_only_if_it_holds_the_whole_model(
        tmp_path, case):
    """A rank's persisted flash checkpoint is every rank's state when no rank splits the model or the optimizer;
    a damaged one is passed over for an older one, and without a record of the run's layout last.ckpt is it."""
    from runner.checkpoint.resume import resume_checkpoint
    from runner.recovery.flash_ckpt.disk import checkpoint_path, write_atomic

    old = tmp_path / "old"
    state = {"state_dict": {}, "optimizer_states": [], "lr_schedulers": [], "loops": {}}
    (old / "checkpoints").mkdir(parents=True)
    torch.save({**state, "global_step": 10}, old / "checkpoints" / "last.ckpt")
    for step in (15, 20):
        write_atomic({**state, "global_step": step}, checkpoint_path(old / "checkpoints", 2, step), {})
    if case != "no_layout_record":
        layout = {"tp": 1, "pp": 1, "zero": 1 if case == "zero" else 0}
        (old / "agent_config.json").write_text(json.dumps({"config": {"parallel": layout}}))
    if case == "damaged":
        newest = checkpoint_path(old / "checkpoints", 2, 20)
        newest.write_bytes(newest.read_bytes()[:-1] + b"x")
    expected = {"whole_model": checkpoint_path(old / "checkpoints", 2, 20),
                "damaged": checkpoint_path(old / "checkpoints", 2, 15)}.get(case, old / "checkpoints" / "last.ckpt")
    assert resume_checkpoint(str(old), tmp_path / "run", max_steps=60) == expected


def _config(*overrides: str):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from runner.config import register_all
    from runner.config.registry import CONF_DIR

    register_all()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _checkpoint_of(module, path: Path) -> Path:
    """A resumable checkpoint file at step 10 holding ``module``'s saved hyper-parameters."""
    state = {"state_dict": {}, "optimizer_states": [], "lr_schedulers": [], "loops": {}, "global_step": 10}
    torch.save({**state, "hyper_parameters": dict(module.hparams)}, path)
    return path


def _gpt_of(cfg) -> GPTModule:
    from runner.planning.plan import gpt_config

    t = cfg.trainer
    return GPTModule(gpt_config(cfg), t.lr, t.min_lr, t.warmup_steps, t.max_steps, t.weight_decay, tuple(t.betas))


def test_a_checkpoint_of_a_module_built_with_other_arguments_is_refused_naming_them(tmp_path):
    """The built-in GPT's shape and optimizer arguments, and a user module's constructor arguments (its defaults
    overlaid with model.kwargs), must equal the checkpoint's saved hyper-parameters; max_steps may grow."""
    from runner.checkpoint.resume import module_arguments, resume_checkpoint
    from runner.config import ConfigError
    from tests.regressors import WideRegressor

    gpt = _checkpoint_of(_gpt_of(_config(*TINY)), tmp_path / "gpt.ckpt")
    longer = _config(*TINY, "trainer.max_steps=60")
    assert resume_checkpoint(str(gpt), tmp_path / "run", 60, module_arguments(longer)) == gpt
    other = _config(*TINY, "trainer.lr=1e-3", "model.n_layer=3")
    with pytest.raises(ConfigError) as err:
        resume_checkpoint(str(gpt), tmp_path / "run", 60, module_arguments(other))
    assert ("(model.n_layer=2 in the checkpoint, 3 here; trainer.lr=0.003 in the checkpoint, 0.001 here)"
            in str(err.value))
    assert "set model.n_layer=2 trainer.lr=0.003 to continue that run" in str(err.value)

    wide = _checkpoint_of(WideRegressor(hidden=32), tmp_path / "wide.ckpt")
    user = ("+recipe=gpt_tiny", "model._target_=tests.regressors.WideRegressor")
    with pytest.raises(ConfigError, match=r"model.kwargs.hidden=32 in the checkpoint, 16 here"):
        resume_checkpoint(str(wide), tmp_path / "run", 60, module_arguments(_config(*user)))
    same = module_arguments(_config(*user, "+model.kwargs.hidden=32"))
    assert resume_checkpoint(str(wide), tmp_path / "run", 60, same) == wide


def test_a_resume_with_other_module_arguments_exits_2_before_any_worker_starts(tmp_path):
    gpt = _checkpoint_of(_gpt_of(_config(*TINY)), tmp_path / "gpt.ckpt")
    run = run_cli(*TINY, "trainer.lr=1e-3", f"runner.resume={gpt}", run_dir=tmp_path / "run", timeout=60)
    assert run.returncode == 2, run.output[-3000:]
    assert "trainer.lr=0.003 in the checkpoint, 0.001 here" in run.output
    assert not (tmp_path / "run" / "events.jsonl").exists()  # no worker wrote its worker_started (nor anything)
    assert not (tmp_path / "run" / "agent_config.json").exists()  # no agent was configured


def test_sigusr2_stops_with_a_checkpoint_and_the_same_command_continues_it_bit_identical(straight60, tmp_path):
    """submitit's and SLURM's time-limit warning (--signal=USR2@90) stops the run as SIGTERM does: exit 75 and a
    checkpoint at the stop. A requeue runs the same command into the same run dir, and ``runner.resume=auto`` (the
    default under SLURM and torchrun) continues it there from that checkpoint: the run ends bit-identical to one
    that was never stopped, and the stopped run's outputs are kept in ``previous/0``."""
    command = [*TINY, "trainer.max_steps=60", "runner.resume=auto"]
    run_dir = tmp_path / "run"
    stopped = _run_until(run_dir, step=5, sig=signal.SIGUSR2, overrides=command)
    assert stopped.returncode == 75, stopped.output[-3000:]
    s = stopped.summary
    assert s["status"] == "stopped" and 5 <= s["global_step"] < 60 and s["samples_lost"] == 0
    assert [e["signal"] for e in stopped.events("stop_requested")] == ["SIGUSR2"]
    assert [e["at_step"] for e in stopped.events("checkpoint_saved")] == [s["global_step"]]
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True, mmap=True)
    assert ckpt["global_step"] == s["global_step"]

    again = run_cli(*command, run_dir=run_dir)
    assert again.returncode == 0, again.output[-3000:]
    assert f"runner.resume=auto: continuing from {run_dir / 'checkpoints' / 'last.ckpt'}" in again.output
    assert [e["at_step"] for e in again.events("resumed")] == [s["global_step"]]
    assert again.summary["param_checksum"] == straight60.summary["param_checksum"]
    assert again.summary["samples_committed"] == (60 - s["global_step"]) * 8 and again.summary["samples_lost"] == 0
    kept = run_dir / "previous" / "0"
    assert json.loads((kept / "summary.json").read_text()) == s and (kept / "events.jsonl").is_file()


def test_runner_resume_auto_in_the_dir_of_a_finished_run_is_refused_and_moves_nothing(first30):
    before = sorted(p.name for p in first30.dir.iterdir())
    again = run_cli(*TINY, "trainer.max_steps=30", "runner.resume=auto", run_dir=first30.dir, timeout=60)
    assert again.returncode == 2, again.output[-3000:]
    assert "the checkpoint is at step 30 and trainer.max_steps=30, so there is nothing left to train" in again.output
    assert sorted(p.name for p in first30.dir.iterdir()) == before
