"""Node agents are processes of their own that the controller reaches only through the store.

The fleet tests run the controller's side (``AgentFleet``) in this process against real agent
processes, with a real TCPStore: an agent's pid is not ours, a killed agent takes its workers with it,
commands that do not carry the job's MAC are refused and logged, a config file that differs from
the signed digest keeps an agent from starting, a fenced agent heard again halts with the reason, an agent
exits with the run's code, one whose store stops answering (SIGSTOP) stops its workers and exits within the
bound, and nothing is left once the fleet shut down. The
fork server tests start children from a host fork server forked from this process: their exits read
as multiprocessing's did. The last test loses a node in a real run and recovers on the spare node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from multiprocessing import Pipe
from queue import Empty, Queue

import psutil
import pytest

from runner.agents import auth
from runner.agents.fleet import AgentFleet, agent_config
from runner.agents.fork_server import ForkServer
from runner.agents.node_agent import EXIT_CONTROLLER_LOST, EXIT_FENCED
from runner.callbacks.heartbeat import EXIT_FENCED as EXIT_WORKER_FENCED
from runner.config.schema import HeartbeatConfig
from runner.control.controller import FORKSERVER_PRELOAD
from runner.control.records import EXIT_RUN_FAILED
from runner.plumbing import protocol
from runner.plumbing.events import read_jsonl
from runner.training.worker import WorkerSpec, main
from tests.conftest import run_cli
from tests.test_config import _compose

BASE = ["+recipe=gpt_tiny", "logger=none", "runner.console_events=false", "parallel.nodes=2",
        "parallel.procs_per_node=1", "launcher.start_timeout_s=60"]


@pytest.fixture
def fleet(tmp_path):
    cfg = _compose(*BASE)
    store = protocol.host_store("127.0.0.1", 60)
    queue: Queue = Queue()
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # e.g. an earlier test's forkserver
    fleet = AgentFleet(cfg, tmp_path, store, ("127.0.0.1", store.port), queue, FORKSERVER_PRELOAD, None, nodes=2)
    started = {a.proc.pid for a in fleet.agents}
    yield fleet, store, queue
    fleet.shutdown("failed")
    workers = {pid for a in fleet.agents for pid in a.workers.values()}
    deadline = time.monotonic() + 10
    while (left := _alive(started | workers) | ({p.pid for p in psutil.Process().children(recursive=True)} - before)) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left behind: {left}"


def _spawn(fleet: AgentFleet, store, run_dir, wid: int, node: int) -> None:
    """A worker that waits for a first generation nobody publishes (until it is killed). It runs the
    config of its agent's file: the empty one given here never leaves this process."""
    spec = WorkerSpec(str(run_dir), wid, node, 0, wid, "initial", 0, "127.0.0.1", store.port)
    fleet.spawn(main, (spec, {}), wid, node)


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.NoSuchProcess:
            continue
    return out


def _events_of(run_dir, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == kind]


@pytest.mark.slow
def test_agents_are_processes_of_their_own(fleet):
    fleet, store, _ = fleet
    for agent in fleet.agents:
        registration = protocol.get_json(store, protocol.agent_key(agent.node))
        assert registration["pid"] == agent.proc.pid != os.getpid() and agent.proc.poll() is None
    # forked from one zygote of ours, which preloaded them: no interpreter of their own
    zygotes = {psutil.Process(agent.proc.pid).ppid() for agent in fleet.agents}
    assert len(zygotes) == 1 and psutil.Process(zygotes.pop()).ppid() == os.getpid()
    # the controller's only threads for them read their exit records from the store
    assert sorted(t.name for t in threading.enumerate() if t.name.startswith(("agent", "exits"))) == ["exits-0",
                                                                                                     "exits-1"]


@pytest.mark.slow
def test_a_worker_exit_reaches_the_controller_once_with_its_code(fleet, tmp_path):
    fleet, store, queue = fleet
    _spawn(fleet, store, tmp_path, 0, 0)
    pid = fleet.agents[0].workers[0]
    assert psutil.Process(pid).ppid() != os.getpid()  # a child of node 0's fork server, not of ours
    fleet.signal(0, 0, signal.SIGKILL)
    kind, wid, code, _ = queue.get(timeout=20)
    assert (kind, wid, code) == ("exit", 0, -signal.SIGKILL) and fleet.agents[0].exit_reported(0)
    with pytest.raises(Empty):
        queue.get(timeout=0.5)


