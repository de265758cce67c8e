"""The controller's state machine without processes: symptom -> decide -> act -> publish.

A real ``HashStore`` carries the protocol as the TCPStore does in a run; the fleet records what the
controller starts and signals instead of starting processes (it is the process launcher, not a
collective). The test plays the workers' side in the store (ready, heartbeats, reports, done records)
and drives the controller one round at a time, then reads the generations it published and its events.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from torch.distributed import HashStore

from runner.control.controller import Controller
from runner.control.stop import StopOnSignal
from runner.planning.topology import Topology
from runner.plumbing import protocol
from runner.plumbing.protocol import Layout
from runner.report.summary import write_summary
from tests.test_config import _compose

BASE = ["+recipe=gpt_tiny", "logger=none", "runner.console_events=false", "parallel.nodes=2",
        "parallel.procs_per_node=2", "heartbeat.interval_s=1", "heartbeat.decide_window_s=0"]


class RecordedFleet:
    """Records spawns and signals; a lost node's agent stops beating. Nothing is started."""

    can_spawn = True

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.spawned: list[tuple[int, int, str, int]] = []  # (wid, node, role, logical rank)
        self.signals: list[tuple[int, int]] = []  # (wid, signal)
        self.lost: set[int] = set()
        self.fenced: dict[int, tuple[str, int]] = {}  # node -> (reason, gen)
        self.status: str | None = None

    def spawn(self, target, args: tuple, wid: int, node: int) -> None:
        spec = args[0]
        self.spawned.append((wid, node, spec.role, spec.logical_rank))

    def signal(self, wid: int, node: int, sig: int) -> None:
        self.signals.append((wid, sig))

    def lose_node(self, node: int) -> list[int]:
        self.lost.add(node)
        return [wid for wid, n, _, _ in self.spawned if n == node]

    def node_beats(self) -> dict[int, float]:
        now = time.monotonic()
        return {n: float("-inf") if n in self.lost else now for n in range(self.nodes)}

    def fence(self, node: int, reason: str, gen: int) -> None:
        self.fenced[node] = (reason, gen)

    def post_notice(self, notice: dict, nodes: list[int] | None = None) -> None:
        """heartbeat.route=store, the default: no agent waits for notices."""

    def shutdown(self, status: str) -> None:
        self.status = status


def _start(tmp_path: Path, *overrides: str, base: list[str] = BASE) -> tuple[Controller, RecordedFleet]:
    cfg = _compose(*base, *overrides)
    fleet = RecordedFleet(Topology.from_cfg(cfg).total_nodes)
    ctl = Controller(cfg, tmp_path, fleet=fleet, store=HashStore())
    ctl.start()
    ctl.launch()
    return ctl, fleet


def _round(ctl: Controller, heartbeats: bool = False, ahead_s: float = 0.0) -> None:
    """One loop round: the exits queued so far, then everything else ``ahead_s`` seconds from now."""
    while not ctl.queue.empty():
        ctl.on_event(ctl.queue.get_nowait())
    ctl.round(time.monotonic() + ahead_s, heartbeats)


def _layout(ctl: Controller, gen: int) -> Layout:
    assert int(ctl.store.get("gen")) == gen
    return Layout.from_json(ctl.store.get(f"gen/{gen}"))


def _events(tmp_path: Path, kind: str) -> list[dict]:
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def _beat(ctl: Controller, wids, seq: int, step: int) -> None:
    for wid in wids:
        protocol.set_json(ctl.store, f"hb/{wid}", {"seq": seq, "step": step, "phase": "compute", "rss": 0, "t": 0})


def _finish(ctl: Controller, wids, computed: tuple[int, ...] = ()) -> None:
    """The workers finished, each computing its own logical rank and ``computed`` to the end."""
    for wid in wids:
        ranks = [ctl.members.workers[wid].logical, *computed]
        protocol.set_json(ctl.store, f"done/{wid}", {"checksum": "c", "global_step": 8, "computed_ranks": ranks})
        ctl.store.add("done_count", 1)


