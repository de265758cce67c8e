"""Network chaos in the style of Jepsen's partition-and-heal schedules, under launcher.mode=per_host: three torchrun
trees as three hosts in network namespaces (two training hosts of two ranks, a spare host),
``ft=[flashrecovery,deadpool,ndb,flash_ckpt]``. A seeded schedule cuts a host's link on both ends and heals it,
SIGKILLs a worker, and SIGSTOPs one for longer than the hang timeout, each fault fired once the run committed its
step. Whatever the schedule, a run ends exact (the fault-free checksum and loss curve, 0 samples lost or counted
twice), or within NDB's loss bound once a neighbour took a rank over, or ``failed`` with a reason: never
``completed`` with another checksum; and nothing of it is left on any host 30 s after its end.

The soak (``pytest -m soak``) runs seeded schedules back to back for ten minutes and prints each one's seed and
schedule; ``RR_NETNS_CHAOS_SEED=<seed> pytest -m soak -s tests/test_netns_chaos.py -k replay`` runs one again."""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from runner.recovery.flash_ckpt.shm import SHM_DIR
from runner.recovery.flash_names import flash_job_id
from tests import netns
from tests import test_netns_partition as partition
from tests.conftest import Run, read_summary
from tests.local_hosts import Job, events, max_step, processes_of, wait_for
from tests.test_netns_host_loss import _tree_pids, start_hosts
from tests.test_netns_partition import _loss_curve, needs_netns

fault_free = partition.fault_free  # the fixture: the layout's fault-free run under launcher=local, by its steps
LAYOUT = [o if not o.startswith("ft=") else "ft=[flashrecovery,deadpool,ndb,flash_ckpt]" for o in partition.LAYOUT]
SOAK_STEPS = 600  # per run: room for up to five faults and a few recoveries after the last one
SOAK_S = 600.0
HANG_TIMEOUT_S = 0.1 * 10  # heartbeat.interval_s x heartbeat.misses (the defaults): a stopped worker is hung then
# (and killed after the hang diagnosis, up to 1 s more): a stop of 1.5 to 6 times it may end before or after the kill
GONE_WITHIN_S = 30.0  # after the run's end, nothing of it may be left on any host
NDB_LOSS_BOUND = 0.01  # an NDB takeover: the final loss within 1 % of the fault-free run's (docs/recovery.md)
STEP_TIMEOUT_S = 300.0  # a step the schedule waits for that never comes: the run hangs
SEED_ENV = "RR_NETNS_CHAOS_SEED"


@dataclass(frozen=True)
class Fault:
    """One event of a schedule, fired once the run committed ``step``: ``cut`` takes host ``host``'s link down on
    both ends for ``seconds`` (``inf``: for good, healed once the run was checked); ``kill`` SIGKILLs, ``hang``
    SIGSTOPs for ``seconds`` one of the host's live workers (the ``pick``-th by worker id, modulo their number)."""

    step: int
    kind: str
    host: int
    seconds: float = 0.0
    pick: int = 0

    def __str__(self) -> str:
        lasting = "for good" if math.isinf(self.seconds) else f"for {self.seconds:g}s"
        what = {"cut": f"cut host {self.host} {lasting}",
                "kill": f"SIGKILL worker #{self.pick} of host {self.host}",
                "hang": f"SIGSTOP worker #{self.pick} of host {self.host} for {self.seconds:g}s"}[self.kind]
        return f"step {self.step}: {what}"


