"""launcher.mode=per_host under real torchrun: three torchrun process trees as three hosts (two training hosts and a
spare host), each process a host's node agent, node 0's also the controller; the same under SLURM (its variables set
by hand); what per_host refuses."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from omegaconf import OmegaConf

from runner.config import ConfigError
from runner.control.records import Recovery
from runner.recovery.flash_ckpt.disk import read_verified
from runner.recovery.flash_ckpt.host_memory import SnapshotMemory
from runner.recovery.flash_names import flash_job_id
from runner.report.summary import recovery_entry
from tests import test_stragglers as stragglers
from tests.conftest import TP2_DP2, TP2PP2, TP2PP2_STEPS, TWO_BY_TWO, Run, read_summary  # and the fixture tp2pp2
from tests.local_hosts import (
    BASE,
    Job,
    c10d_rendezvous,
    events,
    free_port,
    max_step,
    power_off,
    processes_of,
    wait_for,
)
from tests.test_flashrecovery import HANG, HSDP, assert_hang_recovered
from tests.test_health import REFUSED, assert_spares_refused
from tests.test_ndb import ZERO_NDB, assert_exact_zero1_takeover, exact_zero1_takeover
from tests.test_pp_training import PP2, pp2  # noqa: F401  (pp2: the fixture, pp=2 dp=2's fault-free run)
from tests.test_tp_training import TP2, assert_replica_taken_over, tp2  # noqa: F401  (tp2: the fixture)
from tests.test_zero_tp import CONSTANT_LR, MASTER, STEPS, tp2_master  # noqa: F401  (tp2_master: the fixture)

LAYOUT = ["parallel.nodes=2", "parallel.procs_per_node=2", "parallel.spares=2", "ft=[flashrecovery,deadpool]",
          "trainer.max_steps=30"]
TWO_HOSTS = ["parallel.nodes=2", "parallel.procs_per_node=2", "trainer.max_steps=30"]  # no spare host
FLASH = [*TWO_HOSTS, "ft=[flash_ckpt]", "ft.flash_ckpt.every_n_steps=5"]
SECRET = {"RESILIENT_RUNNER_SECRET": "per-host-test-secret"}  # every host holds the job's secret


@pytest.fixture(scope="module")
def local_fault_free(two_by_two) -> dict:
    """The fault-free summary of the same layout (2 training hosts of 2 ranks, 30 steps) under launcher=local (the
    shared run of tests/conftest.py); neither the techniques in ``ft`` nor spare hosts change a fault-free run's
    training."""
    assert two_by_two.summary["status"] == "completed", two_by_two.output[-3000:]
    return two_by_two.summary


@pytest.fixture(scope="module")
def local_checksum(local_fault_free) -> str:
    """The fault-free checksum of the same layout under launcher=local."""
    return local_fault_free["param_checksum"]


# ZeRO-1 on two hosts of one rank, NDB with DeadPool's shard replicas and no spare host
ZERO1_NDB = [*ZERO_NDB, "parallel.spares=0"]


@pytest.fixture(scope="module")
def zero1_ndb(tmp_path_factory) -> Run:
    """The fault-free run of ZERO1_NDB as two per_host trees: the reference of its takeovers (a worker killed, a
    host lost), bit for bit, optimizer state included."""
    job = Job(tmp_path_factory.mktemp("zero1_ndb") / "run")
    try:
        run = run_on_hosts(job, 2, *ZERO1_NDB)
    finally:
        job.close()
    assert run.summary["status"] == "completed", run.output[-4000:]
    return run


def on_hosts(layout: list[str]) -> list[str]:
    """A layout of the local tests as the overrides of a torchrun tree, which names the recipe itself (BASE)."""
    return [o for o in layout if o not in BASE]


def hosts(job: Job, n: int, *overrides: str) -> list:
    """``n`` per_host torchrun trees of one job, one process each, started together."""
    rdzv = c10d_rendezvous()
    return [job.torchrun(n, 1, rdzv, 0, "launcher.mode=per_host", *overrides, extra_env=SECRET) for _ in range(n)]


def three_hosts(job: Job, *overrides: str, layout: list[str] = LAYOUT) -> list:
    return hosts(job, 3, *layout, *overrides)


def as_run(job: Job) -> Run:
    """A finished job read as the local tests read a run (summary, events, metrics), so their checks apply."""
    codes = job.wait()
    return read_run(job, max(codes, key=abs))


def read_run(job: Job, returncode: int) -> Run:
    return Run(subprocess.CompletedProcess([], returncode, job.output(), ""), job.run_dir)


def run_on_hosts(job: Job, trees: int, *overrides: str) -> Run:
    """The overrides (a local test's layout) run as ``trees`` per_host torchrun trees, every process gone at the end,
    read as a local run."""
    hosts(job, trees, *on_hosts(list(overrides)))
    run = as_run(job)
    assert_trees_end(job)
    return run


def launched_as_hosts(make_job, trees: int):
    """``run_cli``'s counterpart for helpers that launch their own runs: ``run_on_hosts`` in a directory of the
    test's own, one per run."""
    def launch(*overrides: str, run_dir) -> Run:
        return run_on_hosts(make_job(run_dir.parent.name), trees, *overrides)
    return launch


def hosts_behind_the_rendezvous_store(job: Job, hosts: int, *overrides: str) -> list:
    """``hosts`` torchrun trees, the first started alone until it hosts torchrun's rendezvous store, whose loss
    torchrun itself does not survive (so a test loses another host)."""
    return job.hosts_behind_the_rendezvous_store(hosts, *overrides, extra_env=SECRET)


def assert_survivors_end(job: Job, launchers: list) -> None:
    """Every process of the job ends within 30 s, the surviving hosts' torchruns too, each with 0: node 0 arrived
    in torchrun's exit barrier for the lost host, so nobody waits there for it."""
    wait_for("every process of the job to end", lambda: not processes_of(job.token), timeout_s=30)
    assert [p.wait(timeout=5) for p in launchers] == [0] * len(launchers)


def assert_trees_end(job: Job, timeout_s: float = 30.0) -> None:
    """Every process of the job (torchrun, agents, fork servers, workers) is gone within ``timeout_s``."""
    wait_for("every process of the job to end", lambda: not processes_of(job.token), timeout_s=timeout_s)


def summary(job: Job) -> dict:
    return read_summary(job.run_dir)


# -- configuration ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", ["kill_node", "wipe_shm", "corrupt_snapshot", "chaos"])
def test_per_host_refuses_faults_that_act_on_another_hosts_memory_or_agent(fault):
    from runner.launch.launcher import check_mode

    cfg = OmegaConf.create({"launcher": {"mode": "per_host", "secret_file": None}, "parallel": {"procs_per_node": 2},
                            "fault": {"kind": fault, "rank": 3, "extra": []}})
    with pytest.raises(ConfigError, match="launcher.mode=per_host"):
        check_mode(cfg, "torchrun")
    cfg.fault.kind = "kill_rank"  # any rank: the controller reaches every host's workers through their agents
    check_mode(cfg, "torchrun")


def test_a_host_lost_from_outside_is_at_the_step_in_progress_and_its_lost_steps_counted():
    """No injected fault names the step: it is the one after the last commit before the loss was detected."""
    rec = Recovery(id=0, t_detect=10.0, t_detect_mono=0.0, fault="node_loss", victims=[2, 3], action="restart_all",
                   full_gen=1)
    metrics = [{"step": s, "t": 1.0 + s, "gen": 0} for s in range(9)] + [{"step": 5, "t": 12.0, "gen": 1}]
    entry = recovery_entry(rec, [], metrics)
    assert (entry["step"], entry["rpo_steps"]) == (9, 4)  # steps 5..8 are done again
    swapped = [*metrics[:9], {"step": 9, "t": 12.0, "gen": 1}]
    assert recovery_entry(rec, [], swapped)["rpo_steps"] == 0


def test_a_fault_from_outside_after_an_injected_one_is_not_given_the_injected_fault_step():
    """Recovery 0 claimed the fault injected at step 2; recovery 1, a host lost later from outside, is at the
    step in progress when it was detected, not at the injected fault's step."""
    events = [{"kind": "fault_injected", "t": 3.0, "t_fault": 3.0, "step": 2, "at_step": 2},
              {"kind": "fault_detected", "t": 3.1, "step": -1, "recovery": 0},
              {"kind": "fault_detected", "t": 10.0, "step": -1, "recovery": 1}]
    metrics = [{"step": s, "t": 1.0 + s, "gen": 0} for s in range(9)] + [{"step": 9, "t": 12.0, "gen": 1}]
    first = Recovery(id=0, t_detect=3.1, t_detect_mono=0.0, fault="crash", victims=[1], action="restart_rank",
                     full_gen=1)
    later = Recovery(id=1, t_detect=10.0, t_detect_mono=0.0, fault="node_loss", victims=[2, 3], action="spare_swap",
                     full_gen=1)
    claimed, unclaimed = recovery_entry(first, events, metrics), recovery_entry(later, events, metrics)
    assert (claimed["step"], claimed["t_fault"]) == (2, 3.0)
    assert (unclaimed["step"], unclaimed["t_fault"]) == (9, 10.0)


# -- three hosts ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_three_hosts_complete_with_the_local_launchers_checksum(make_job, local_checksum):
    job = make_job()
    three_hosts(job)
    assert job.wait() == [0, 0, 0], job.output()
    s = summary(job)
    assert s["status"] == "completed" and s["recoveries"] == [] and s["param_checksum"] == local_checksum
    joined = events(job.run_dir, "host_joined")
    assert sorted((e["node"], e["role"]) for e in joined) == [(0, "controller"), (1, "agent"), (2, "agent")]
    assert len({e["pid"] for e in joined}) == 3 and len({e["control_store"] for e in joined}) == 1
    assert_trees_end(job)


@pytest.mark.slow
def test_under_slurm_three_hosts_complete_with_the_local_launchers_checksum(make_job, local_checksum):
    job = make_job()
    port = free_port()
    for node in range(3):  # srun --ntasks-per-node=1, its variables set by hand
        job.start([sys.executable, "-m", "runner", *BASE, "launcher.mode=per_host", *LAYOUT,
                   f"hydra.run.dir={job.run_dir}"],
                  {"SLURM_PROCID": str(node), "SLURM_NTASKS": "3", "SLURM_NNODES": "3", "SLURM_LOCALID": "0",
                   "SLURM_NODEID": str(node), "SLURM_JOB_ID": "4243", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), **SECRET})
    assert job.wait() == [0, 0, 0], job.output()
    s = summary(job)
    assert s["status"] == "completed" and s["param_checksum"] == local_checksum
    assert sorted(e["node"] for e in events(job.run_dir, "host_joined")) == [0, 1, 2]
    assert_trees_end(job)