def test_a_crash_restarts_the_rank_in_place_then_publishes_survivors_and_complete(tmp_path):
    ctl, fleet = _start(tmp_path, "ft=flashrecovery")
    assert _layout(ctl, 0).members == [0, 1, 2, 3] and [s[2] for s in fleet.spawned] == ["initial"] * 4

    ctl.queue.put(("exit", 2, -9, time.time()))
    _round(ctl)
    decided = _events(tmp_path, "recovery_decided")
    assert [(d["fault"], d["action"], d["victims"]) for d in decided] == [("process_crash", "restart_rank", [2])]
    assert fleet.spawned[-1] == (4, 1, "joiner", 2)  # where rank 2 ran: node 1, local rank 0
    survivors = _layout(ctl, 1)
    assert (survivors.members, survivors.pending, survivors.recovery) == ([0, 1, 3], [2], 0)

    ctl.store.set("ready/4", "1")
    _round(ctl)
    full = _layout(ctl, 2)
    assert (full.members, full.logical, full.joiners, full.pending) == ([0, 1, 4, 3], [0, 1, 2, 3], [4], [])
    rec = ctl.record.recoveries[0]
    assert (rec.survivors_gen, rec.full_gen, ctl.incidents.active) == (1, 2, None)

    _finish(ctl, [0, 1, 3, 4])
    _round(ctl)
    assert ctl.record.status == "completed" and ctl.store.get("abort") == b"the run completed"
    assert sorted(ctl.members.done_records()) == [0, 1, 3, 4]


def test_ndb_at_tp2_stops_the_failed_ranks_replica_and_the_neighbour_replica_takes_it_over(tmp_path):
    ctl, fleet = _start(tmp_path, "ft=ndb", "parallel.tp=2")  # replica 0: ranks 0, 1 (node 0); replica 1: 2, 3
    ctl.queue.put(("exit", 2, -9, time.time()))
    _round(ctl)
    assert [d["action"] for d in _events(tmp_path, "recovery_decided")] == ["takeover"]
    assert fleet.signals == [(3, signal.SIGKILL)] and ctl.members.workers[3].dead  # written off, then stopped
    assert [(e["wid"], e["failed"]) for e in _events(tmp_path, "replica_stopped")] == [(3, 2)]
    assert [(e["logical"], e["neighbour_wid"]) for e in _events(tmp_path, "takeover_assigned")] == [(2, 0), (3, 1)]
    taken = _layout(ctl, 1)
    assert (taken.members, taken.extra, taken.complete) == ([0, 1], [[2], [3]], True)
    ctl.queue.put(("exit", 3, -9, time.time()))  # the stopped rank's exit is no new fault
    _round(ctl)
    assert ctl.incidents.active is None and int(ctl.store.get("gen")) == 1
    _finish(ctl, [0, 1])
    _round(ctl)
    assert ctl.record.status == "completed"


def test_a_transient_error_is_retried_once_everyone_proved_alive(tmp_path):
    ctl, fleet = _start(tmp_path, "ft=flashrecovery")
    protocol.report(ctl.store, {"wid": 1, "gen": 0, "reason": "collective failed"})
    _round(ctl)
    assert _events(tmp_path, "fault_detected") and not _events(tmp_path, "recovery_decided")  # no proof of life yet

    _beat(ctl, range(4), seq=1, step=3)
    _round(ctl, heartbeats=True, ahead_s=0.1)
    assert [d["action"] for d in _events(tmp_path, "recovery_decided")] == ["retry"]
    retried = _layout(ctl, 1)
    assert (retried.members, retried.recovery, retried.complete) == ([0, 1, 2, 3], 0, True)
    assert len(fleet.spawned) == 4 and not fleet.signals  # nobody restarts


def test_a_lost_node_goes_to_warm_spares(tmp_path):
    ctl, fleet = _start(tmp_path, "ft=deadpool", "parallel.spares=2")
    assert fleet.spawned[4:] == [(4, 2, "spare", -1), (5, 2, "spare", -1)]  # a spare node of their own
    for wid in (4, 5):
        ctl.store.set(f"ready/{wid}", "1")

    _round(ctl, heartbeats=True)  # a first heartbeat poll only refreshes: the launch took its time
    fleet.lose_node(1)
    _round(ctl, heartbeats=True)
    assert [e["symptom"] for e in _events(tmp_path, "fault_detected")] == ["node_silent"]
    _round(ctl)  # the decision comes the round after the symptom
    decided = _events(tmp_path, "recovery_decided")
    assert [(d["fault"], d["action"], d["victims"]) for d in decided] == [("node_loss", "swap_spare", [2, 3])]
    assert [(e["logical"], e["wid"]) for e in _events(tmp_path, "spare_assigned")] == [(2, 4), (3, 5)]
    swapped = _layout(ctl, 1)
    assert (swapped.members, swapped.joiners, swapped.complete) == ([0, 1, 4, 5], [4, 5], True)
    assert len(fleet.spawned) == 6  # the spares were already running


