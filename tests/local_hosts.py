"""Several hosts on one machine: each a process tree of its own, started by real torchrun (or with SLURM's variables
set by hand), for the tests and the benches of launcher.mode=per_host. Every process of a job carries one token in
its environment (``TOKEN_ENV``), so that none may outlive it; waits poll what the job wrote, never sleep a fixed
time; a host is lost as when its power goes (every process of its tree SIGKILLed at once)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

from runner.plumbing.events import read_jsonl

ROOT = Path(__file__).resolve().parents[1]  # the checkout whose runner every process of a job runs
TOKEN_ENV = "RR_TEST_TOKEN"
BASE = ["+recipe=gpt_tiny", "logger=none", "trainer.progress_bar=false"]


def processes_of(token: str) -> set[int]:
    """Every process (launcher, controller, agents, fork servers, workers) started for one job, by its token."""
    out = set()
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get(TOKEN_ENV) == token:
                out.add(p.info["pid"])
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return out


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
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == kind]


def max_step(run_dir: Path) -> int:
    return max((r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")), default=-1)


def listens(pid: int, port: int) -> bool:
    return any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in psutil.Process(pid).net_connections())


def power_off(tree: psutil.Process) -> None:
    """The host's power goes: every process of its tree at once, nothing reported."""
    for p in [tree] + tree.children(recursive=True):
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


class Job:
    """Processes of one job, all tagged with one token so that none may outlive it."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.token = run_dir, uuid.uuid4().hex
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    def start(self, args: list[str], extra_env: dict | None = None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
        env.update(PYTHONPATH=str(ROOT), WANDB_MODE="offline", WANDB_SILENT="true", **{TOKEN_ENV: self.token},
                   **(extra_env or {}))
        # several jobs share a parent directory, and a relaunch even the run dir
        log = self.run_dir.parent / f"{self.run_dir.name}.{self.token[:8]}.proc{len(self.procs)}.log"
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

    def hosts_behind_the_rendezvous_store(self, hosts: int, *overrides: str, extra_env: dict | None = None) -> list:
        """``hosts`` per_host torchrun trees, the first started alone until it hosts torchrun's rendezvous store,
        whose loss torchrun itself does not survive (so that another host can be lost)."""
        rdzv = c10d_rendezvous()
        port = int(rdzv[1].rsplit(":", 1)[1])
        first = self.torchrun(hosts, 1, rdzv, 0, "launcher.mode=per_host", *overrides, extra_env=extra_env)
        wait_for("the rendezvous store", lambda: listens(first.pid, port), procs=[first])
        return [first] + [self.torchrun(hosts, 1, rdzv, 0, "launcher.mode=per_host", *overrides, extra_env=extra_env)
                          for _ in range(hosts - 1)]

    def tree_of_node(self, node: int) -> psutil.Process:
        """The tree whose process is node ``node``'s (the controller for node 0, else the host's agent)."""
        (joined,) = [e for e in events(self.run_dir, "host_joined") if e["node"] == node]
        for proc in self.procs:
            if any(c.pid == joined["pid"] for c in psutil.Process(proc.pid).children(recursive=True)):
                return psutil.Process(proc.pid)
        raise AssertionError(f"no process tree holds node {node}'s process (pid {joined['pid']})")

    def lose_host(self, hosts: list, node: int) -> list:
        """Power off node ``node``'s tree (never the one holding the rendezvous store); returns the other trees."""
        tree = self.tree_of_node(node)
        assert tree.pid != hosts[0].pid
        power_off(tree)
        return [p for p in hosts if p.pid != tree.pid]

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
        """Each host's log, its tail only: for a failure's message."""
        return "\n".join(f"--- {log.name}\n{log.read_text()[-2500:]}" for log in self.logs)

    def printed(self, text: str) -> bool:
        """Whether some host printed ``text``, anywhere in its log (torchrun's own report of a failed agent may
        follow the runner's message by more than ``output``'s tail)."""
        return any(text in log.read_text() for log in self.logs)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for pid in processes_of(self.token):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