def test_a_killed_agent_takes_its_workers_with_it_and_goes_silent(fleet, tmp_path):
    fleet, store, queue = fleet
    _spawn(fleet, store, tmp_path, 0, 1)
    pid = fleet.agents[1].workers[0]
    fork_server = psutil.Process(pid).ppid()
    assert psutil.Process(fork_server).ppid() == fleet.agents[1].proc.pid  # the agent forked its host's server
    assert fleet.lose_node(1) == [0]
    assert not _alive({pid, fork_server, fleet.agents[1].proc.pid})
    assert fleet.agents[1].proc.poll() == -signal.SIGKILL
    assert fleet.agents[1].exit_reported(0)
    with pytest.raises(Empty):
        queue.get(timeout=0.5)  # a lost host reports nothing: its silence tells
    before = fleet.node_beats()
    time.sleep(0.5)
    after = fleet.node_beats()
    assert after[0] > before[0] and after[1] == before[1]


def test_a_forged_or_replayed_command_is_refused_and_logged(fleet, tmp_path):
    fleet, store, _ = fleet
    node = 0

    def forge(message: str) -> int:
        seq = store.add(protocol.agent_key(node, "cmds"), 1)
        store.set(protocol.agent_key(node, "cmd", seq), message)
        return seq

    spec = {"run_dir": str(tmp_path), "wid": 7, "node": node, "local_rank": 0, "logical_rank": 0,
            "role": "initial", "first_gen": 0, "host": "127.0.0.1", "port": store.port, "namespace": ""}
    forged = []
    seq = store.add(protocol.agent_key(node, "cmds"), 0) + 1
    body = {"op": "spawn", "spec": spec, "node": node, "seq": seq}
    forged.append(forge(json.dumps({"body": json.dumps(body)})))  # no MAC
    seq += 1
    forged.append(forge(auth.sign(b"not the job's secret", {**body, "seq": seq})))  # another key's MAC
    seq += 1
    genuine_elsewhere = auth.sign(fleet.secret, {**body, "seq": 1})
    forged.append(forge(genuine_elsewhere))  # a valid MAC for another place in the queue: a replay
    fleet.signal(0, node, signal.SIGCONT)  # a genuine command after them is carried out
    refused = _events_of(tmp_path, "command_refused")
    assert [(e["rank"], e["seq"]) for e in refused] == [(f"agent-{node}", s) for s in forged]
    assert [e["reason"].split(" ")[0] for e in refused] == ["bad", "bad", "signed"]
    assert not any(store.check([protocol.agent_key(node, "ack", s)]) for s in forged)
    assert not _events_of(tmp_path, "worker_started")


@pytest.mark.slow
def test_an_agent_refuses_a_config_other_than_the_signed_one(fleet, tmp_path):
    fleet, store, _ = fleet
    config = tmp_path / protocol.AGENT_CONFIG_FILE
    tampered = json.loads(config.read_text())
    tampered["config"]["seed"] += 1
    config.write_text(json.dumps(tampered))
    args = [sys.executable, "-m", "runner.agents", "--store", f"127.0.0.1:{store.port}", "--node", "5",
            "--run-dir", str(tmp_path)]
    env = {**os.environ, auth.SECRET_ENV: fleet.secret.decode()}
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "differs from the config the controller signed" in done.stderr
    assert "differs" in store.get(protocol.agent_key(5, "refused")).decode()
    assert [e["node"] for e in _events_of(tmp_path, "agent_refused")] == [5]
    assert not store.check([protocol.agent_key(5)])  # never registered


@pytest.mark.slow  # run time: a variant of what the default tier covers
def test_a_lost_node_recovers_on_the_spare_node(run_dir):
    run = run_cli("+recipe=gpt_tiny", "parallel.nodes=2", "parallel.procs_per_node=1", "parallel.spares=1",
                  "ft=[deadpool]", "trainer.max_steps=20", "fault=kill_node", "fault.node=1", "fault.step=8",
                  run_dir=run_dir)  # run_cli also checks that no process (agent, fork server, worker) is left
    assert run.summary["status"] == "completed", run.output[-3000:]
    rec = run.only_recovery()
    assert (rec["fault"], rec["action"], rec["victims"], rec["rpo_steps"]) == ("node_loss", "swap_spare", [1], 0)
    assert {e["node"] for e in run.events("spare_assigned")} == {2}