# a worker of node 1 killed: (hosts, layout, its fault-free run, the killed rank, the ranks that log sending it their
# state, the workers started in all, the ZeRO-1 shard it gets back as (rank, holder, replayed updates)); at pp=2 rank
# 3 is the last stage of replica 1, served by the replica at its coordinate. With ZeRO-1 the restarted rank's shard
# comes from its holder (``shard_restored``) and the rest of its state from the member at its coordinate
# (``state_sent``): in DP replica groups of two (dp=4) rank 2's shard from rank 0, the same shard in the other group;
# at tp=2 with fp32 master weights rank 3's (the masters and their moments) from DeadPool's replica on rank 1,
# replica 0 at its TP coordinate
KILLED_WORKER = {
    "dp4": (3, LAYOUT, "two_by_two", 3, [0], 4 + 2 + 1, []),  # the spare host's two warm workers among them
    "pp2": (2, [*on_hosts(PP2), f"trainer.max_steps={TP2PP2_STEPS}", "ft=[flashrecovery]"], "pp2", 3, [1], 4 + 1, []),
    "hsdp": (2, [*TWO_HOSTS, *HSDP, "ft=[flashrecovery]"], "two_by_two", 2, [0], 4 + 1, [(2, 0, 0)]),
    "tp2_master": (3, [*on_hosts(TP2_DP2), *MASTER, CONSTANT_LR, f"trainer.max_steps={STEPS}", "parallel.spares=2",
                       "ft=[flashrecovery,deadpool]"], "tp2_master", 3, [1], 4 + 2 + 1, [(3, 1, 0)]),
}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=[pytest.mark.slow] if k != "dp4" else [])
                                    for k in sorted(KILLED_WORKER)])
