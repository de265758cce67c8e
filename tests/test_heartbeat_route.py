"""``heartbeat.route=agent``: workers beat to their own host's node agent, which writes one record per host only when
a rank's step or phase changes (runner/agents/beat_relay.py, runner/control/beats.py). The relay and the controller's
reader on real sockets and a real store; then the recoveries whose evidence is a heartbeat (a rank stopped, a host
lost, a straggler) and a stop, in the simulation and under torchrun, exact as with ``route=store``."""

from __future__ import annotations

import json
import signal
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from runner.agents.beat_relay import BeatRelay
from runner.callbacks.heartbeat import AgentLink
from runner.config import ConfigError
from runner.control.beats import AgentBeats
from runner.control.records import Worker
from runner.plumbing import protocol
from tests import test_stragglers as stragglers
from tests.conftest import TWO_BY_TWO, run_cli
from tests.test_checkpoint import _run_until
from tests.test_deadpool import FOUR as SPARE_NODE
from tests.test_deadpool import assert_exact as assert_deadpool_exact
from tests.test_flashrecovery import FR, HANG, assert_exact, assert_hang_recovered
from tests.test_phase_timeouts import CALIBRATED
from tests.test_torchrun_per_host import (
    LAYOUT,
    _complete_after_losing_host_1,
    as_run,
    assert_survivors_end,
    assert_trees_end,
    hosts,
)
from tests.test_torchrun_per_host import on_hosts as torchrun_overrides
from tests.test_torchrun_per_rank import _cfg

AGENT = ["heartbeat.route=agent"]
INTERVAL_S = 0.1


def _beat(wid: int, step: int, phase: str = "compute", in_flight: int = 0, timing=()) -> dict:
    return {"wid": wid, "step": step, "phase": phase, "gen": 0, "in_flight": in_flight, "t": time.time(),
            "timing": [list(t) for t in timing]}


def test_an_agents_record_changes_only_when_a_ranks_step_or_phase_does_or_it_goes_quiet():
    relay = BeatRelay(node=0, interval_s=INTERVAL_S)
    try:
        relay.heard(_beat(0, 1))
        relay.heard(_beat(1, 1))
        first = json.loads(relay.record())
        assert first["v"] == 1 and set(first["rows"]) == {"0", "1"}
        relay.heard(_beat(0, 1))
        relay.heard(_beat(1, 1, in_flight=2))  # its step has not held for two intervals: not worth a record
        assert relay.record() is None and relay.version == 1
        relay.heard(_beat(0, 2, timing=[(1, 0.5, 0.1, 0.0)]))
        second = json.loads(relay.record())
        assert second["v"] == 2 and second["rows"]["0"]["step"] == 2
        assert second["rows"]["0"]["timing"] == [[1, 0.5, 0.1, 0.0]]
        deadline = time.monotonic() + 10
        while (raw := relay.record()) is None:  # rank 1 is not heard again: quiet after two intervals
            relay.heard(_beat(0, 2, timing=[(1, 0.5, 0.1, 0.0)]))
            assert time.monotonic() < deadline
            time.sleep(INTERVAL_S / 4)
        third = json.loads(raw)
        assert third["v"] == 3 and third["rows"]["1"]["quiet"] and not third["rows"]["0"]["quiet"]
        relay.heard(_beat(1, 1, in_flight=2))  # heard again
        fourth = json.loads(relay.record())
        assert not fourth["rows"]["1"]["quiet"] and fourth["rows"]["1"]["in_flight"] == 2
        assert "timing" not in fourth["rows"]["0"]  # step 1's timing went out in the record before last
        relay.forget(1)
        assert set(json.loads(relay.record())["rows"]) == {"0"}
    finally:
        relay.close()


def test_a_worker_hears_the_generation_a_stop_and_its_fence_from_its_agent_over_the_socket():
    relay = BeatRelay(node=3, interval_s=INTERVAL_S)
    relay.start()
    link = AgentLink(relay.name, interval_s=5.0)
    try:
        news = link.exchange(_beat(7, 4))
        assert (news.gen, news.stop, news.fence) == (-1, False, None)
        relay.gen, relay.stop_requested, relay.fences[7] = 2, True, {"gen": 2, "reason": "replaced"}
        news = link.exchange(_beat(7, 5))
        assert (news.gen, news.stop, news.fence) == (2, True, {"gen": 2, "reason": "replaced"})
        assert json.loads(relay.record())["rows"]["7"]["step"] == 5  # the beat reached the host's record
    finally:
        link.sock.close()
        relay.close()


class _Agent:
    """The controller's view of one node agent (``fleet.AgentHandle``'s fields the reader uses)."""

    def __init__(self, node: int) -> None:
        self.node, self.registered, self.lost, self.beats, self.record_version = node, True, False, 0, 0


