"""launcher.mode=per_rank under real torchrun (two torchrun invocations as two hosts) and SLURM (variables
set by hand): the attempt all ranks agree on, kill_rank, a restart resuming from flash checkpoints, the
summary of every attempt, prompt SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from omegaconf import OmegaConf
from torch.distributed import PrefixStore, TCPStore

from runner.config import ConfigError
from tests.conftest import ONE_BY_TWO, Run, assert_nothing_left, read_summary
from tests.local_hosts import BASE, Job, c10d_rendezvous, events, free_port, max_step, wait_for

REFERENCE = ONE_BY_TWO[1:]  # the shared fault-free run's LR and length (its recipe is BASE's)


@pytest.fixture(scope="module")
def fault_free(one_by_two) -> str:
    """The checksum of a fault-free 30-step run with two data-parallel ranks (the local launcher's, shared:
    tests/conftest.py; its checkpoints do not change its training)."""
    assert one_by_two.summary["status"] == "completed", one_by_two.output[-3000:]
    return one_by_two.summary["param_checksum"]


# -- configuration ------------------------------------------------------------------------------------
def _cfg(**keys):
    cfg = OmegaConf.create({"launcher": {"mode": "auto", "secret_file": None, "control_host": None},
                            "parallel": {"procs_per_node": 2}, "fault": {"kind": "none", "rank": 0, "extra": []},
                            "heartbeat": {"route": "store"}})
    for key, value in keys.items():
        OmegaConf.update(cfg, key, value)
    return cfg


@pytest.mark.parametrize("keys, kind, refused", [
    ({"launcher.mode": "per_rank"}, "local", "leave launcher.mode=auto"),
    ({"fault.kind": "kill_rank", "fault.rank": 2}, "torchrun", "ranks 1..1"),
    ({"fault.kind": "kill_rank", "fault.rank": 0}, "slurm", "ranks 1..1"),
    ({"fault.kind": "kill_node"}, "torchrun", "only the ranks of its own host"),
    ({"fault.kind": "kill_all"}, "slurm", "only the ranks of its own host"),
    ({"launcher.secret_file": "/etc/hostname"}, "torchrun", "drop launcher.secret_file"),
    ({"launcher.control_host": "10.0.0.1"}, "torchrun", "drop launcher.control_host"),
    ({"launcher.control_host": "127.0.0.1"}, "local", "drop launcher.control_host"),
    ({"ft": {"flashrecovery": {"standby": True}}}, "torchrun", "set ft.flashrecovery.standby=false"),
])
def test_what_per_rank_cannot_do_is_refused_before_anything_starts(keys, kind, refused):
    from runner.launch.launcher import check_mode

    with pytest.raises(ConfigError, match=refused):
        check_mode(_cfg(**keys), kind)
    check_mode(_cfg(**{"fault.kind": "kill_rank", "fault.rank": 1}), "torchrun")  # a rank of rank 0's host
    check_mode(_cfg(**{"launcher.mode": "per_rank"}), "torchrun")
    check_mode(_cfg(**{"launcher.mode": "per_host", "launcher.control_host": "10.0.0.1"}), "torchrun")


# -- the attempt id and the attempts' accounting, in process --------------------------------------------------
def test_a_rank_never_reads_an_earlier_attempts_id():
    from runner.launch.attempt import AttemptHost, join_attempt

    def client():
        return TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    first = AttemptHost(client(), "job", "/runs/first")
    assert join_attempt(client(), "job", 10) == (1, "/runs/first")
    first.close()  # the launcher stopped every process of attempt 1
    ticket_before_rank0 = client()  # a rank of attempt 2 that starts before its rank 0 does
    answer: list = []
    waiter = threading.Thread(target=lambda: answer.append(join_attempt(ticket_before_rank0, "job", 10)))
    waiter.start()
    second = AttemptHost(client(), "job", "/runs/second-hydra-dir")
    waiter.join()
    second.close()
    assert answer == [(2, "/runs/first")]  # the new attempt, in the job's one run directory


def test_each_failed_attempt_is_a_launcher_restart_in_the_summary():
    from runner.control.records import Attempt
    from runner.report.summary import _attempt_entries, _launcher_restarts

    attempts = [Attempt(1, 100.0, 110.0, "failed", "process_crash of [3]", 12),
                Attempt(2, 120.0),  # its rank 0 was lost: no end record
                Attempt(3, 160.0)]
    metrics = [{"step": s, "t": 100.0 + s} for s in range(12)]  # attempt 1: steps 0..11
    metrics += [{"step": s, "t": 122.0 + s} for s in range(10, 15)]  # attempt 2 resumed at 10, reached 14
    metrics += [{"step": s, "t": 165.0 + s} for s in range(0, 20)]  # attempt 3: from step 0 (no snapshot)
    first, second = _launcher_restarts(attempts, metrics)
    assert (first["step"], first["rpo_steps"], first["rto_s"]) == (12, 2, 132.0 - 110.0)  # to the commit of step 10
    assert (second["step"], second["rpo_steps"], second["t_fault"], second["resumed_step"]) == (15, 15, 160.0, 0)
    assert "lost" in second["reason"]
    entries = _attempt_entries(attempts, metrics, "completed", "", 20)
    assert [e["status"] for e in entries] == ["failed", "unrecorded", "completed"]
    assert [e["step"] for e in entries] == [12, 15, 20]


def test_a_failed_attempts_step_is_the_one_after_its_newest_commit_whatever_its_heartbeats_said():
    """Rank 0 records the newest step a heartbeat reported when its attempt ends: behind the commits on a loaded
    host, or one ahead when a rank finished a step whose commit never happened. The restart's RPO counts the
    commits the next attempt redoes; the record counts only when the attempt committed nothing."""
    from runner.control.records import Attempt
    from runner.report.summary import _attempt_entries, _launcher_restarts

    metrics = [{"step": s, "t": 100.0 + s} for s in range(5)]  # attempt 1: steps 0..4, killed in step 5
    metrics += [{"step": s, "t": 130.0 + s} for s in range(3, 10)]  # attempt 3 resumed at 3 (attempt 2: nothing)
    for recorded in (1, 5, 6):
        attempts = [Attempt(1, 100.0, 105.5, "failed", "process_crash of [1]", recorded),
                    Attempt(2, 110.0, 120.0, "failed", "rendezvous timed out", 4), Attempt(3, 125.0)]
        first, second = _launcher_restarts(attempts, metrics)
        assert (first["step"], first["rpo_steps"], first["resumed_step"]) == (5, 2, 3)  # steps 3 and 4 redone
        assert (second["step"], second["rpo_steps"], second["resumed_step"]) == (4, 1, 3)
        assert [e["step"] for e in _attempt_entries(attempts, metrics, "completed", "", 10)] == [5, 4, 10]


# -- two hosts, one rank of host 1 killed, resumed from flash checkpoints ------------------------------------
@pytest.fixture(scope="module")
def two_host_restart(tmp_path_factory):
    """Two torchrun invocations (2 hosts x 2 ranks, c10d rendezvous, --max-restarts=2), ft=[flash_ckpt];
    global rank 3 (host 1) is killed with SIGKILL once step 8 is on disk for every rank."""
    from runner.recovery.flash_ckpt.hygiene import cleanup
    from runner.recovery.flash_names import flash_job_id

    job = Job(tmp_path_factory.mktemp("two_hosts") / "run")
    rdzv = c10d_rendezvous()
    overrides = ["trainer.max_steps=24", "parallel.nodes=2", "parallel.procs_per_node=2", "ft=[flash_ckpt]",
                 "ft.flash_ckpt.every_n_steps=2", "ft.flash_ckpt.persist_every_n_steps=4", "ft.flash_ckpt.keep=10",
                 # four ranks starting on a busy 2-core host miss heartbeats: the kill is seen by the survivors
                 "heartbeat.misses=100", "heartbeat.stall_timeout_s=60"]
    try:
        hosts = [job.torchrun(2, 2, rdzv, 2, *overrides) for _ in range(2)]
        ckpts = job.run_dir / "checkpoints"

        def on_disk(step):
            return all((ckpts / f"step{step:09d}-rank{r}.ckpt").exists() for r in range(4)) and sorted(ckpts.glob("*"))

        wait_for("step 8 persisted by every rank", lambda: on_disk(8), procs=hosts)
        disk_before = {p.name: p.stat().st_mtime_ns for p in ckpts.glob("step*.ckpt")}
        victim = next(e for e in events(job.run_dir, "attempt_joined") if e["rank"] == 3)
        assert victim["node"] == 1
        os.kill(victim["pid"], signal.SIGKILL)
        t_kill = time.time()
        codes = job.wait()
        assert codes == [0, 0], job.output()
        yield job.run_dir, disk_before, t_kill
    finally:
        job.close()
        cleanup(flash_job_id(job.run_dir))
        assert_nothing_left(job.token, Run(subprocess.CompletedProcess([], 0, "", ""), job.run_dir))


@pytest.mark.slow
def test_the_ranks_of_each_attempt_agree_on_its_namespace(two_host_restart):
    run_dir, _, _ = two_host_restart
    joined = events(run_dir, "attempt_joined")
    attempts = sorted({e["attempt"] for e in joined})
    assert len(attempts) >= 2, joined
    for a in attempts[-1:]:  # the attempt that completed: every rank, once, in one namespace
        mine = [e for e in joined if e["attempt"] == a]
        assert sorted(e["rank"] for e in mine) == [0, 1, 2, 3], joined
        assert len({e["namespace"] for e in mine}) == 1
    assert all(e["launcher_restarted"] for e in joined if e["attempt"] > 1 and e["node"] == 1)


@pytest.mark.slow
def test_a_torchrun_restart_resumes_from_the_snapshots_and_keeps_the_disk_checkpoints(two_host_restart):
    run_dir, disk_before, t_kill = two_host_restart
    restored = [e for e in events(run_dir, "snapshot_restored") if e["t"] > t_kill]
    assert len(restored) == 4 and len({e["step"] for e in restored}) == 1, restored
    resumed = restored[0]["step"]
    assert resumed >= 8
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # the new attempt's first commit is the restored step, past step 0 (a step whose reduction finished just before
    # the kill may still be committed by the old attempt after it: the restore comes after the old attempt ended)
    t_restored = min(e["t"] for e in restored)
    assert min(m["step"] for m in metrics if m["t"] > t_restored) == resumed
    for name, mtime in disk_before.items():  # nothing written over or removed
        path = run_dir / "checkpoints" / name
        assert path.exists() and path.stat().st_mtime_ns == mtime, name


@pytest.mark.slow
def test_the_summary_accounts_for_the_failed_attempt(two_host_restart):
    run_dir, _, t_kill = two_host_restart
    s = read_summary(run_dir)
    assert s["status"] == "completed" and s["global_step"] == 24
    assert [a["status"] for a in s["attempts"]] == ["failed", "completed"], s["attempts"]
    failed = s["attempts"][0]
    assert failed["t_end"] >= t_kill and failed["step"] >= 8
    restart = [r for r in s["recoveries"] if r["action"] == "launcher_restart"]
    assert len(restart) == 1 and restart[0]["rto_s"] > 0
    assert restart[0]["rpo_steps"] == failed["step"] - min(
        e["step"] for e in events(run_dir, "snapshot_restored") if e["t"] > t_kill)
    assert s["effective_training_time_ratio"] < 1.0
    assert s["samples_lost"] == 0 and s["steps_redone"] == restart[0]["rpo_steps"]


# -- one host ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_kill_rank_kills_a_rank_of_rank_0s_host_and_the_restart_completes(make_job, fault_free):
    job = make_job()
    job.torchrun(1, 2, ["--standalone"], 1, *REFERENCE, "fault=kill_rank", "fault.rank=1",
                 "fault.step=5")
    assert job.wait() == [0], job.output()
    s = read_summary(job.run_dir)
    injected = events(job.run_dir, "fault_injected")
    assert [e["victims"] for e in injected] == [[1]]  # carried out once per job, not again in the restart
    assert [a["status"] for a in s["attempts"]] == ["failed", "completed"]
    (restart,) = [r for r in s["recoveries"] if r["action"] == "launcher_restart"]
    assert restart["step"] == 5 and restart["rpo_steps"] == 5 and restart["resumed_step"] == 0  # no flash_ckpt
    assert s["status"] == "completed" and s["param_checksum"] == fault_free


def test_sigterm_ends_a_rank_blocked_in_a_collective_at_once(make_job):
    job = make_job()
    # the controller must not notice the stopped rank (and kill it as hung) while the test looks on
    torchrun = job.torchrun(1, 2, ["--standalone"], 0, "trainer.max_steps=100000", "heartbeat.misses=600",
                            "heartbeat.stall_timeout_s=600")
    joined = wait_for("both ranks joined", lambda: len(events(job.run_dir, "attempt_joined")) == 2
                      and events(job.run_dir, "attempt_joined"), procs=[torchrun])
    wait_for("training", lambda: max_step(job.run_dir) >= 2, procs=[torchrun])
    pid = {e["rank"]: e["pid"] for e in joined}
    port = events(job.run_dir, "run_start")[0]["store_port"]
    store = PrefixStore(joined[0]["namespace"], TCPStore("127.0.0.1", port, is_master=False,
                                                         timeout=timedelta(seconds=30)))
    hb = "hb/0"
    os.kill(pid[1], signal.SIGSTOP)
    try:
        seen: list[dict] = []

        def blocked():  # rank 0 waits in the reduction of a step rank 1 never joins: its heartbeats go on
            seen.append(json.loads(store.get(hb)))
            first = next((b for b in seen if b["phase"] == "reduce" and b["step"] == seen[-1]["step"]), None)
            return seen[-1]["phase"] == "reduce" and first is not None and seen[-1]["seq"] >= first["seq"] + 3

        wait_for("rank 0 blocked in the reduction", blocked, procs=[torchrun])
        t0 = time.monotonic()
        os.kill(pid[0], signal.SIGTERM)
        wait_for("rank 0 gone", lambda: not _alive(pid[0]), timeout_s=10)
        assert time.monotonic() - t0 < 5.0
    finally:
        os.kill(pid[1], signal.SIGCONT)
    t0 = time.monotonic()
    torchrun.wait(timeout=30)
    assert time.monotonic() - t0 < 10.0  # rank 1, terminated by torchrun, leaves at once too
    attempts = [json.loads(x) for x in (job.run_dir / "attempts.jsonl").read_text().splitlines()]
    assert attempts[-1]["status"] == "failed" and "SIGTERM" in attempts[-1]["error"]
    assert_nothing_left(job.token, Run(subprocess.CompletedProcess([], 0, "", ""), job.run_dir))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# -- SLURM, variables set by hand -----------------------------------------------------------------------------
def test_under_slurm_two_hosts_complete_with_the_fault_free_checksum(make_job, fault_free):
    job = make_job()
    port = free_port()
    for rank in range(2):
        job.start([sys.executable, "-m", "runner", *BASE, *REFERENCE, "parallel.nodes=2",
                   "parallel.procs_per_node=1", f"hydra.run.dir={job.run_dir}"],
                  {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": str(rank),
                   "SLURM_JOB_ID": "4242", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert job.wait() == [0, 0], job.output()
    s = read_summary(job.run_dir)
    assert s["status"] == "completed" and s["world_size"] == 2 and s["param_checksum"] == fault_free
    assert [e["node"] for e in sorted(events(job.run_dir, "attempt_joined"), key=lambda e: e["rank"])] == [0, 1]
    assert_nothing_left(job.token, Run(subprocess.CompletedProcess([], 0, "", ""), job.run_dir))