def test_a_killed_worker_restarts_on_its_own_host_and_loses_nothing(layout, make_job, request):
    n, overrides, fault_free, killed, senders, started_in_all, shards = KILLED_WORKER[layout]
    ref = request.getfixturevalue(fault_free).summary
    job = make_job()
    hosts(job, n, *overrides, "fault=kill_rank", f"fault.rank={killed}", "fault.step=5")
    run = as_run(job)
    assert run.returncode == 0, job.output()
    s = run.summary
    assert s["status"] == "completed", job.output()
    (rec,) = s["recoveries"]
    assert (rec["fault"], rec["victims"], rec["action"], rec["rpo_steps"]) == (
        "process_crash", [killed], "restart_rank", 0)
    assert s["param_checksum"] == ref["param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    assert s["samples_committed"] == ref["samples_committed"]
    started = run.events("worker_started")
    (joiner,) = [e for e in started if e["role"] == "joiner"]
    killed_node = next(e["node"] for e in started if e["role"] == "initial" and e["wid"] == killed)
    assert joiner["node"] == killed_node == 1  # restarted by host 1's agent; nobody else restarted
    assert len(started) == started_in_all
    assert [e["rank"] for e in run.events("state_sent")] == senders
    assert [(e["rank"], e["holder"], e["replayed_updates"]) for e in run.events("shard_restored")] == shards
    assert_trees_end(job)


# What the old run leaves to resume from: a periodic last.ckpt, or (no last.ckpt at all) the flash snapshots that
# the surviving hosts' persisters write to disk when their agents stop their workers (the persist cadence lies
# beyond the steps the test waits for, so only those breakpoint persists write files)
KEPT_STATE = {
    "periodic_checkpoint": (LAYOUT, ["checkpoint.every_n_steps=5"]),
    "flash_snapshots": ([*(o for o in LAYOUT if not o.startswith("ft=")), "ft=[flashrecovery,deadpool,flash_ckpt]",
                         "ft.flash_ckpt.every_n_steps=5", "ft.flash_ckpt.persist_every_n_steps=1000"], []),
}


@pytest.mark.slow
@pytest.mark.parametrize("kept", sorted(KEPT_STATE))
def test_when_the_controllers_host_dies_every_other_host_exits_non_zero_and_a_relaunch_resumes(make_job, kept):
    layout, overrides = KEPT_STATE[kept]
    job = make_job()
    hosts = three_hosts(job, "trainer.max_steps=100000", *overrides, layout=layout)
    checkpoints = job.run_dir / "checkpoints"
    last = checkpoints / "last.ckpt"
    if kept == "periodic_checkpoint":
        wait_for("a periodic checkpoint", last.exists, procs=hosts)
    else:
        wait_for("two snapshots taken", lambda: max_step(job.run_dir) >= 12, procs=hosts)
    node0 = job.tree_of_node(0)
    power_off(node0)
    others = [p for p in hosts if p.pid != node0.pid]
    deadline = time.monotonic() + 60
    for p in others:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
    assert all(p.returncode != 0 for p in others), job.output()
    assert_trees_end(job)

    # the relaunch on every host: after a periodic checkpoint the same command in the same run dir (runner.resume=auto,
    # the default under torchrun, continues it in place); after flash snapshots a new run dir with runner.resume
    # naming the old one
    old_files = _hashes(job.run_dir)
    if kept == "periodic_checkpoint":
        newest = [last]
    else:  # node 1's ranks (2, 3) persisted their newest snapshots on the way out; node 0's were lost with it
        assert not last.exists()
        persisted = sorted(checkpoints.glob("step*-rank*.ckpt"))
        assert {p.name.split("-")[1] for p in persisted} == {"rank2.ckpt", "rank3.ckpt"}, persisted
        newest = [p for p in persisted if p.name.split("-")[0] == persisted[-1].name.split("-")[0]]
    at_step = torch.load(newest[0], map_location="cpu", weights_only=True)["global_step"]
    assert at_step >= (5 if kept == "periodic_checkpoint" else 10)
    in_place = kept == "periodic_checkpoint"
    again = make_job("run" if in_place else "relaunch")
    assert (again.run_dir == job.run_dir) == in_place
    resume = [] if in_place else [f"runner.resume={job.run_dir}"]
    three_hosts(again, f"trainer.max_steps={at_step + 5}", *resume, layout=layout)
    assert again.wait() == [0, 0, 0], again.output()
    s = summary(again)
    assert s["status"] == "completed" and s["global_step"] == at_step + 5, again.output()
    (resumed,) = events(again.run_dir, "resumed")
    assert resumed["at_step"] == at_step and resumed["path"] in {str(p.resolve()) for p in newest}
    steps = [json.loads(x)["step"] for x in (again.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(at_step, at_step + 5))  # steps 0 .. at_step - 1 are in the checkpoint
    if in_place:  # the old run's outputs moved to previous/0, unchanged; its checkpoint advanced to the new end
        previous = job.run_dir / "previous" / "0"
        kept_files = {f.relative_to(previous): h for f, h in _hashes(previous).items()}
        moved = {f.relative_to(job.run_dir): h for f, h in old_files.items()
                 if f.relative_to(job.run_dir).parts[0] not in (".hydra", "cli.log", "checkpoints")}
        assert kept_files == moved
        assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == at_step + 5
    else:  # the old run dir is only read
        assert old_files == _hashes(job.run_dir)
    assert_trees_end(again)


def test_a_host_agent_its_launcher_ends_finishes_its_breakpoint_persists_first(make_job):
    """torchrun ends its process, a host's node agent, with SIGTERM when its rendezvous store went away with node 0's
    host, often before the agent saw the controller go. The agent halts as after a lost controller: its workers
    killed, the breakpoint persists their deaths started finished (what a relaunch resumes from), exit 143; by
    default the signal would end it, and its persister with it, halfway through writing them."""
    layout, overrides = KEPT_STATE["flash_snapshots"]
    job = make_job()
    trees = three_hosts(job, "trainer.max_steps=100000", *overrides, layout=layout)
    wait_for("two snapshots taken", lambda: max_step(job.run_dir) >= 12, procs=trees)
    (tree1,) = [t for t in trees if t.pid == job.tree_of_node(1).pid]
    (joined,) = [e for e in events(job.run_dir, "host_joined") if e["node"] == 1]
    os.kill(joined["pid"], signal.SIGTERM)
    assert tree1.wait(timeout=60) != 0, job.output()  # its one process, the agent, ended non-zero
    # the other hosts' torchruns may end their agents the same way once host 1's closed its rendezvous
    (halt,) = [e for e in events(job.run_dir, "agent_terminated") if e["node"] == 1]
    assert halt["exit_code"] == 143, halt
    persisted = [e for e in events(job.run_dir, "snapshot_breakpoint_persisted") if e["rank"] == "persister-n1"]
    assert sorted(e["snapshot_rank"] for e in persisted) == [2, 3], (persisted, job.output())
    for e in persisted:
        assert read_verified(Path(e["path"]))["global_step"] == e["snapshot_step"] >= 10
    assert not list((job.run_dir / "checkpoints").glob(".*-rank[23].ckpt*.tmp*")), "a persist was left half-written"
    # host 1's torchrun then closes its rendezvous; whether the other hosts' torchruns end their agents too depends
    # on when they next look (the job may train on without host 1): the test ends them
    for tree in trees:
        if tree.poll() is None:
            power_off(psutil.Process(tree.pid))
    assert_trees_end(job)


def _hashes(directory: Path) -> dict[Path, str]:
    return {f: hashlib.sha256(f.read_bytes()).hexdigest() for f in directory.rglob("*") if f.is_file()}


def _complete_after_losing_host_1(job: Job, hosts: int, *overrides: str) -> tuple[dict, list]:
    """Start the hosts, power off host 1 once training runs, and return the completed run's summary and the
    other trees."""
    trees = hosts_behind_the_rendezvous_store(job, hosts, *overrides)
    wait_for("training", lambda: max_step(job.run_dir) >= 3, procs=trees)
    rest = job.lose_host(trees, 1)
    wait_for("the summary", lambda: (job.run_dir / "summary.json").exists(), procs=rest)
    s = summary(job)
    assert s["status"] == "completed", job.output()
    return s, rest


# host 1 lost, a spare host of as many ranks: (layout, its fault-free run, host 1's ranks, the ranks that serve their
# state, the ZeRO-1 shards the spares get back as {rank: holder}); at tp=2 host 1 holds replica 1, at tp=2 pp=2
# replica 1's two stages, and the spare host takes every coordinate, each served by replica 0's rank at it (at
# tp = pp = 1 one coordinate, served by rank 0). With ZeRO-1 (tp=2, fp32 master weights) each spare's shard (its fp32
# masters and their moments) comes from DeadPool's replica on replica 0's rank at its TP coordinate
# (``shard_restored``), and the rest of its state from that rank (``state_sent``)
SPARE_HOST = {
    "dp4": (LAYOUT, "two_by_two", [2, 3], [0], {}),
    "tp2": ([*on_hosts(TP2), "parallel.spares=2", "ft=[deadpool]"], "tp2", [2, 3], [0, 1], {}),
    "tp2pp2": ([*on_hosts(TP2PP2), f"trainer.max_steps={TP2PP2_STEPS}", "parallel.spares=4", "ft=[deadpool]"],
               "tp2pp2", [4, 5, 6, 7], [0, 1, 2, 3], {}),
    "tp2_master": ([*on_hosts(TP2_DP2), *MASTER, CONSTANT_LR, f"trainer.max_steps={STEPS}", "parallel.spares=2",
                    "ft=[deadpool]"], "tp2_master", [2, 3], [0, 1], {2: 0, 3: 1}),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(SPARE_HOST))
def test_a_lost_training_host_is_replaced_by_the_spare_host(layout, make_job, request):
    overrides, fault_free, lost, sources, shards = SPARE_HOST[layout]
    ref = request.getfixturevalue(fault_free).summary
    job = make_job()
    s, rest = _complete_after_losing_host_1(job, 3, *overrides)
    (rec,) = s["recoveries"]
    assert (rec["fault"], rec["action"], rec["victims"]) == ("node_loss", "swap_spare", lost)
    assert rec["step"] > 3 and rec["rpo_steps"] == 0  # the spares resumed at the step the host was lost in
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    assert s["samples_committed"] == ref["samples_committed"] and s["param_checksum"] == ref["param_checksum"]
    assigned = events(job.run_dir, "spare_assigned")
    assert sorted(e["logical"] for e in assigned) == lost and {e["node"] for e in assigned} == {2}
    restored = events(job.run_dir, "state_restored")
    assert sorted(e["rank"] for e in restored if e["role"] == "joiner") == ([] if shards else lost)
    # a survivor whose reduction of the step in progress had not ended when the host was lost is a step behind the
    # others: a laggard, served the newest state by the next survivor at its coordinate
    laggards = {e["rank"] for e in restored if e["role"] == "laggard"}
    sent = sorted(e["rank"] for e in events(job.run_dir, "state_sent"))
    assert sent == sources or (laggards and len(sent) == len(sources) and not laggards & {*sent, *lost}), \
        (sent, laggards)
    assert {e["rank"]: e["holder"] for e in events(job.run_dir, "shard_restored")} == shards
    assert_survivors_end(job, rest)


@pytest.mark.slow
def test_covering_neighbours_take_over_a_lost_hosts_ranks(make_job, local_fault_free):
    job = make_job()
    s, rest = _complete_after_losing_host_1(job, 2, *TWO_HOSTS, "ft=[ndb]")
    (rec,) = s["recoveries"]
    assert (rec["fault"], rec["action"], rec["victims"]) == ("node_loss", "takeover", [2, 3])
    assert len(events(job.run_dir, "worker_started")) == 4  # nobody restarted: node 0's ranks compute node 1's too
    assert sorted(t["extra_ranks"] for t in s["takeovers"]) == [[2], [3]]
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    assert (s["global_step"], s["samples_committed"]) == (local_fault_free["global_step"],
                                                         local_fault_free["samples_committed"])
    # NDB approximates the taken-over micro-batches (docs/recovery.md): no equal checksum, the loss stays close
    drift = abs(s["final_loss"] - local_fault_free["final_loss"]) / local_fault_free["final_loss"]
    assert drift < 0.01, (s["final_loss"], local_fault_free["final_loss"])
    assert_survivors_end(job, rest)


@pytest.mark.slow
def test_ndb_at_tp2_without_approximations_takes_a_killed_workers_replica_over_exactly(make_job, tp2):  # noqa: F811
    """Rank 2, TP slice 0 of replica 1 (host 1), killed: its partner rank 3 stops, and host 0's ranks 0 and 1 compute
    ranks 2 and 3 besides their own, at their own TP coordinates; computed exactly, the fault-free run bit for bit."""
    job = make_job()
    hosts(job, 2, *on_hosts(TP2), "ft=[ndb]", "ft.ndb.exact_reference=true",
          "fault=kill_rank", "fault.rank=2", "fault.step=8")
    run = as_run(job)
    s = assert_replica_taken_over(run, tp2.summary, failed=2, stopped=3, neighbours=[(2, 0), (3, 1)])
    assert s["param_checksum"] == tp2.summary["param_checksum"]
    assert_trees_end(job)


@pytest.mark.slow
def test_ndb_repair_at_tp2_restarts_the_taken_over_replica_on_its_host_exactly(make_job, tp2):  # noqa: F811
    """The same kill with ``ft.ndb.repair_after_s=0``: once host 0 computed replica 1 for a step, both ranks of
    replica 1 restart on host 1 as joiners, each from its TP coordinate's peer on host 0, and the takeover ends;
    computed exactly throughout, the fault-free run bit for bit."""
    job = make_job()
    hosts(job, 2, *on_hosts(TP2), "ft=[ndb]", "ft.ndb.exact_reference=true", "ft.ndb.repair_after_s=0",
          "fault=kill_rank", "fault.rank=2", "fault.step=8")
    run = as_run(job)
    s, ref = run.summary, tp2.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert [e["logical"] for e in run.events("repair_started")] == [2, 3]
    assert [e["logical"] for e in run.events("rejoined")] == [2, 3]
    restarted = [e for e in run.events("worker_started") if e["wid"] >= 4]
    assert sorted(e["node"] for e in restarted) == [1, 1]  # on their own host
    assert s["param_checksum"] == ref["param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    assert (s["global_step"], s["samples_committed"]) == (ref["global_step"], ref["samples_committed"])
    assert_trees_end(job)


@pytest.mark.slow
def test_zero1_takeover_carries_the_failed_shard_from_deadpools_replica_across_hosts(make_job, tmp_path_factory,
                                                                                    zero1_ndb):
    """Two hosts of one rank, ZeRO-1, ``ft=[ndb,deadpool]`` without a spare host: rank 1 (host 1) killed at step 8,
    rank 0 on host 0 computes its micro-batch and carries its optimizer shard from DeadPool's replica; the run is the
    fault-free run of the same layout under per_host bit for bit, optimizer state included."""
    run = exact_zero1_takeover(ZERO1_NDB, [], 1, tmp_path_factory, launch=launched_as_hosts(make_job, 2),
                                fault_free=zero1_ndb)
    assert [(e["logical"], e["step"]) for e in run.events("shard_carried")] == [(1, 8)]
    assert [e["covered"] for e in run.events("replication_suspended")] == [[1]]
    assert len(run.events("worker_started")) == 2  # nobody restarted


@pytest.mark.slow
def test_zero1_takeover_of_a_lost_host_carries_its_shard_from_deadpools_replica(make_job, zero1_ndb):
    """The same layout, host 1 lost (its tree killed; a node loss once its heartbeat stops): rank 0 takes rank 1's
    micro-batch over and carries its shard from the replica it holds, from the step the loss interrupted; the
    fault-free run bit for bit, optimizer state included."""
    job = make_job()
    s, rest = _complete_after_losing_host_1(job, 2, *on_hosts(ZERO1_NDB))
    run = read_run(job, 0)  # completed
    assert_exact_zero1_takeover(run, zero1_ndb, [1])
    (rec,) = s["recoveries"]
    assert rec["fault"] == "node_loss" and rec["step"] > 3
    assert [(e["logical"], e["step"]) for e in run.events("shard_carried")] == [(1, rec["step"])]
    assert [e["covered"] for e in run.events("replication_suspended")] == [[1]]
    assert len(run.events("worker_started")) == 2  # nobody restarted
    assert_survivors_end(job, rest)


@pytest.mark.slow
@pytest.mark.parametrize("fault_step", [23, 3])
def test_flash_ckpt_restarts_every_worker_killed_on_every_host_exactly(make_job, local_checksum, fault_step):
    """At step 23 every rank restores step 20's snapshot from memory; at step 3, before the first snapshot (step 5),
    every rank starts again from step 0."""
    resumed_at = fault_step // 5 * 5
    job = make_job()
    rdzv = c10d_rendezvous()
    for _ in range(2):  # the agents stay up; the controller kills every worker through them
        job.torchrun(2, 1, rdzv, 0, "launcher.mode=per_host", *FLASH, "ft.flash_ckpt.persist_every_n_steps=50",
                     "fault=kill_all", f"fault.step={fault_step}", extra_env=SECRET)
    assert job.wait() == [0, 0], job.output()
    s = summary(job)
    assert s["status"] == "completed", job.output()
    (rec,) = s["recoveries"]
    assert (rec["action"], rec["step"], rec["rpo_steps"]) == ("restart_all", fault_step, fault_step - resumed_at)
    restored = events(job.run_dir, "snapshot_restored")
    starts = events(job.run_dir, "restart_from_start")
    if resumed_at:
        assert sorted((e["rank"], e["step"], e["source"]) for e in restored) == [
            (r, resumed_at, "memory") for r in range(4)]
        assert not starts
        # each host's persister wrote its killed ranks' step to disk (not yet persisted: every 50 steps), and it had
        # finished before that host's restarted ranks listed their snapshots: they settle it first
        persisted = events(job.run_dir, "snapshot_breakpoint_persisted")
        assert sorted((e["snapshot_rank"], e["snapshot_step"]) for e in persisted) == [
            (r, resumed_at) for r in range(4)]
        assert max(e["t"] for e in persisted) < min(e["t"] for e in restored)
    else:
        assert not restored and [e["rank"] for e in starts] == [0]
    assert s["samples_lost"] == 0 and s["param_checksum"] == local_checksum
    assert_trees_end(job)


# two hosts, host 1 lost with its memory: (layout, its fault-free run); at tp=2 host 1 holds replica 1's two TP
# slices, whose partner copies host 0 holds; in DP replica groups of two (ZeRO-1, dp=4) host 1 holds replica group 1,
# each rank's snapshot with its optimizer shard
PARTNER_HOST = {
    "dp4": (FLASH, "two_by_two"),
    "hsdp": ([*FLASH, *HSDP], "two_by_two"),
    "tp2": ([*on_hosts(TP2), "ft=[flash_ckpt]", "ft.flash_ckpt.every_n_steps=5"], "tp2"),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(PARTNER_HOST))
def test_flash_ckpt_restores_a_lost_hosts_ranks_from_the_partner_hosts_memory(layout, make_job, request):
    overrides, fault_free = PARTNER_HOST[layout]
    ref = request.getfixturevalue(fault_free).summary
    job = make_job()
    hosts = hosts_behind_the_rendezvous_store(job, 2, *overrides, "ft.flash_ckpt.persist_every_n_steps=0")
    wait_for("a snapshot", lambda: max_step(job.run_dir) >= 7, procs=hosts)
    rest = job.lose_host(hosts, 1)
    # its memory goes with it: its ranks' own snapshots and the partner copies it held (one /dev/shm here)
    SnapshotMemory(flash_job_id(job.run_dir)).drop_node([2, 3])
    wait_for("the summary", lambda: (job.run_dir / "summary.json").exists(), procs=rest)
    s = summary(job)
    assert s["status"] == "completed", job.output()
    (rec,) = s["recoveries"]
    assert (rec["fault"], rec["action"], rec["victims"]) == ("node_loss", "restart_all", [2, 3])
    restored = {e["rank"]: e for e in events(job.run_dir, "snapshot_restored")}
    assert {r: e["source"] for r, e in restored.items()} == {0: "memory", 1: "memory", 2: "partner", 3: "partner"}
    assert len({e["step"] for e in restored.values()}) == 1
    moved = [e for e in events(job.run_dir, "worker_started") if e["role"] == "restore" and e["rank"] in (2, 3)]
    assert {e["node"] for e in moved} == {0}  # the lost host's ranks restart on its partner host
    assert (s["samples_lost"], s["samples_duplicated"]) == (0, 0) and s["param_checksum"] == ref["param_checksum"]
    assert_survivors_end(job, rest)


# -- stragglers, hangs, health checks: the simulations' runs and checks (tests/test_stragglers.py,
# tests/test_flashrecovery.py, tests/test_health.py) with every host a torchrun tree of its own ----------------------
@pytest.mark.slow
def test_a_slow_rank_is_swapped_out_with_its_host_for_the_spare_host(make_job, local_fault_free):
    """Rank 3 (host 1) slow from step 5: found within the window, host 1's ranks released at a committed step through
    its agent and taken by the spare host's warm workers; the fault-free run exactly."""
    job = make_job()
    hosts(job, 3, *on_hosts(stragglers.SPARE_HOST), "policy.straggler=[swap_spare,report]")
    run = as_run(job)
    assert run.returncode == 0, job.output()
    stragglers.assert_swapped_out(run, local_fault_free)
    assert_trees_end(job)


@pytest.mark.slow
def test_a_hung_rank_on_another_host_is_diagnosed_and_recovered(make_job, local_fault_free):
    """Rank 3, on host 1, SIGSTOPped by its agent at step 10: every other rank dumps its stacks on its own host's
    agent's signal before the hung rank is killed, and the verdict names it."""
    job = make_job()
    hosts(job, 2, *on_hosts(TWO_BY_TWO), *HANG, "fault.rank=3")
    run = as_run(job)
    assert run.returncode == 0, job.output()
    assert_hang_recovered(run, local_fault_free, hung=3)
    assert_trees_end(job)


@pytest.mark.slow
def test_a_spare_host_that_fails_its_health_check_is_refused_and_the_job_trains_on(make_job, local_fault_free):
    """The spare host's workers exit unhealthy (their agent reports the exit); every tree ends 0."""
    job = make_job()
    hosts(job, 3, *on_hosts(REFUSED))
    run = as_run(job)
    assert run.returncode == 0, job.output()
    assert_spares_refused(run, local_fault_free)
    assert_trees_end(job)


@pytest.mark.slow
def test_a_host_whose_command_line_differs_is_refused(make_job):
    job = make_job()
    rdzv = c10d_rendezvous()
    layout = ["launcher.mode=per_host", "parallel.nodes=2", "parallel.procs_per_node=1", "ft=[flashrecovery]"]
    for lr in ("3e-3", "4e-3"):  # whichever host is not node 0 composes another config than the controller's
        job.torchrun(2, 1, rdzv, 0, *layout, f"trainer.lr={lr}", extra_env=SECRET)
    assert all(rc != 0 for rc in job.wait()), job.output()
    (refused,) = events(job.run_dir, "agent_refused")
    assert refused["node"] == 1 and "differs from the config the controller signed" in refused["reason"]
    assert job.printed("the node agent of host 1 refused to start"), job.output()
    s = summary(job)  # the refusal is the run's verdict: summary.json and run_end say so
    assert s["status"] == "failed" and "host 1 refused to start" in s["error"] and "differs" in s["error"]
    (end,) = events(job.run_dir, "run_end")
    assert time.time() - end["t"] < 10, "the other hosts took longer than 10 s to exit after the refusal"
    assert_trees_end(job)


@pytest.mark.slow
def test_a_host_with_another_layout_is_refused_at_once(make_job):
    """One host asks for parallel.nodes=3 while torchrun started two (its config refused: the global batch does not
    divide over 3 ranks): whichever node it is, the job fails at once naming the reason (not after
    launcher.start_timeout_s), and every host exits non-zero."""
    job = make_job()
    rdzv = c10d_rendezvous()
    layout = ["launcher.mode=per_host", "parallel.procs_per_node=1", "ft=[flashrecovery]",
              "launcher.start_timeout_s=300"]
    started = time.monotonic()
    for nodes in (2, 3):
        job.torchrun(2, 1, rdzv, 0, *layout, f"parallel.nodes={nodes}", extra_env=SECRET)
    assert all(rc != 0 for rc in job.wait()), job.output()
    assert time.monotonic() - started < 200, "the hosts waited out launcher.start_timeout_s"
    why = "trainer.global_batch_size=8 must be divisible by the data-parallel size 3"
    assert job.printed(why), job.output()
    if (job.run_dir / "summary.json").exists():  # node 1 refused: node 0's controller failed at once, naming it
        s = summary(job)
        assert s["status"] == "failed" and "host 1 refused to start" in s["error"] and why in s["error"]
    else:  # node 0 refused: it published why instead of the control address, and node 1 left reading it
        assert job.printed("node 0 refused to start"), job.output()
    assert_trees_end(job)


def test_a_host_without_the_jobs_secret_is_refused_before_anything_starts(make_job):
    job = make_job()
    assert "RESILIENT_RUNNER_SECRET" not in os.environ
    job.torchrun(1, 1, ["--standalone"], 0, "launcher.mode=per_host", "parallel.nodes=1", "parallel.procs_per_node=1")
    assert job.wait() != [0]
    assert job.printed("set RESILIENT_RUNNER_SECRET on every host"), job.output()
    assert not (job.run_dir / "events.jsonl").exists()