def _lose_with_spares_ready(tmp_path, node: int):
    """Two nodes of two ranks and a spare node whose spares (wids 4, 5) are ready: node ``node`` goes silent and
    the controller decides."""
    ctl, fleet = _start(tmp_path, "ft=deadpool", "parallel.spares=2")
    for wid in (4, 5):
        ctl.store.set(f"ready/{wid}", "1")
    _round(ctl, heartbeats=True)
    fleet.lose_node(node)
    _round(ctl, heartbeats=True)
    _round(ctl)
    return ctl, fleet


def _node_1_lost_to_the_spares(tmp_path):
    """Node 1 goes silent and the spares take its ranks."""
    ctl, fleet = _lose_with_spares_ready(tmp_path, 1)
    assert _layout(ctl, 1).members == [0, 1, 4, 5]
    return ctl, fleet


def test_a_lost_nodes_workers_heard_again_after_a_heal_count_for_nothing(tmp_path):
    """The link of node 1 comes back after its loss was decided and the spares took its ranks: its agent beats
    again, and its workers, still running, report the failure of the dropped generation (one of them a fatal
    error), beat, write ready and done records and exit. None of it is news, and none of it counts for the ranks
    the spares now hold: the run completes only when the spares finished, with their done records."""
    ctl, fleet = _node_1_lost_to_the_spares(tmp_path)

    fleet.lost.discard(1)  # the partition heals
    for wid in (2, 3):
        protocol.report(ctl.store, {"wid": wid, "gen": 0, "reason": "gen 0: node(s) [1] went silent"})
        ctl.store.set(f"ready/{wid}", "1")
    protocol.report(ctl.store, {"wid": 3, "fatal": True, "reason": "recovery impossible"})  # no run failure either
    _beat(ctl, [0, 1, 2, 3, 4, 5], seq=1, step=5)
    _finish(ctl, [0, 1, 2, 3])
    ctl.queue.put(("exit", 2, 0, time.time()))
    ctl.queue.put(("exit", 3, 1, time.time()))
    _round(ctl, heartbeats=True, ahead_s=0.1)
    _round(ctl, heartbeats=True, ahead_s=0.2)
    assert [e["symptom"] for e in _events(tmp_path, "fault_detected")] == ["node_silent"]  # nothing new
    assert all(e["stale"] for e in _events(tmp_path, "symptom_reported"))
    assert len(_events(tmp_path, "recovery_decided")) == 1 and ctl.incidents.active is None
    assert ctl.record.status != "completed"  # ranks 2 and 3 are the spares': the old done records are no finish

    _finish(ctl, [4, 5])
    _round(ctl)
    assert ctl.record.status == "completed"
    assert sorted(ctl.members.done_records()) == [0, 1, 4, 5]


def test_a_neighbour_takes_over_and_the_repaired_rank_rejoins(tmp_path):
    ctl, fleet = _start(tmp_path, "ft=ndb", "ft.ndb.repair_after_s=0")
    ctl.queue.put(("exit", 3, -9, time.time()))
    _round(ctl)
    assert [d["action"] for d in _events(tmp_path, "recovery_decided")] == ["takeover"]
    assert [(e["logical"], e["neighbour_wid"]) for e in _events(tmp_path, "takeover_assigned")] == [(3, 0)]
    taken = _layout(ctl, 1)
    assert (taken.members, taken.extra, taken.complete) == ([0, 1, 2], [[3], [], []], True)

    _round(ctl)  # repair_after_s=0: the rank is restarted where it ran
    assert fleet.spawned[-1] == (4, 1, "joiner", 3) and _events(tmp_path, "repair_started")
    ctl.store.set("ready/4", "1")
    _round(ctl)
    assert int(ctl.store.get("gen")) == 1  # ready, but its takeover has not committed a step yet

    _beat(ctl, [0, 1, 2], seq=1, step=1)
    _round(ctl, heartbeats=True)
    back = _layout(ctl, 2)
    assert (back.members, back.extra, back.complete) == ([0, 1, 2, 4], [], True)
    assert [(e["logical"], e["wid"]) for e in _events(tmp_path, "rejoined")] == [(3, 4)]


