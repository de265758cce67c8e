"""Jobs under real torchrun (or SLURM's variables set by hand) for the tests: every process of a job carries one
token, so that none may outlive it; waits poll what the job wrote, never sleep a fixed time."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.conftest import ROOT, _processes_of

BASE = ["+recipe=gpt_tiny", "logger=none", "trainer.progress_bar=false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def c10d_rendezvous() -> list[str]:
    """torchrun's arguments for a fresh c10d rendezvous on this machine (an OS-assigned port, a new id)."""
    return ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={uuid.uuid4().hex[:8]}"]


def wait_for(what: str, condition, timeout_s: float = 240.0, procs=()):
    """Poll `condition` until it returns something truthy; fail early if one of `procs` ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = condition()
        if got:
            return got
        ended = [p for p in procs if p.poll() is not None]
        assert not ended, f"a process ended (rc {[p.returncode for p in ended]}) while waiting for {what}"
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def events(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [e for e in (json.loads(x) for x in path.read_text().splitlines() if x.strip()) if e["kind"] == kind]


def max_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return -1
    return max((json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()), default=-1)


class Job:
    """Processes of one test job, all tagged with one token so that none may outlive it."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.token = run_dir, uuid.uuid4().hex
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    def start(self, args: list[str], extra_env: dict | None = None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
        env.update(PYTHONPATH=str(ROOT), WANDB_MODE="offline", WANDB_SILENT="true", RR_TEST_TOKEN=self.token,
                   **(extra_env or {}))
        log = self.run_dir.parent / f"{self.run_dir.name}.proc{len(self.procs)}.log"  # several jobs share a parent
        self.logs.append(log)
        with open(log, "w") as out:
            proc = subprocess.Popen(args, cwd=self.run_dir.parent, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def torchrun(self, nnodes: int, nproc: int, rdzv: list[str], max_restarts: int, *overrides: str,
                 extra_env: dict | None = None, prefix: tuple[str, ...] = ()):
        """A torchrun tree; ``prefix`` runs it through another command first (``ip netns exec NS``)."""
        return self.start([*prefix, sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                           f"--nproc_per_node={nproc}", *rdzv, f"--max-restarts={max_restarts}",
                           "--monitor-interval=0.1", "-m", "runner", *BASE, f"hydra.run.dir={self.run_dir}",
                           *overrides], extra_env)

    def join(self, address: str, *overrides: str, extra_env: dict | None = None):
        """A host started later, outside torchrun: the job's overrides plus ``launcher.join=address``."""
        return self.start([sys.executable, "-m", "runner", *BASE, f"hydra.run.dir={self.run_dir}", *overrides,
                           f"launcher.join={address}"], extra_env)

    def wait(self, timeout_s: float = 300.0) -> list[int]:
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        return [p.returncode for p in self.procs]

    def output(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()[-2500:]}" for log in self.logs)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for pid in _processes_of(self.token):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
