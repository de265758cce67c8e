"""The host's worker heartbeats under ``heartbeat.route=agent``: received by the node agent, judged on the host, and
written to the job's store as one record that changes only when a rank's step or phase does.

With ``route=store`` every worker writes its heartbeat to host 0's store and reads the generation and a stop from it
every interval, and the controller decodes every worker's record every interval: host 0's work grows with the ranks
(docs/recovery.md, "What a heartbeat costs host 0"). Here each worker sends its heartbeat as a datagram over a Unix
socket to its own host's agent and reads the answer (the newest generation, a stop, its fence) from the agent. The
agent keeps one row per rank (step, phase, generation, collectives in flight, the timings of the steps committed
since the record before last) and marks a rank ``quiet`` once it has not heard it for two intervals (a stopped or
wedged process). The record is rewritten, with a new version, only when a row changes (a step or phase moved, a
rank went quiet or was heard again, a rank's collectives in flight changed while its step held for two intervals:
where a hang is stuck, ``runner.control.diagnosis``); the agent's beat carries that version, so the controller
reads and decodes only the records that moved (``runner.control.beats``).

The socket's name and how a worker finds it: ``runner.plumbing.beat_socket``.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Optional

from runner.plumbing.beat_socket import MAX_DATAGRAM, socket_address

QUIET_INTERVALS = 2  # a rank not heard for this many intervals is quiet
SETTLED_INTERVALS = 2  # a rank whose step held this long reports a change of its collectives in flight


class BeatRelay:
    """The agent's side: serves its workers' heartbeats from a thread of its own (``start``) and hands the agent's
    beat loop the host's record whenever it changed (``record``)."""

    def __init__(self, node: int, interval_s: float) -> None:
        self.interval_s = interval_s
        self.name = f"resilient-runner/{os.getpid()}/beats/{node}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(socket_address(self.name))
        self.sock.settimeout(interval_s)
        self.gen = -1  # the newest generation the agent read
        self.stop_requested = False
        self.fences: dict[int, dict] = {}  # wid -> the controller's record writing it off
        self.version = 0
        self._rows: dict[int, dict] = {}  # wid -> its row, as the next record will hold it
        self._timings: dict[int, list] = {}  # wid -> the newest timings its heartbeat carried
        self._heard: dict[int, float] = {}  # wid -> when its last heartbeat came (monotonic)
        self._held: dict[int, float] = {}  # wid -> since when its (step, phase) held (monotonic)
        self._floors: dict[int, tuple[int, int]] = {}  # wid -> newest step timed in the record before last, in the last
        self._changed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="beat-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s + 1)
        self.sock.close()

    def forget(self, wid: int) -> None:
        """Worker ``wid`` exited: its row leaves the record."""
        with self._lock:
            if self._rows.pop(wid, None) is not None:
                self._changed = True
            for table in (self._timings, self._heard, self._held, self._floors):
                table.pop(wid, None)

    def answer(self, wid: int) -> dict:
        with self._lock:
            return {"gen": self.gen, "stop": self.stop_requested, "fence": self.fences.get(wid)}

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                raw, sender = self.sock.recvfrom(MAX_DATAGRAM)
            except (TimeoutError, OSError):
                continue
            try:
                beat = json.loads(raw)
                self.heard(beat)
                self.sock.sendto(json.dumps(self.answer(beat["wid"])).encode(), sender)
            except (ValueError, KeyError, OSError):
                continue  # a malformed datagram, or its sender is gone: nothing to answer

    def heard(self, beat: dict) -> None:
        """A worker's heartbeat: its row changes when its step, phase or generation moved, it was quiet, or its
        collectives in flight changed while its step held (settled)."""
        wid, now = int(beat["wid"]), time.monotonic()
        with self._lock:
            row = self._rows.get(wid)
            moved = row is None or (row["step"], row["phase"], row["gen"]) != (beat["step"], beat["phase"],
                                                                              beat.get("gen", -1))
            if moved:
                self._held[wid] = now
            settled = now - self._held[wid] >= SETTLED_INTERVALS * self.interval_s
            if (moved or row is None or row["quiet"] or (settled and row["in_flight"] != beat.get("in_flight", 0))):
                self._rows[wid] = {"step": beat["step"], "phase": beat["phase"], "gen": beat.get("gen", -1),
                                   "in_flight": beat.get("in_flight", 0), "t": beat["t"], "quiet": False}
                self._changed = True
            self._heard[wid] = now
            self._timings[wid] = beat.get("timing") or []

    def record(self) -> Optional[str]:
        """The host's record if it changed since the last call (its version moved), else None. Marks the ranks not
        heard for ``QUIET_INTERVALS`` quiet first."""
        now = time.monotonic()
        with self._lock:
            for wid, row in self._rows.items():
                if not row["quiet"] and now - self._heard[wid] > QUIET_INTERVALS * self.interval_s:
                    row["quiet"] = True
                    self._changed = True
            if not self._changed:
                return None
            self._changed = False
            self.version += 1
            rows = {}
            for wid, row in self._rows.items():
                before_last, last = self._floors.get(wid, (-1, -1))
                timing = [t for t in self._timings[wid] if t[0] > before_last]
                newest = max([last, *(t[0] for t in timing)])
                self._floors[wid] = (last, newest)
                rows[str(wid)] = {**row, "timing": timing} if timing else row
            return json.dumps({"v": self.version, "rows": rows}, separators=(",", ":"))