class _Fleet:
    """Reads the agents' beats from the store as ``AgentFleet.node_beats`` does (the value's version)."""

    def __init__(self, store: TCPStore, nodes: int) -> None:
        self.store, self.agents = store, [_Agent(n) for n in range(nodes)]

    def node_beats(self) -> dict[int, float]:
        for a in self.agents:
            value = self.store.get(protocol.agent_key(a.node, "hb"))
            a.beats, a.record_version = a.beats + 1, int(value.split()[1])
        return {}


def _kept(workers: list[Worker], read: list[tuple[int, dict]]) -> list[tuple[int, dict]]:
    """What detection keeps of a read (``Detector.poll_heartbeats``): each worker's ``seq`` and beat."""
    for w, (seq, beat) in zip(workers, read):
        w.hb_seq, w.hb_beat = seq, beat
    return read


def test_the_controller_decodes_only_the_records_whose_version_moved():
    """Only moved records are fetched and decoded; a host whose agent beat again with its record unchanged (and no
    quiet row) is settled: its ranks proved alive with nothing to read."""
    store = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=10))
    relays = [BeatRelay(node=n, interval_s=INTERVAL_S) for n in range(3)]
    try:
        def publish() -> None:
            for n, relay in enumerate(relays):
                record = relay.record()
                if record is not None:
                    store.set(protocol.agent_key(n, "ranks"), record)
                store.set(protocol.agent_key(n, "hb"), f"{time.time()!r} {relay.version}")

        workers = [Worker(wid=n, node=n, local_rank=0, logical=n, role="initial", t_spawn=0.0) for n in range(3)]
        for w in workers:
            relays[w.node].heard(_beat(w.wid, 1))
        publish()
        fleet = _Fleet(store, 3)
        reader = AgentBeats(store, fleet)
        fleet.node_beats()
        reader.refresh()
        assert reader.records_read == 3 and all(reader.started(w) for w in workers)
        assert reader.settled() == {}  # every record is new to the caller
        first = _kept(workers, reader.read(workers))
        relays[1].heard(_beat(1, 2))  # only host 1's rank moved
        publish()
        fleet.node_beats()
        reader.refresh()
        assert reader.records_read == 4
        assert sorted(reader.settled()) == [0, 2]
        second = _kept(workers, reader.read(workers))
        assert [beat["step"] for _, beat in second] == [1, 2, 1]
        assert all(a[0] != b[0] for a, b in zip(first, second))  # every agent beat: each rank proved alive
        # a row not re-read is the same beat (its content handled once); the moved one is new
        assert [a[1] is b[1] for a, b in zip(first, second)] == [True, False, True]
        assert reader.all_heard(workers, 2 * INTERVAL_S, time.time())
        assert reader.settled() == {}  # no agent beat since the last call: nobody proved alive again
        relays[2].forget(2)  # rank 2 exited: its agent drops its row before the controller handled the exit
        publish()
        fleet.node_beats()
        reader.refresh()
        settled = reader.settled()
        assert sorted(settled) == [0, 1] and settled[0] == (reader.rows[0], fleet.agents[0].beats)
        third = reader.read(workers)
        assert third[2] == second[2] and third[0][0] != second[0][0]  # rank 2 keeps its last beat and seq
        assert not reader.all_heard(workers, 2 * INTERVAL_S, time.time())
        # a quiet row: its host is never settled (the silence rule must see that rank each round)
        store.set(protocol.agent_key(0, "ranks"), json.dumps({"v": 9, "rows": {"0": {**third[0][1], "quiet": True}}}))
        store.set(protocol.agent_key(0, "hb"), f"{time.time()!r} 9")
        for _ in range(2):
            fleet.node_beats()
            reader.refresh()
            assert 0 not in reader.settled()
        assert reader.read(workers[:1]) == [(workers[0].hb_seq, reader.rows[0][0])]  # a quiet rank's seq holds
    finally:
        for relay in relays:
            relay.close()


def test_route_agent_is_refused_where_no_node_agent_runs():
    from runner.launch.launcher import check_mode

    with pytest.raises(ConfigError, match="set heartbeat.route=store, or launcher.mode=per_host"):
        check_mode(_cfg(**{"heartbeat.route": "agent"}), "torchrun")
    check_mode(_cfg(**{"heartbeat.route": "agent", "launcher.mode": "per_host"}), "torchrun")


# -- the simulation --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fault_free(two_by_two):
    assert two_by_two.summary["status"] == "completed", two_by_two.output[-3000:]
    return two_by_two.summary


def test_a_killed_rank_restarts_in_place_exactly(fault_free, run_dir):
    run = run_cli(*TWO_BY_TWO, *FR, *AGENT, "fault=kill_rank", "fault.rank=1", "fault.step=12", run_dir=run_dir)
    rec = assert_exact(run, fault_free, recoveries=1)["recoveries"][0]
    assert (rec["fault"], rec["victims"], rec["action"]) == ("process_crash", [1], "restart_rank")


