"""A host started later joins a running launcher.mode=per_host job as a spare host (``launcher.join``).

The fast tests run the controller's side (``HostJoins`` over a real ``AgentFleet`` and TCPStore) in this
process against real joining processes: a host with another secret is refused and the refusal logged on both
sides, forged and mismatched requests are refused, and a granted host's agent is adopted into the fleet and
shut down with it. The slow test joins a third host to two torchrun trees while they train and then loses
host 1: the late host's warm spares take its ranks, with the checksum of the fault-free run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from queue import Queue

import pytest

from runner.agents import auth
from runner.agents.fleet import AgentFleet
from runner.agents.joins import TICKETS, HostJoins, request_key
from runner.config import ConfigError
from runner.config.validate import validate
from runner.control.controller import FORKSERVER_PRELOAD
from runner.control.records import exit_code
from runner.plumbing import protocol
from runner.plumbing.events import EventLog, read_jsonl
from tests.conftest import ROOT, read_summary, run_cli
from tests.local_hosts import BASE, events, max_step, wait_for
from tests.test_config import _compose
from tests.test_torchrun_per_host import (
    SECRET,
    assert_survivors_end,
    hosts_behind_the_rendezvous_store,
)

STEPS = 400
LAYOUT = ["launcher.mode=per_host", "parallel.nodes=2", "parallel.procs_per_node=2", "parallel.spares=0",
          "ft=[deadpool,ndb]", f"trainer.max_steps={STEPS}"]  # two training hosts, no spare host at the start
# rank 0 sleeps 0.1 s before each step (no CPU, no change to what is computed), so that on a loaded machine the
# job still trains for longer than a host takes to join it
PACED = ["fault=slow_rank", "fault.rank=0", "fault.delay_s=0.1"]


# -- configuration ------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, says", [
    (["launcher.join=nohost"], "is not HOST:PORT"),
    (["launcher.join=10.0.0.1:29400", "launcher.mode=per_rank"], "joins a running launcher.mode=per_host job"),
    (["launcher.join=10.0.0.1:29400", "launcher.kind=local"], "a launcher=local job cannot be joined"),
    (["launcher.join=10.0.0.1:29400", "ft=[flashrecovery]"], "only ft=deadpool uses spare hosts"),
])
def test_join_is_refused_where_it_cannot_work(overrides, says):
    cfg = _compose("+recipe=gpt_tiny", "parallel.nodes=2", "ft=[deadpool]", "launcher.mode=per_host", *overrides)
    with pytest.raises(ConfigError, match=says):
        validate(cfg)


# -- the controller's side ------------------------------------------------------------------------------
class Node0:
    """What node 0 runs under per_host: a fleet of one node (its agent started here) and the join desk; the
    tests of this module share it, the last one shuts it down."""

    def __init__(self, desk: HostJoins, fleet: AgentFleet, store, run_dir: Path) -> None:
        self.desk, self.fleet, self.store, self.run_dir = desk, fleet, store, run_dir
        self.secret = SECRET["RESILIENT_RUNNER_SECRET"].encode()
        self.shut = False

    def request(self, body) -> int:
        """A join request written by hand: ``body(ticket)`` under the next ticket."""
        ticket = self.store.add(TICKETS, 1)
        self.store.set(request_key(ticket), body(ticket))
        return ticket

    def events(self, kind: str) -> list[dict]:
        return [e for e in read_jsonl(self.run_dir / "events.jsonl") if e["kind"] == kind]

    def shutdown(self) -> None:
        """The job ends (as failed: it never trained)."""
        if not self.shut:
            self.shut = True
            self.fleet.shutdown("failed")


@pytest.fixture(scope="module")
def node0(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("node0")
    cfg = _compose("+recipe=gpt_tiny", "logger=none", "parallel.nodes=1", "parallel.procs_per_node=1",
                   "launcher.start_timeout_s=60")
    store = protocol.host_store("127.0.0.1", 60)
    address = ("127.0.0.1", store.port)
    os.environ.update(SECRET)
    try:
        fleet = AgentFleet(cfg, run_dir, store, address, Queue(), FORKSERVER_PRELOAD, None, nodes=1)
    finally:
        del os.environ["RESILIENT_RUNNER_SECRET"]
    events = EventLog(run_dir / "events.jsonl", rank=lambda: "controller", step=lambda: -1)
    node = Node0(HostJoins(store, fleet, events, address, timeout_s=60), fleet, store, run_dir)
    yield node
    node.shutdown()
    events.close()


def test_a_host_with_another_secret_is_refused_and_both_sides_log_why(node0, tmp_path):
    ticket = node0.store.add(TICKETS, 0) + 1  # the one the joining host draws
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "RESILIENT_RUNNER_SECRET": "not-the-job's"}
    proc = subprocess.Popen([sys.executable, "-m", "runner", *BASE, *LAYOUT, f"hydra.run.dir={tmp_path}",
                             f"launcher.join=127.0.0.1:{node0.store.port}"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    joined: list[int] = []
    wait_for("the joining host to end", lambda: joined.extend(node0.desk.poll()) or proc.poll() is not None,
             timeout_s=120)
    output = proc.communicate()[0]
    why = "its request does not carry a valid MAC for this job's secret"
    assert proc.returncode == 2 and why in output, output
    (refused,) = [e for e in node0.events("join_refused") if e["ticket"] == ticket]
    assert refused["reason"] == why and refused["pid"] is None  # an unsigned request's content is not trusted
    (own,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "agent_refused"]
    assert own["reason"] == why
    assert joined == [] and len(node0.fleet.agents) == 1


def test_forged_replayed_and_mismatched_requests_are_refused(node0):
    digest = node0.fleet.config_digest
    forged = node0.request(lambda t: json.dumps({"body": json.dumps({"ticket": t, "sha256": digest}), "mac": "0" * 64}))
    replayed = node0.request(lambda t: auth.sign(node0.secret, {"ticket": t - 1, "sha256": digest}))
    mismatched = node0.request(lambda t: auth.sign(node0.secret, {"ticket": t, "sha256": auth.digest(b"other")}))
    assert node0.desk.poll() == []
    reasons = {e["ticket"]: e["reason"] for e in node0.events("join_refused")}
    assert reasons[forged] == "its request does not carry a valid MAC for this job's secret"
    assert reasons[replayed] == f"its request was signed for ticket {replayed - 1}, not this one (a replay)"
    assert reasons[mismatched].startswith("its config differs from the one the controller signed")
    for ticket in (forged, replayed, mismatched):
        assert json.loads(node0.store.get(request_key(ticket, "answer"))) == {"refused": reasons[ticket]}
    assert len(node0.fleet.agents) == 1 and not node0.events("host_joined")


def _grant(node0: Node0) -> int:
    """A valid join request, answered with the next node index; returns it."""
    digest = node0.fleet.config_digest
    ticket = node0.request(lambda t: auth.sign(node0.secret, {"ticket": t, "sha256": digest, "host": "h", "pid": 1}))
    assert node0.desk.poll() == []  # granted; its agent has not registered yet
    answer = auth.verify(node0.secret, node0.store.get(request_key(ticket, "answer")))
    assert answer == {"ticket": ticket, "node": len(node0.fleet.agents)}
    return answer["node"]


def test_a_granted_host_whose_agent_refuses_to_start_spends_its_index(node0):
    node = _grant(node0)
    node0.store.set(protocol.agent_key(node, "refused"), "its config file differs")  # as its agent would write
    assert node0.desk.poll() == []
    (failed,) = node0.events("join_failed")
    assert (failed["node"], failed["reason"]) == (node, "its config file differs")
    assert len(node0.fleet.agents) == node + 1 and node not in node0.fleet.node_beats()  # nobody holds it


def test_a_granted_host_is_adopted_into_the_fleet_and_shut_down_with_it(node0):
    node = _grant(node0)
    # the granted host runs that node's agent (here on the controller's config file) and registers
    env = {**os.environ, "PYTHONPATH": str(ROOT), **SECRET}
    agent = subprocess.Popen([sys.executable, "-m", "runner.agents", "--store", f"127.0.0.1:{node0.store.port}",
                              "--node", str(node), "--run-dir", str(node0.run_dir)], env=env)
    joined: list[int] = []
    try:
        wait_for("the granted host's agent", lambda: joined.extend(node0.desk.poll()) or joined, timeout_s=120,
                 procs=[agent])
        assert joined == [node] and len(node0.fleet.agents) == node + 1 and node0.fleet.agents[node].proc is None
        (host,) = node0.events("host_joined")
        assert (host["node"], host["pid"], host["role"]) == (node, agent.pid, "late_spare")
        assert node in node0.fleet.node_beats()
        node0.shutdown()  # the adopted agent is shut down with the others, and exits with the job's code
        assert agent.wait(timeout=60) == exit_code("failed")
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


# -- a late host under torchrun ---------------------------------------------------------------------------
@pytest.mark.slow
def test_a_host_that_joins_later_takes_a_lost_hosts_ranks(make_job, tmp_path):
    fault_free = run_cli(*BASE, *[o for o in LAYOUT if o != "launcher.mode=per_host"], run_dir=tmp_path / "local")
    assert fault_free.summary["status"] == "completed", fault_free.output[-3000:]
    job = make_job()
    trees = hosts_behind_the_rendezvous_store(job, 2, *LAYOUT, *PACED)
    wait_for("training", lambda: max_step(job.run_dir) >= 3, procs=trees)
    (controller,) = [e for e in events(job.run_dir, "host_joined") if e["node"] == 0]
    before = max_step(job.run_dir)
    late = job.join(controller["control_store"], *LAYOUT, *PACED, extra_env=SECRET)
    (joined,) = wait_for("the late host", lambda: [e for e in events(job.run_dir, "host_joined") if e["node"] == 2],
                         procs=[*trees, late])
    assert joined["role"] == "late_spare" and joined["pid"] == late.pid
    ready = wait_for("its warm spares", lambda: len(events(job.run_dir, "spare_ready")) == 2 and
                     events(job.run_dir, "spare_ready"), procs=[*trees, late])
    assert {e["node"] for e in ready} == {2}
    at_join = max_step(job.run_dir)
    assert before < at_join < STEPS - 50, (before, at_join, "a join must not pause training, nor take this long")
    wait_for("training to go on", lambda: max_step(job.run_dir) > at_join + 3, procs=[*trees, late])
    assert [e["gen"] for e in events(job.run_dir, "generation")] == [0]  # the join changed no generation
    rest = job.lose_host([*trees, late], 1)
    wait_for("the summary", lambda: (job.run_dir / "summary.json").exists(), procs=rest)
    s = read_summary(job.run_dir)
    assert s["status"] == "completed", job.output()
    (rec,) = s["recoveries"]
    assert (rec["fault"], rec["action"], rec["victims"], rec["rpo_steps"]) == ("node_loss", "swap_spare", [2, 3], 0)
    assigned = events(job.run_dir, "spare_assigned")
    assert sorted(e["wid"] for e in assigned) == sorted(e["wid"] for e in ready)  # the late host's spares
    assert s["samples_lost"] == 0 and s["param_checksum"] == fault_free.summary["param_checksum"]
    assert late.wait(timeout=60) == 0, job.output()
    assert_survivors_end(job, [p for p in rest if p.pid != late.pid])