def _exit_with(code) -> None:
    sys.exit(code)


def _fail() -> None:
    raise ValueError("a worker's bug")


def _answer(conn) -> None:
    conn.send(os.getppid())


@pytest.fixture
def fork_server():
    server = ForkServer.fork()
    yield server
    server.close()


def test_a_fork_servers_children_exit_as_multiprocessing_processes_did(fork_server):
    codes = []
    for target, args in [(_exit_with, (3,)), (_exit_with, (None,)), (_exit_with, ("why",)), (_fail, ())]:
        child = fork_server.start(target, args)
        child.join(timeout=20)
        codes.append(child.exitcode)
    assert codes == [3, 0, 1, 1]
    sleeper = fork_server.start(time.sleep, (60,))
    os.kill(sleeper.pid, signal.SIGKILL)
    sleeper.join(timeout=20)
    assert sleeper.exitcode == -signal.SIGKILL  # as multiprocessing reported a signalled process


def test_a_fork_servers_child_reports_why_it_failed_on_stderr():
    code = ("import sys; from runner.agents.fork_server import ForkServer; server = ForkServer.fork(); "
            "children = [server.start(f, a) for f, a in [(sys.exit, ('why',)), (int, ('x',))]]; "
            "[c.join(20) for c in children]; print([c.exitcode for c in children]); server.close()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[1, 1]" and "why" in done.stderr
    assert "ValueError: invalid literal for int()" in done.stderr  # the traceback


def test_a_fork_servers_child_gets_its_connections_and_dies_with_the_server(fork_server):
    ours, theirs = Pipe()
    child = fork_server.start(_answer, (), connections=(theirs,))
    theirs.close()
    assert ours.poll(20) and ours.recv() != os.getpid()  # a child of the server, not of ours
    child.join(timeout=20)
    assert child.exitcode == 0
    sleeper = fork_server.start(time.sleep, (60,))
    server = psutil.Process(sleeper.pid).ppid()
    os.kill(server, signal.SIGKILL)
    sleeper.join(timeout=20)
    assert sleeper.exitcode == -signal.SIGKILL  # the server's end of the channel closed: it died with the server
    deadline = time.monotonic() + 10
    while _alive({sleeper.pid}) and time.monotonic() < deadline:
        time.sleep(0.01)  # the kernel signals the orphan as the server's exit completes
    assert not _alive({sleeper.pid})


def test_a_fenced_agent_heard_again_kills_its_workers_and_exits_with_the_reason(fleet, tmp_path):
    fleet, store, queue = fleet
    _spawn(fleet, store, tmp_path, 0, 1)
    worker, agent = fleet.agents[1].workers[0], fleet.agents[1].proc
    os.kill(agent.pid, signal.SIGSTOP)  # silent, as behind a link that is down
    beat = fleet.node_beats()[1]
    fleet.fence(1, "node 1 went silent and was declared lost", gen=3)
    assert not fleet.agents[1].alive()
    os.kill(agent.pid, signal.SIGCONT)  # the link heals: it reads its fence
    assert agent.wait(timeout=30) == EXIT_FENCED
    # whether its own beat reached the store first depends on where SIGSTOP caught its beat thread (between a beat
    # and the fence read, none does): a beat of the healed host, written here, must not bring it back
    store.set(protocol.agent_key(1, "hb"), repr(time.time()))
    assert fleet.node_beats()[1] > beat and not fleet.agents[1].alive()  # heard again, and still lost
    assert not _alive({worker})
    [fenced] = _events_of(tmp_path, "agent_fenced")
    assert (fenced["node"], fenced["gen"], fenced["exit_code"]) == (1, 3, EXIT_FENCED)
    assert "declared lost" in fenced["reason"]
    with pytest.raises(Empty):
        queue.get(timeout=0.5)  # a lost host's exits are no news


def test_every_agent_exits_with_the_code_of_the_runs_end(fleet):
    fleet, _, _ = fleet
    fleet.shutdown("failed")  # a failed run: every host's launcher sees it fail, not only node 0's
    assert [a.proc.wait(timeout=60) for a in fleet.agents] == [EXIT_RUN_FAILED, EXIT_RUN_FAILED]


def test_an_unsigned_fence_is_refused_and_logged(fleet, tmp_path):
    fleet, store, _ = fleet
    store.set(protocol.node_fence_key(0), json.dumps({"node": 0, "reason": "forged", "gen": 0}))
    deadline = time.monotonic() + 30
    while not _events_of(tmp_path, "command_refused") and time.monotonic() < deadline:
        time.sleep(0.02)
    [refused] = _events_of(tmp_path, "command_refused")
    assert refused["reason"] == "a fence without a valid MAC" and fleet.agents[0].proc.poll() is None


def test_a_written_off_worker_heard_again_exits(fleet, tmp_path):
    fleet, store, queue = fleet
    _spawn(fleet, store, tmp_path, 0, 0)
    worker = fleet.agents[0].workers[0]
    os.kill(worker, signal.SIGSTOP)  # out of touch, as behind a link that is down, while the controller writes it off
    protocol.set_json(store, protocol.worker_fence_key(0), {"wid": 0, "logical": 0, "gen": 2, "reason": "replaced"})
    os.kill(worker, signal.SIGCONT)  # heard again: its first beat reads the fence
    kind, wid, code, _ = queue.get(timeout=30)
    assert (kind, wid, code) == ("exit", 0, EXIT_WORKER_FENCED)
    [fenced] = _events_of(tmp_path, "worker_fenced")
    assert (fenced["wid"], fenced["gen"], fenced["reason"]) == (0, 2, "replaced")


STORE_HOST = """
import sys, time
from runner.plumbing import protocol
store = protocol.host_store("127.0.0.1", 60)
print(store.port, flush=True)
time.sleep(600)
"""


def test_an_agent_whose_controller_stops_answering_stops_its_workers_and_exits(tmp_path):
    """The store's process stopped (SIGSTOP: its connections stay open, nothing answers, as behind a silent host):
    the agent and its worker exit non-zero within the bound, although every store call they make blocks."""
    cfg = _compose(*BASE)
    holder = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True)
    agent = None
    try:
        port = int(holder.stdout.readline())
        store = protocol.connect("127.0.0.1", port, 60)
        secret = auth.new_secret().encode()
        raw = agent_config(cfg, FORKSERVER_PRELOAD, None)
        (tmp_path / protocol.AGENT_CONFIG_FILE).write_bytes(raw)
        store.set(protocol.AGENT_CONFIG, auth.sign(secret, {"sha256": auth.digest(raw)}))
        agent = subprocess.Popen([sys.executable, "-m", "runner.agents", "--store", f"127.0.0.1:{port}", "--node", "0",
                                  "--run-dir", str(tmp_path)], env={**os.environ, auth.SECRET_ENV: secret.decode()})
        spec = {"run_dir": str(tmp_path), "wid": 0, "node": 0, "local_rank": 0, "logical_rank": 0, "role": "initial",
                "first_gen": 0, "host": "127.0.0.1", "port": port, "namespace": ""}
        spawn = {"op": "spawn", "spec": spec, "node": 0, "seq": 1}
        store.set(protocol.agent_key(0, "cmd", 1), auth.sign(secret, spawn))
        store.wait([protocol.agent_key(0, "ack", 1)], timedelta(seconds=120))
        worker = int(store.get(protocol.agent_key(0, "ack", 1)))
        store.wait(["hb/0"], timedelta(seconds=60))  # the worker beats: its own watch runs too
        os.kill(holder.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        assert agent.wait(timeout=60) == EXIT_CONTROLLER_LOST
        took = time.monotonic() - stopped
        bound = HeartbeatConfig.of(cfg.heartbeat).controller_lost_after_s
        assert bound <= took < bound + 15, took  # the bound, then the workers' kill and the host's shutdown
        assert not _alive({worker})
        [lost] = [e for e in _events_of(tmp_path, "controller_lost") if e["rank"] == "agent-0"]
        assert lost["exit_code"] == EXIT_CONTROLLER_LOST and "did not answer" in lost["reason"]
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait()
        os.kill(holder.pid, signal.SIGCONT)
        holder.kill()
        holder.wait()