def test_a_repaired_rank_published_as_the_training_ends_is_not_waited_for(tmp_path):
    """The neighbour finished the training still computing the repaired rank (it never learnt of the rejoin
    generation): the run completes without the rejoining process, and releases it."""
    ctl, fleet = _start(tmp_path, "ft=ndb", "ft.ndb.repair_after_s=0")
    ctl.queue.put(("exit", 3, -9, time.time()))
    _round(ctl)
    _round(ctl)  # the repair restarts rank 3 as wid 4
    ctl.store.set("ready/4", "1")
    _beat(ctl, [0, 1, 2], seq=1, step=1)
    _round(ctl, heartbeats=True)
    assert _layout(ctl, 2).members == [0, 1, 2, 4]
    _finish(ctl, [1, 2])
    _finish(ctl, [0], computed=(3,))
    _round(ctl)
    assert ctl.record.status == "completed" and ctl.store.get("abort") == b"the run completed"


def test_a_rejoined_rank_is_waited_for_once_its_neighbour_stopped_computing_it(tmp_path):
    ctl, fleet = _start(tmp_path, "ft=ndb", "ft.ndb.repair_after_s=0")
    ctl.queue.put(("exit", 3, -9, time.time()))
    _round(ctl)
    _round(ctl)
    ctl.store.set("ready/4", "1")
    _beat(ctl, [0, 1, 2], seq=1, step=1)
    _round(ctl, heartbeats=True)
    _finish(ctl, [0, 1, 2])  # wid 0 trained in the rejoin generation: rank 3 is wid 4's again
    _round(ctl)
    assert ctl.record.status == "running"
    _finish(ctl, [4])
    _round(ctl)
    assert ctl.record.status == "completed"


def test_a_repaired_rank_ready_before_its_takeover_ends_is_left_out_of_another_incidents_generation(tmp_path):
    ctl, fleet = _start(tmp_path, "ft=ndb", "ft.ndb.repair_after_s=0")
    ctl.queue.put(("exit", 3, -9, time.time()))
    _round(ctl)
    _round(ctl)  # the repair restarts rank 3 as wid 4
    ctl.store.set("ready/4", "1")
    ctl.queue.put(("exit", 1, -9, time.time()))  # a second failure before rank 3's takeover committed a step
    _round(ctl)
    second = _layout(ctl, 2)
    assert 4 not in second.members and 3 not in second.logical  # wid 0 still computes rank 3, alone
    assert [3] in second.extra and sorted(second.logical + sum(second.extra, [])) == [0, 1, 2, 3]


def test_a_configured_kill_is_carried_out_by_the_controller_and_released(tmp_path):
    ctl, fleet = _start(tmp_path, "ft=flashrecovery", "fault.kind=kill_rank", "fault.rank=1", "fault.step=3")
    protocol.set_json(ctl.store, "fault/hit/0", {"wid": 1, "step": 3})
    _round(ctl)
    assert fleet.signals == [(1, signal.SIGKILL)] and ctl.store.get("fault/released/0") == b"1"
    injected = _events(tmp_path, "fault_injected")
    assert [(e["fault"], e["victims"], e["at_step"]) for e in injected] == [("kill_rank", [1], 3)]

    ctl.queue.put(("exit", 1, -9, time.time()))
    _round(ctl)
    assert ctl.record.recoveries[0].victims == [1] and fleet.spawned[-1] == (4, 0, "joiner", 1)