def schedule(seed: int, steps: int = SOAK_STEPS) -> list[Fault]:
    """Two to five faults at random steps of the first three quarters of the run (two may share a step: the second
    follows the first at once); a cut is more likely on a training host than on the controller's."""
    rng = random.Random(seed)
    out = []
    for step in sorted(rng.randint(20, steps * 3 // 4) for _ in range(rng.randint(2, 5))):
        kind = rng.choice(("cut", "cut", "kill", "hang"))
        if kind == "cut":
            out.append(Fault(step, kind, rng.choice((0, 1, 1, 2, 2)),
                             rng.choice((0.05, 0.5, 2.0, 4.0, 8.0, 15.0, math.inf))))
        else:
            seconds = round(rng.uniform(1.5, 6.0) * HANG_TIMEOUT_S, 2) if kind == "hang" else 0.0
            out.append(Fault(step, kind, rng.choice((0, 1, 1, 2)), seconds, rng.randrange(4)))
    return out


class Chaos:
    """One run of a schedule against a job on three namespace hosts."""

    def __init__(self, job: Job, hosts: netns.Hosts, trees: list) -> None:
        self.job, self.hosts, self.trees = job, hosts, trees
        self.log: list[str] = []  # what each fault did, for the report
        self.cut_for_good: list[int] = []

    def inflict(self, faults: list[Fault]) -> None:
        """Each fault once its step is committed (or skipped once the run has ended); cuts and hangs last their
        time (the fault itself, the one deliberate wait), a cut for good until ``heal_all``."""
        for f in faults:
            reached = wait_for(f"step {f.step}", lambda f=f: self.ended() or max_step(self.job.run_dir) >= f.step,
                               timeout_s=STEP_TIMEOUT_S, procs=[self.trees[0]])
            if reached == "ended":
                self.log.append(f"{f}: skipped, the run had ended")
                continue
            getattr(self, f"_{f.kind}")(f)

    def ended(self) -> str | bool:
        return "ended" if (self.job.run_dir / "summary.json").exists() else False

    def heal_all(self) -> None:
        for host in self.cut_for_good:
            self.hosts.heal(host)
        self.cut_for_good = []

    def _cut(self, f: Fault) -> None:
        self.hosts.partition(f.host)
        t0 = time.monotonic()
        self.log.append(f"{f}: cut at step {max_step(self.job.run_dir)}")
        if math.isinf(f.seconds):
            self.cut_for_good.append(f.host)
            return
        time.sleep(max(0.0, t0 + f.seconds - time.monotonic()))
        self.hosts.heal(f.host)

    def _kill(self, f: Fault) -> None:
        victim = self._worker(f)
        if victim is not None:
            _signal(victim[1], signal.SIGKILL)
            self.log.append(f"{f}: killed worker {victim[0]} (pid {victim[1]}) at step {max_step(self.job.run_dir)}")

    def _hang(self, f: Fault) -> None:
        victim = self._worker(f)
        if victim is None:
            return
        _signal(victim[1], signal.SIGSTOP)
        self.log.append(f"{f}: stopped worker {victim[0]} (pid {victim[1]}) at step {max_step(self.job.run_dir)}")
        time.sleep(f.seconds)
        _signal(victim[1], signal.SIGCONT)  # a worker written off as hung is gone by now

    def _worker(self, f: Fault) -> tuple[int, int] | None:
        """(wid, pid) of host ``f.host``'s ``f.pick``-th live worker, or None (logged) when it has none."""
        tree = _tree_pids(self.trees[f.host].pid) if self.trees[f.host].poll() is None else set()
        live = sorted((e["wid"], e["pid"]) for e in events(self.job.run_dir, "worker_started")
                      if e["pid"] in tree and _running(e["pid"]))
        if not live:
            self.log.append(f"{f}: skipped, host {f.host} has no live worker")
            return None
        return live[f.pick % len(live)]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def run_schedule(job: Job, faults: list[Fault], steps: int, reference: Run) -> str:
    """The layout on three namespace hosts for ``steps`` steps under ``faults``; checks the verdict and that nothing
    is left (``assert_outcome``, ``assert_nothing_left``) and returns a line saying how the run ended."""
    with netns.Hosts(3) as hosts:
        chaos = None
        try:
            trees = start_hosts(job, hosts, *LAYOUT, f"trainer.max_steps={steps}")
            chaos = Chaos(job, hosts, trees)
            chaos.inflict(faults)
            wait_for("the summary", chaos.ended, timeout_s=STEP_TIMEOUT_S + steps, procs=[trees[0]])
            outcome = assert_outcome(job.run_dir, reference, steps)
            lingering = assert_nothing_left(job, hosts, trees)
            return "; ".join([*chaos.log, outcome, *lingering])
        except AssertionError as e:
            raise AssertionError(f"{e}\nfaults done: {chaos.log if chaos else []}\n{job.output()[-6000:]}") from e
        finally:
            if chaos is not None:
                chaos.heal_all()
            job.close()


def assert_outcome(run_dir: Path, reference: Run, steps: int) -> str:
    """Exact, within NDB's bound after a takeover, or failed with a reason; run_end says what summary.json says."""
    s = read_summary(run_dir)
    actions = [r["action"] for r in s["recoveries"]]
    if s["status"] != "completed":
        assert s["status"] == "failed" and s.get("error"), f"status {s['status']!r} without a reason"
        return f"failed after {actions}: {s['error']}"
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0), actions
    assert s["global_step"] == steps and s["samples_committed"] == reference.summary["samples_committed"], actions
    curve, expected = _loss_curve(run_dir), _loss_curve(reference.dir)
    if "takeover" not in actions:
        assert s["param_checksum"] == reference.summary["param_checksum"], f"completed with another checksum {actions}"
        assert curve == expected, f"completed with another loss curve {actions}"
        return f"exact after {actions}"
    first = min(r["step"] for r in s["recoveries"] if r["action"] == "takeover")
    assert {k: v for k, v in curve.items() if k < first} == {k: v for k, v in expected.items() if k < first}
    drift = abs(s["final_loss"] - reference.summary["final_loss"]) / reference.summary["final_loss"]
    assert drift < NDB_LOSS_BOUND, f"NDB takeover from step {first}: final loss {100 * drift:.2f}% off {actions}"
    return f"within NDB's bound after {actions} (final loss {100 * drift:.2f}% off)"


def assert_nothing_left(job: Job, hosts: netns.Hosts, trees: list) -> list[str]:
    """Within 30 s of the run's end no process of the job runs on any host (torchrun, agents, fork servers,
    workers: node 0 arrives in torchrun's exit barrier for the hosts it lost), no socket listens in any host's
    namespace and no flash-checkpoint segment is left in /dev/shm."""
    t_end = (job.run_dir / "summary.json").stat().st_mtime
    deadline = time.monotonic() + max(0.0, t_end + GONE_WITHIN_S - time.time())
    while (left := processes_of(job.token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    took = time.time() - t_end
    assert not left, f"{GONE_WITHIN_S:g}s after the run's end still running: {_describe(left, trees)}"
    listening = _listening(hosts)
    assert not listening, f"sockets still listening {GONE_WITHIN_S:g}s after the run's end: {listening}"
    segments = list(SHM_DIR.glob(f"*{flash_job_id(job.run_dir)}*"))
    assert not segments, f"shared-memory segments left behind: {segments}"
    return [f"the job's processes gone {took:.1f}s after its end"]


def _describe(pids: set[int], trees: list) -> list[str]:
    out = []
    for pid in sorted(pids):
        host = next((i for i, t in enumerate(trees) if t.poll() is None and pid in _tree_pids(t.pid)), "?")
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())[:160]
        except psutil.NoSuchProcess:
            continue
        out.append(f"host {host} pid {pid}: {cmd}")
    return out


def _listening(hosts: netns.Hosts) -> list[str]:
    """Listening TCP sockets in every host's namespace."""
    out = []
    for i in range(hosts.n):
        for table in ("tcp", "tcp6"):
            rows = subprocess.run([*hosts.exec_prefix(i), "cat", f"/proc/net/{table}"], capture_output=True,
                                  text=True, check=True).stdout.splitlines()[1:]
            for row in rows:
                fields = row.split()
                if fields[3] == "0A":  # LISTEN
                    out.append(f"host {i}: port {int(fields[1].rsplit(':', 1)[1], 16)}")
    return out


# -- a worker killed on host 1, then a host cut for good ---------------------------------------------------------------
KILL_THEN_CUT_STEPS = 200


@pytest.mark.slow  # two runs of 200 steps (the reference and the chaos), about 3 minutes
@needs_netns
@pytest.mark.parametrize("cut", [1, 2], ids=["host1", "spare_host"])
def test_a_worker_killed_then_a_host_cut_completes_exactly_and_the_cut_host_ends(make_job, fault_free, cut):
    """A worker of host 1 is killed (restarted in place); once training went on, host 1 or the spare host loses its
    link for good. The run completes exactly, without a retry, and every process of the cut host (torchrun, agent,
    fork server, workers, the replacement included) is gone within 30 s of the job's end: its agent's watchdog ends
    them."""
    faults = [Fault(60, "kill", 1), Fault(100, "cut", cut, math.inf)]
    outcome = run_schedule(make_job(), faults, KILL_THEN_CUT_STEPS, fault_free(KILL_THEN_CUT_STEPS))
    print(outcome)
    assert outcome.split("; ")[len(faults)].startswith("exact"), outcome
    assert "'retry'" not in outcome  # a lost spare host runs no member: the training generation is not cut off
    assert f"host {cut}'s torchrun" not in outcome


# -- the soak ---------------------------------------------------------------------------------------------------------
def _chaos_run(make_job, reference: Run, seed: int) -> str:
    faults = schedule(seed)
    print(f"netns chaos seed {seed}: {'; '.join(map(str, faults)) or 'no faults'}", flush=True)
    t0 = time.monotonic()
    try:
        outcome = run_schedule(make_job(f"seed{seed}"), faults, SOAK_STEPS, reference)
    except AssertionError as e:
        raise AssertionError(f"netns chaos seed {seed} (replay: {SEED_ENV}={seed} pytest -m soak -s "
                             f"tests/test_netns_chaos.py -k replay)\nschedule: {list(map(str, faults))}\n{e}") from e
    print(f"netns chaos seed {seed}: {time.monotonic() - t0:.0f}s: {outcome}", flush=True)
    return outcome


@pytest.mark.soak
@needs_netns
@pytest.mark.timeout(3600)
def test_soak_network_chaos_for_ten_minutes(make_job, fault_free):
    """Seeded schedules back to back for ten minutes (a seed drawn per soak, printed); every run is checked, and
    the soak fails at the end naming each run that did not hold, its seed and schedule."""
    reference = fault_free(SOAK_STEPS)
    first, failures, runs = random.randrange(10**6), [], 0
    deadline = time.monotonic() + SOAK_S
    while time.monotonic() < deadline:
        try:
            _chaos_run(make_job, reference, first + runs)
        except AssertionError as e:
            failures.append(str(e))
            print(f"FAILED {str(e)[:4000]}", flush=True)
        runs += 1
    print(f"netns chaos soak: {runs} runs from seed {first}, {len(failures)} failed")
    assert not failures, "\n\n".join(failures)


@pytest.mark.soak
@needs_netns
@pytest.mark.skipif(SEED_ENV not in os.environ, reason=f"set {SEED_ENV}=<seed> to replay one run of the soak")
def test_replay_one_seed_of_the_network_chaos_soak(make_job, fault_free):
    _chaos_run(make_job, fault_free(SOAK_STEPS), int(os.environ[SEED_ENV]))
