"""Shared helpers: run the real CLI in a subprocess and read its outputs; check nothing leaks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.local_hosts import processes_of

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["logger=none", "trainer.progress_bar=false", "runner.console_events=true"]
# the events that tell why a recovery started and what it did, quoted when a test expected another count
RECOVERY_TRAIL = ("fault_injected", "collective_failed", "replication_failed", "replication_abandoned",
                  "symptom_reported", "fault_detected", "worker_killed", "recovery_decided", "generation")


def read_summary(run_dir: Path) -> dict:
    """summary.json, checked against events.jsonl: the run's last ``run_end`` says the status summary.json says (the
    run has one verdict). Every test that reads a summary reads it through here."""
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    ends = [e for e in (json.loads(line) for line in lines if line.strip()) if e["kind"] == "run_end"]
    assert ends, f"summary.json says {summary['status']!r} but events.jsonl has no run_end"
    assert ends[-1]["status"] == summary["status"], (f"run_end says {ends[-1]['status']!r} "
                                                     f"({ends[-1].get('error')}) but summary.json says "
                                                     f"{summary['status']!r} ({summary.get('error')})")
    return summary


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, run_dir: Path) -> None:
        self.proc, self.dir = proc, run_dir
        self.returncode = proc.returncode
        self.output = proc.stdout + proc.stderr

    @property
    def summary(self) -> dict:
        path = self.dir / "summary.json"
        assert path.exists(), f"no summary.json; output tail:\n{self.output[-3000:]}"
        return read_summary(self.dir)

    def events(self, kind: str | None = None) -> list[dict]:
        lines = (self.dir / "events.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        return [r for r in records if kind is None or r["kind"] == kind]

    def only_recovery(self) -> dict:
        """The run's one recovery; if there were more or none, the failure says what each was and why."""
        recoveries = self.summary["recoveries"]
        assert len(recoveries) == 1, "expected one recovery, got:\n" + "\n".join(
            [f"  {r['fault']} -> {r['action']} of {r['victims']} at step {r['step']}: {r['reason']}"
             for r in recoveries]
            + [f"  {json.dumps(e)}" for e in self.events() if e["kind"] in RECOVERY_TRAIL])
        return recoveries[0]

    def records(self) -> list[dict]:
        """Every record of metrics.jsonl: the committed steps', and the evaluations' after fit."""
        return [json.loads(x) for x in (self.dir / "metrics.jsonl").read_text().splitlines() if x.strip()]

    def metrics(self) -> list[dict]:
        """The committed steps' records."""
        return [m for m in self.records() if "evaluation" not in m]

    def after_fit(self) -> list[dict]:
        """The records of the evaluations after fit (validation of the final weights, runner.test_after_fit)."""
        return [m for m in self.records() if m.get("evaluation") == "after_fit"]


def run_cli(*overrides: str, run_dir: Path, timeout: float = 240, quiet: bool = True, cwd: Path = ROOT) -> Run:
    """``python -m runner`` with overrides; asserts afterwards that no process or port is left behind."""
    token = uuid.uuid4().hex
    args = [sys.executable, "-m", "runner", *overrides, f"hydra.run.dir={run_dir}", *(QUIET if quiet else [])]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "RR_TEST_TOKEN": token}
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    run = Run(proc, Path(run_dir))
    assert_nothing_left(token, run)
    if not any(o.split("=")[0].lstrip("+").split(".")[0] in ("fault", "straggler") for o in overrides):
        assert_no_straggler(run)
    return run


def assert_no_straggler(run: Run) -> None:
    """A fault-free run (no ``fault`` override) has no straggler: every such run of the tests checks it."""
    if (run.dir / "events.jsonl").exists():
        found = run.events("straggler_detected")
        assert not found, f"straggler detected in a fault-free run: {found}"


def assert_no_process_of(token: str) -> None:
    """Every process started with ``token`` in its environment is gone (within 10 s)."""
    deadline = time.monotonic() + 10
    while (left := processes_of(token)) and time.monotonic() < deadline:
        time.sleep(0.1)  # the fork server exits when it sees its parent gone
    assert not left, f"processes left behind: {left}"


def assert_nothing_left(token: str, run: Run) -> None:
    assert_no_process_of(token)
    if (run.dir / "events.jsonl").exists():
        starts = run.events("run_start")
        if starts:
            port = starts[0]["store_port"]
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))  # fails if the store still listens


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


# the default layout (one node of 2 ranks), the LR constant after warm-up (so that a shorter run is the start of a
# longer one, tests/test_checkpoint.py)
TINY = ("+recipe=gpt_tiny", "trainer.min_lr=3e-3")
ONE_BY_TWO = [*TINY, "trainer.max_steps=30"]
TWO_BY_TWO = ["+recipe=gpt_tiny", "parallel.nodes=2", "parallel.procs_per_node=2", "trainer.max_steps=30"]


@pytest.fixture(scope="session")
def one_by_two(tmp_path_factory) -> Run:
    """The fault-free run of gpt_tiny on one node of 2 ranks, 30 steps, without fault tolerance, a Lightning
    checkpoint every 10 steps: the checkpoint tests' first 30 steps and the reference of flash_ckpt's recoveries and
    of the torchrun and SLURM launchers at 2 ranks, run once per session."""
    return run_cli(*ONE_BY_TWO, "checkpoint.every_n_steps=10", run_dir=tmp_path_factory.mktemp("one_by_two") / "run")


