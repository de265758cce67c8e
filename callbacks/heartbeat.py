"""Worker heartbeats, sent from a daemon thread so the training step never waits for them.

Payload: sequence number, step, phase, RSS, and the newest committed steps' timings (compute,
reduction wait, link: ``runner.control.stragglers``), and the generation and the count of collectives
in flight (where a hang is stuck: ``runner.control.diagnosis``). The thread also reads the newest generation number,
so a planned change (a repaired rank rejoining) is noticed at the next step at no cost to it, and
whether the controller asked the run to stop (``protocol.STOP``). The
controller declares a worker dead after ``misses`` silent intervals (SIGSTOP, a wedged process)
and hung when the step stops advancing while heartbeats still arrive. If the controller cannot be reached
for ``HeartbeatConfig.controller_lost_after_s`` (it died, or its host went silent and the store calls
block), the worker exits (``EXIT_CONTROLLER_LOST``): no orphan keeps running (``runner.plumbing.contact``). A worker the
controller wrote off (``protocol.worker_fence_key``) exits (``EXIT_FENCED``) at the first beat after a new
generation or after it was out of touch: a worker heard again after its host's link healed never acts in the job
again.

Where the beat goes is ``heartbeat.route``: ``StoreLink`` writes the worker's own record in the store and reads the
generation, a stop and the fence there; ``AgentLink`` sends the beat to the host's node agent, which answers with
them (``runner.agents.beat_relay``): then the controller's contact is watched through the agent, which itself halts
and kills its workers once it loses the controller.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional

from lightning.pytorch.callbacks import Callback

from runner.plumbing import protocol
from runner.plumbing.beat_socket import MAX_DATAGRAM, socket_address
from runner.plumbing.contact import ControllerContact
from runner.plumbing.events import EventLog
from runner.training.status import WorkerStatus

EXIT_CONTROLLER_LOST = 70  # the controller could not be reached for controller_lost_after_s
EXIT_FENCED = 71  # the controller wrote this worker off

_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class News:
    """What a beat's answer tells the worker: the newest generation (-1: none yet), whether the run is to stop, the
    controller's record writing this worker off (None: it is not)."""

    gen: int
    stop: bool
    fence: Optional[dict]


class StoreLink:
    """``heartbeat.route=store``: the worker's own record in the job's store, with a sequence number so the controller
    sees it change; the generation and a stop read from the store every beat."""

    def __init__(self, store, status: WorkerStatus, interval_s: float) -> None:
        self.store, self.status, self.interval_s = store, status, interval_s
        self.key, self.fence = f"hb/{status.wid}", protocol.worker_fence_key(status.wid)
        self.seq = 0
        self.fence_read_at: Optional[int] = None  # the generation this worker last read its fence in
        self.answered = time.monotonic()

    def exchange(self, payload: dict) -> News:
        self.seq += 1
        store = self.store
        store.set(self.key, json.dumps({**payload, "seq": self.seq}))
        gen = int(store.get("gen")) if self.status.latest_gen >= 0 or store.check(["gen"]) else -1
        stop = not self.status.stop_requested and store.check([protocol.STOP])
        # A fence is written before the generation that replaces its worker, so it is read only when a new generation
        # appeared, or when this worker was out of touch (stopped, or behind a link that was down): not one more store
        # operation on every beat of every worker.
        fence = None
        out_of_touch = time.monotonic() - self.answered > 2 * self.interval_s
        if self.fence_read_at != gen or out_of_touch:
            if store.check([self.fence]):
                fence = protocol.get_json(store, self.fence)
            self.fence_read_at = gen
        self.answered = time.monotonic()
        return News(gen, stop, fence)


class AgentLink:
    """``heartbeat.route=agent``: a datagram to the host's node agent (``runner.agents.beat_relay``), which answers
    with what it read from the store."""

    def __init__(self, name: str, interval_s: float) -> None:
        self.address = socket_address(name)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("")  # an address of its own (autobound, abstract) for the agent's answers
        self.sock.settimeout(interval_s)

    def exchange(self, payload: dict) -> News:
        self.sock.sendto(json.dumps(payload).encode(), self.address)
        answer = json.loads(self.sock.recv(MAX_DATAGRAM))
        return News(answer["gen"], answer["stop"], answer["fence"])


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class Heartbeat(Callback):
    def __init__(self, host: str, port: int, namespace: str, status: WorkerStatus, interval_s: float,
                 lost_after_s: float, events: EventLog, comm=None, beat_socket: Optional[str] = None) -> None:
        """``comm``: whose generation and collectives in flight each beat reports (where a hang is stuck);
        ``beat_socket``: the host agent's socket (``heartbeat.route=agent``), else the beats go to the store."""
        self.host, self.port, self.namespace, self.status = host, port, namespace, status
        self.beat_socket = beat_socket
        self.interval_s, self.events, self.comm = interval_s, events, comm
        self.contact = ControllerContact(lost_after_s, self._controller_lost, name="controller-contact")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self.contact.start()
        self._thread.start()

    def stop(self) -> None:
        self.contact.stop()
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5 * self.interval_s + 1)

    def on_train_end(self, trainer, pl_module) -> None:
        self.status.phase = "finishing"  # callbacks' end-of-fit work (a persist drain) is no stalled step

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.stop()

    def _run(self) -> None:
        link = self._link()
        while not self._stop.is_set():
            self.contact.asking()
            try:
                news = link.exchange(self._payload())
                if news.gen >= 0:  # planned membership changes reach the trainer without a per-step cost
                    self.status.latest_gen = news.gen
                self.status.stop_requested = self.status.stop_requested or news.stop
                if news.fence is not None:
                    self._fenced(news.fence)
                self.contact.answered()
            except Exception:
                pass  # not answered: the contact's watchdog ends the worker once that lasts
            self._stop.wait(self.interval_s)

    def _link(self) -> StoreLink | AgentLink:
        if self.beat_socket is None:
            return StoreLink(protocol.connect(self.host, self.port, max(2.0, 2 * self.interval_s), self.namespace),
                             self.status, self.interval_s)
        return AgentLink(self.beat_socket, self.interval_s)

    def _payload(self) -> dict:
        payload = {"wid": self.status.wid, "step": self.status.step, "phase": self.status.phase, "rss": rss_bytes(),
                   "t": time.time()}
        if self.status.timings:
            payload["timing"] = self.status.timings
        if self.comm is not None:  # read only: the count of launched collectives not waited for yet
            payload["gen"] = self.comm.gen
            payload["in_flight"] = len(getattr(self.comm, "_in_flight", ()))
        return payload

    def _fenced(self, record: dict) -> None:
        """Written off by the controller (its host was declared lost, or it was replaced): leave at once."""
        self.events.emit("worker_fenced", wid=self.status.wid, gen=record.get("gen"), reason=record.get("reason"))
        os._exit(EXIT_FENCED)

    def _controller_lost(self, silent_s: float) -> None:
        """The controller did not answer for the bound: do not linger as an orphan."""
        self.events.emit("controller_lost", wid=self.status.wid, silent_s=round(silent_s, 3),
                         bound_s=self.contact.after_s)
        os._exit(EXIT_CONTROLLER_LOST)
