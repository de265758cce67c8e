"""The workers' heartbeats as the controller reads them, by ``heartbeat.route``: one source per route, one shape of
beat for detection, diagnosis and the straggler watch.

``read`` gives each worker's ``(seq, beat)``: ``seq`` changes while the worker proves alive; the beat is a dict with
``step``, ``phase``, ``gen``, ``in_flight`` and the newest ``timing`` records, and is the same object as long as its
content is (detection handles a beat's content once: ``Detector.poll_heartbeats``). ``StoreBeats`` reads each
worker's own record from the store (``route=store``): one ``multi_get`` and one decode per worker per read, so every
beat is new. ``AgentBeats`` reads the records the node agents write (``route=agent``, ``runner.agents.beat_relay``):
only the hosts whose beat names a record version not read yet, one ``multi_get`` for all of them; a worker's beat
is its row of its host's record, and its ``seq`` is its agent's beat count while the agent heard it within two
intervals (its row is not ``quiet``) and stays put once it is quiet, so detection's silence rule runs on the agent's
judgement as it runs on a worker's own sequence number under ``route=store``. ``settled`` names the hosts with nothing
to read: their agent beat again and their record did not move and holds no quiet row, so each of their workers just
proved alive; detection gives those workers their new ``seq`` without reading them, and walks only the rest.
"""

from __future__ import annotations

import json
from typing import Optional

from runner.control.records import Worker
from runner.plumbing import protocol

NO_ROWS: dict[int, dict] = {}  # a host whose record was not read yet


class StoreBeats:
    """``heartbeat.route=store``: every worker's record under ``hb/<wid>``."""

    settles = False  # ``settled`` never names a host: detection keeps no floors for it

    def __init__(self, store) -> None:
        self.store = store

    def refresh(self) -> None:
        """Nothing to fetch ahead: every read goes to the store."""

    def settled(self) -> dict[int, tuple[dict, int]]:
        """No host is: every beat is the worker's own, read each time."""
        return {}

    def started(self, w: Worker) -> bool:
        return self.store.check([f"hb/{w.wid}"])

    def read(self, workers: list[Worker]) -> list[tuple[int, dict]]:
        """Each worker's ``(seq, beat)`` (every one has ``started``): one round trip for all."""
        if not workers:
            return []
        beats = [json.loads(raw) for raw in self.store.multi_get([f"hb/{w.wid}" for w in workers])]
        return [(beat["seq"], beat) for beat in beats]

    def all_heard(self, workers: list[Worker], within_s: float, wall: float) -> bool:
        """Whether every worker wrote a heartbeat within ``within_s`` of ``wall`` (their clocks against this host's)."""
        keys = [f"hb/{w.wid}" for w in workers]
        if not self.store.check(keys):
            return False  # one has not beaten at all yet
        return all(wall - json.loads(raw)["t"] <= within_s for raw in self.store.multi_get(keys))


class AgentBeats:
    """``heartbeat.route=agent``: the node agents' records of their ranks, read when their version moved."""

    settles = True

    def __init__(self, store, fleet) -> None:
        self.store, self.fleet = store, fleet
        self.rows: dict[int, dict[int, dict]] = {}  # node -> wid -> its row
        self.versions: dict[int, int] = {}  # node -> the version of its record read last
        self.quiet: set[int] = set()  # nodes whose record read last has a quiet row
        self._seen: dict[int, tuple[dict, int]] = {}  # node -> (its rows, its agent's beats) at the last ``settled``
        self.records_read = 0  # how many records were fetched and decoded (the cost the route keeps low)

    def refresh(self) -> None:
        """Read the records whose version moved since the last call, in one round trip: the versions are those of the
        beats the caller just read (``fleet.node_beats``)."""
        moved = [a for a in self.fleet.agents
                 if a.registered and not a.lost and a.record_version > self.versions.get(a.node, 0)]
        if not moved:
            return
        raws = self.store.multi_get([protocol.agent_key(a.node, "ranks") for a in moved])
        self.records_read += len(moved)
        for agent, raw in zip(moved, raws):
            record = json.loads(raw)  # the newest: at least the version the beat named
            self.versions[agent.node] = record["v"]
            rows = self.rows[agent.node] = {int(wid): row for wid, row in record["rows"].items()}
            if any(row["quiet"] for row in rows.values()):
                self.quiet.add(agent.node)
            else:
                self.quiet.discard(agent.node)

    def settled(self) -> dict[int, tuple[dict, int]]:
        """The hosts whose workers each proved alive since the last call with nothing new to tell: the agent beat
        again, and its record is the one it had at the last call (the caller handled its rows since) and has no quiet
        row. node -> (its rows, its agent's beat count: the ``seq`` ``read`` would give each of its rows)."""
        out: dict[int, tuple[dict, int]] = {}
        seen, rows, quiet = self._seen, self.rows, self.quiet
        for agent in self.fleet.agents:
            node = agent.node
            host_rows, beats = rows.get(node), agent.beats
            if host_rows is None:
                continue  # no record read yet
            before = seen.get(node)
            seen[node] = (host_rows, beats)
            if before is None or agent.lost or node in quiet:
                continue
            if before[1] != beats and before[0] is host_rows:  # it beat again; its record is the one handled
                out[node] = (host_rows, beats)
        return out

    def _row(self, w: Worker) -> Optional[dict]:
        return self.rows.get(w.node, NO_ROWS).get(w.wid)

    def started(self, w: Worker) -> bool:
        return self._row(w) is not None

    def read(self, workers: list[Worker]) -> list[tuple[int, dict]]:
        """Each worker's ``(seq, beat)`` (every one has ``started``): its row, the same object until its host's record
        is read again. A quiet row's ``seq`` is the one the worker holds (``hb_seq``, as detection last gave it); a
        worker whose row left its host's record (it exited: its agent dropped it) keeps its last beat and ``seq``."""
        out = []
        agents, rows = self.fleet.agents, self.rows
        for w in workers:
            row = rows.get(w.node, NO_ROWS).get(w.wid)
            if row is None:
                assert w.hb_beat is not None  # a started worker's beat was handled: its row was read before
                out.append((w.hb_seq, w.hb_beat))
            else:
                out.append((agents[w.node].beats if not row["quiet"] else max(w.hb_seq, 0), row))
        return out

    def all_heard(self, workers: list[Worker], within_s: float, wall: float) -> bool:
        """Whether every worker's agent heard it within two intervals as of the agent's newest beat (the caller checked
        those beats are fresh, reading them). The agent judges on its own clock, so no two hosts' clocks are compared:
        ``within_s`` and ``wall`` are for ``StoreBeats``, which compares the workers' times with this host's."""
        self.refresh()
        return all((row := self._row(w)) is not None and not row["quiet"] for w in workers)


def beat_source(cfg, store, fleet) -> StoreBeats | AgentBeats:
    return AgentBeats(store, fleet) if cfg.heartbeat.route == "agent" else StoreBeats(store)