@pytest.fixture(scope="session")
def two_by_two(tmp_path_factory) -> Run:
    """The fault-free run of gpt_tiny on 2 nodes x 2 ranks, 30 steps, without fault tolerance: the output contract
    (test_train.py) and the reference of the recoveries of 4 data-parallel ranks (FlashRecovery, flash_ckpt,
    DeadPool, NDB and per_host runs in several test modules; neither the techniques in ``ft``, nor spares, nor how
    the same ranks are spread over nodes change a fault-free run's training), run once per session."""
    return run_cli(*TWO_BY_TWO, run_dir=tmp_path_factory.mktemp("two_by_two") / "run")


# FlashRecovery on 2 nodes x 2 ranks, 30 steps, a rank SIGKILLed at step 12 (fault.rank to add), the default
# experiment logger (W&B, offline) every 5 steps
KILL_RANK = [*TWO_BY_TWO, "trainer.log_every_n_steps=5", "ft=[flashrecovery]", "fault=kill_rank", "fault.step=12",
             "trainer.progress_bar=false"]


@pytest.fixture(scope="session")
def rank0_killed(tmp_path_factory) -> Run:
    """The KILL_RANK run of logical rank 0 (the rank that writes the metrics), logged as a user runs it: what
    FlashRecovery does (test_flashrecovery.py) and what the job's W&B run holds (test_wandb_run.py), run once per
    session."""
    return run_cli(*KILL_RANK, "fault.rank=0", run_dir=tmp_path_factory.mktemp("rank0_killed") / "run", quiet=False)


# tensor parallelism: a TP pair on each of 2 nodes, dp=2 across them
TP2_DP2 = ["+recipe=gpt_tiny", "parallel.nodes=2", "parallel.procs_per_node=2", "parallel.tp=2"]
TP2_DP2_STEPS = 20


@pytest.fixture(scope="session")
def tp2_dp2(tmp_path_factory) -> Run:
    """The fault-free FlashRecovery run at TP2_DP2 with a checkpoint every 5 steps: the reference of the recoveries
    at that layout (test_tp_training.py) and the checkpoint file a TP run writes (test_tp_checkpoint.py), run once
    per session."""
    run = run_cli(*TP2_DP2, f"trainer.max_steps={TP2_DP2_STEPS}", "ft=[flashrecovery]", "checkpoint.every_n_steps=5",
                  run_dir=tmp_path_factory.mktemp("tp2_dp2") / "run")
    assert run.summary["status"] == "completed", run.output[-4000:]
    return run


# gpt_tiny with a constant LR after warm-up and a clip far below the gradient norm (every step is clipped, by the full
# model's norm, the same at every layout), on 2 nodes: the runs that compare parallel layouts and their recoveries
CLIPPED_TINY = ["+recipe=gpt_tiny", "trainer.min_lr=3e-3", "trainer.grad_clip=0.05", "parallel.nodes=2"]
TP2PP2 = [*CLIPPED_TINY, "parallel.procs_per_node=4", "parallel.tp=2", "parallel.pp=2"]  # a TP pair per stage
TP2PP2_STEPS = 10


@pytest.fixture(scope="session")
def tp2pp2(tmp_path_factory) -> Run:
    """The fault-free run at tp=2, pp=2, dp=2 on 2 nodes x 4 ranks: the reference of every recovery at that layout
    (FlashRecovery, flash_ckpt and DeadPool runs in several test modules), run once per session."""
    run = run_cli(*TP2PP2, f"trainer.max_steps={TP2PP2_STEPS}", run_dir=tmp_path_factory.mktemp("tp2pp2") / "run")
    assert run.summary["status"] == "completed", run.output[-4000:]
    return run


@pytest.fixture
def job():
    """A fresh flash-checkpoint job id; fails the test if its segments are left in /dev/shm."""
    # imported here: the flash_ckpt package compiles its kernels, which the fast tests need not pay for
    from runner.recovery.flash_ckpt.hygiene import cleanup
    from runner.recovery.flash_ckpt.shm import job_files

    job_id = f"t{uuid.uuid4().hex[:10]}"
    yield job_id
    leaked = job_files(job_id)
    cleanup(job_id)
    assert not leaked, f"segments left in /dev/shm: {leaked}"


@pytest.fixture
def make_job(tmp_path):
    """Jobs under torchrun or SLURM's variables (``tests/local_hosts.py``); every process of each is gone at the
    end of the test, and so are its flash-checkpoint segments. A job whose every process tree ended by itself with
    exit status 0 must have dropped them itself (the test fails if not); one whose hosts the test powered off or
    killed leaves them by design (a relaunch resumes from memory, and a real host's memory goes with its power)."""
    from runner.recovery.flash_ckpt.hygiene import cleanup
    from runner.recovery.flash_names import flash_job_id
    from tests.local_hosts import Job

    jobs: list[Job] = []

    def make(name: str = "run") -> Job:
        jobs.append(Job(tmp_path / name))
        return jobs[-1]

    yield make
    for j in jobs:
        ended_cleanly = bool(j.procs) and all(p.poll() == 0 for p in j.procs)
        j.close()
        left = cleanup(flash_job_id(j.run_dir))
        assert not (left and ended_cleanly), f"a job whose hosts all ended with 0 left segments in /dev/shm: {left}"