def test_faults_of_one_step_are_carried_out_together(tmp_path):
    """Two kills configured for one step are one fault: the first victim to announce waits for the other, so
    that both exits fall in one decision."""
    ctl, fleet = _start(tmp_path, "ft=flashrecovery", "fault.kind=kill_rank", "fault.rank=1", "fault.step=3",
                        "+fault.extra=[{kind: kill_rank, rank: 2, step: 3}]")
    protocol.set_json(ctl.store, "fault/hit/0", {"wid": 1, "step": 3})
    _round(ctl)
    assert fleet.signals == [] and not ctl.store.check(["fault/released/0"])
    protocol.set_json(ctl.store, "fault/hit/1", {"wid": 2, "step": 3})
    _round(ctl)
    assert fleet.signals == [(1, signal.SIGKILL), (2, signal.SIGKILL)]
    assert ctl.store.get("fault/released/0") == ctl.store.get("fault/released/1") == b"1"


def test_no_action_left_fails_the_run_with_the_reason(tmp_path):
    ctl, fleet = _start(tmp_path, "ft=flashrecovery", "ft.flashrecovery.max_restarts=0")
    ctl.queue.put(("exit", 0, -9, time.time()))
    _round(ctl)
    assert ctl.record.status == "failed" and "restart budget spent" in ctl.record.error
    assert ctl.store.get("abort").decode() == ctl.record.error and len(fleet.spawned) == 4


def test_a_lost_node_and_its_workers_are_fenced(tmp_path):
    ctl, fleet = _node_1_lost_to_the_spares(tmp_path)
    reason, gen = fleet.fenced[1]
    assert list(fleet.fenced) == [1] and gen == 0 and "node 1 went silent" in reason
    assert ctl.store.get(protocol.cut_off_key(0)) == b"node(s) [1] went silent"  # its peers stop waiting for it
    for wid, logical in ((2, 2), (3, 3)):  # written off before the generation that replaced them
        record = protocol.get_json(ctl.store, protocol.worker_fence_key(wid))
        assert (record["wid"], record["logical"], record["gen"]) == (wid, logical, 0)
    assert not any(ctl.store.check([protocol.worker_fence_key(wid)]) for wid in (0, 1, 4, 5))


def test_a_lost_spare_host_is_fenced_and_the_training_generation_left_alone(tmp_path):
    """The spare host runs no member of the generation: it is fenced and its spares written off, but the generation
    is not cut off (its members would give their collective up and retry it for nothing) and none follows."""
    ctl, fleet = _lose_with_spares_ready(tmp_path, 2)
    assert [e["reason"] for e in _events(tmp_path, "recovery_not_needed")] == ["node(s) [2] held no rank"]
    assert list(fleet.fenced) == [2] and int(ctl.store.get("gen")) == 0
    assert not ctl.store.check([protocol.cut_off_key(0)])


def test_a_crash_that_became_a_node_loss_is_recorded_as_a_node_loss(tmp_path):
    ctl, fleet = _start(tmp_path, "ft=[flashrecovery,deadpool]", "parallel.spares=2")
    for wid in (4, 5):
        ctl.store.set(f"ready/{wid}", "1")
    _round(ctl, heartbeats=True)
    ctl.queue.put(("exit", 2, -9, time.time()))
    _round(ctl)
    fleet.lose_node(1)  # before the crash's recovery completed: its host goes too
    _round(ctl, heartbeats=True)
    _round(ctl)
    decided = [(d["recovery"], d["fault"]) for d in _events(tmp_path, "recovery_decided")]
    assert decided == [(0, "process_crash"), (0, "node_loss")]
    [rec] = ctl.record.recoveries
    assert (rec.fault, rec.action) == ("node_loss", "swap_spare")


def test_a_run_whose_replicas_differ_fails_everywhere_with_one_verdict(tmp_path):
    ctl, fleet = _start(tmp_path, "ft=flashrecovery")
    _finish(ctl, [0, 1, 2])
    protocol.set_json(ctl.store, "done/3", {"checksum": "d", "global_step": 8, "computed_ranks": [3]})
    ctl.store.add("done_count", 1)
    _round(ctl)
    assert ctl.record.status == "completed"  # every rank finished; their parameters are compared at the end
    ctl.end(StopOnSignal(ctl.store, ctl.events, fleet.post_notice))
    assert fleet.status == "failed"  # every host's agent exits non-zero
    [end] = _events(tmp_path, "run_end")
    summary = write_summary(ctl.cfg, tmp_path, ctl.record)
    assert end["status"] == summary["status"] == "failed"
    assert end["error"] == summary["error"] == "replicas ended with different parameters: 2 distinct checksums"