def test_a_stopped_rank_is_found_silent_by_its_agent_diagnosed_and_recovered(fault_free, run_dir):
    run = run_cli(*TWO_BY_TWO, *HANG, *AGENT, "fault.rank=1", run_dir=run_dir)
    assert_hang_recovered(run, fault_free, hung=1)
    (killed,) = run.events("worker_killed")
    assert "heartbeats missed" in killed["reason"]  # the agent marked it quiet: the silence rule, not a stall


def test_a_rank_that_beats_but_holds_its_step_is_found_by_its_phase_timeout(fault_free, run_dir):
    """fault.hang=stall: rank 1's training thread blocks while its heartbeats go on. Its agent keeps hearing it, so
    its row never goes quiet and its host's record stops moving: no heartbeat rule can find it, only the step that
    does not advance, judged from the row the controller read last, within the calibrated timeout."""
    run = run_cli(*TWO_BY_TWO, *FR, *AGENT, *CALIBRATED, "fault=hang_rank", "fault.hang=stall", "fault.rank=1",
                  "fault.step=25", run_dir=run_dir)
    rec = assert_exact(run, fault_free, recoveries=1)["recoveries"][0]
    assert (rec["fault"], rec["victims"]) == ("hang", [1])
    stall = rec["stall"]
    assert stall["phase"] == "compute" and stall["calibrated"], rec
    assert rec["detect_s"] <= stall["timeout_s"] + 1.0, rec
    (killed,) = run.events("worker_killed")
    assert "not advancing in phase compute" in killed["reason"], killed


@pytest.mark.slow
def test_a_lost_node_is_replaced_by_the_spare_node_exactly(two_by_two, run_dir):
    run = run_cli(*SPARE_NODE, *AGENT, "fault=kill_node", "fault.node=1", "fault.step=12", run_dir=run_dir)
    assert_deadpool_exact(run, two_by_two.summary)
    rec = run.only_recovery()
    assert (rec["fault"], rec["action"], rec["victims"], rec["rpo_steps"]) == ("node_loss", "swap_spare", [2, 3], 0)


@pytest.mark.slow
def test_a_straggler_is_found_from_the_timings_the_agents_records_carry(two_by_two, run_dir):
    run = run_cli(*stragglers.SPARE_HOST, *AGENT, "policy.straggler=[swap_spare,report]", run_dir=run_dir)
    stragglers.assert_swapped_out(run, two_by_two.summary)


def test_a_stop_reaches_every_worker_through_its_agent(run_dir):
    run = _run_until(run_dir, step=5, sig=signal.SIGTERM, overrides=[*TWO_BY_TWO, *AGENT, "trainer.max_steps=2000"])
    assert run.returncode == 75, run.output[-3000:]
    s = run.summary
    assert s["status"] == "stopped" and 5 <= s["global_step"] < 2000 and s["samples_lost"] == 0
    assert [e["at_step"] for e in run.events("checkpoint_saved")] == [s["global_step"]]


# -- under torchrun: hosts as process trees --------------------------------------------------------------------------
def test_under_torchrun_a_killed_worker_restarts_on_its_own_host_exactly(make_job, fault_free):
    job = make_job()
    hosts(job, 3, *LAYOUT, *AGENT, "fault=kill_rank", "fault.rank=3", "fault.step=5")
    run = as_run(job)
    assert run.returncode == 0, job.output()
    rec = assert_exact(run, fault_free, recoveries=1)["recoveries"][0]
    assert (rec["fault"], rec["victims"], rec["action"]) == ("process_crash", [3], "restart_rank")
    (joiner,) = [e for e in run.events("worker_started") if e["role"] == "joiner"]
    assert joiner["node"] == 1
    assert_trees_end(job)


@pytest.mark.slow
def test_under_torchrun_a_lost_host_is_replaced_by_the_spare_host(make_job, fault_free):
    job = make_job()
    s, rest = _complete_after_losing_host_1(job, 3, *LAYOUT, *AGENT)
    (rec,) = s["recoveries"]
    assert (rec["fault"], rec["action"], rec["victims"], rec["rpo_steps"]) == ("node_loss", "swap_spare", [2, 3], 0)
    assert s["param_checksum"] == fault_free["param_checksum"] and s["samples_lost"] == 0
    assert_survivors_end(job, rest)


@pytest.mark.slow
def test_under_torchrun_a_stopped_rank_on_another_host_is_diagnosed_and_recovered(make_job, fault_free):
    job = make_job()
    hosts(job, 2, *torchrun_overrides(TWO_BY_TWO), *HANG, *AGENT, "fault.rank=3")
    run = as_run(job)
    assert run.returncode == 0, job.output()
    assert_hang_recovered(run, fault_free, hung=3)
    assert_trees_end(job)
