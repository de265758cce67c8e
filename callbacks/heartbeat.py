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
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Optional

from lightning.pytorch.callbacks import Callback

from runner.plumbing import protocol
from runner.plumbing.contact import ControllerContact
from runner.plumbing.events import EventLog
from runner.training.status import WorkerStatus

EXIT_CONTROLLER_LOST = 70  # the controller could not be reached for controller_lost_after_s
EXIT_FENCED = 71  # the controller wrote this worker off

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class Heartbeat(Callback):
    def __init__(self, host: str, port: int, namespace: str, status: WorkerStatus, interval_s: float,
                 lost_after_s: float, events: EventLog, comm=None) -> None:
        """``comm``: whose generation and collectives in flight each beat reports (where a hang is stuck)."""
        self.host, self.port, self.namespace, self.status = host, port, namespace, status
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
        store = protocol.connect(self.host, self.port, max(2.0, 2 * self.interval_s), self.namespace)
        key, fence = f"hb/{self.status.wid}", protocol.worker_fence_key(self.status.wid)
        seq = 0
        fence_read_at: Optional[int] = None  # the generation this worker last read its fence in
        answered = time.monotonic()
        while not self._stop.is_set():
            seq += 1
            payload = {"seq": seq, "step": self.status.step, "phase": self.status.phase, "rss": rss_bytes(),
                       "t": time.time()}
            if self.status.timings:
                payload["timing"] = self.status.timings
            if self.comm is not None:  # read only: the count of launched collectives not waited for yet
                payload["gen"] = self.comm.gen
                payload["in_flight"] = len(getattr(self.comm, "_in_flight", ()))
            self.contact.asking()
            try:
                store.set(key, json.dumps(payload))
                if self.status.latest_gen >= 0 or store.check(["gen"]):  # planned membership changes reach
                    self.status.latest_gen = int(store.get("gen"))  # the trainer without a per-step cost
                if not self.status.stop_requested and store.check([protocol.STOP]):
                    self.status.stop_requested = True
                # A fence is written before the generation that replaces its worker, so it is read only when a
                # new generation appeared, or when this worker was out of touch (stopped, or behind a link that
                # was down): not one more store operation on every beat of every worker.
                out_of_touch = time.monotonic() - answered > 2 * self.interval_s
                if fence_read_at != self.status.latest_gen or out_of_touch:
                    if store.check([fence]):
                        self._fenced(protocol.get_json(store, fence))
                    fence_read_at = self.status.latest_gen
                self.contact.answered()
                answered = time.monotonic()
            except Exception:
                pass  # not answered: the contact's watchdog ends the worker once that lasts
            self._stop.wait(self.interval_s)

    def _fenced(self, record: dict) -> None:
        """Written off by the controller (its host was declared lost, or it was replaced): leave at once."""
        self.events.emit("worker_fenced", wid=self.status.wid, gen=record.get("gen"), reason=record.get("reason"))
        os._exit(EXIT_FENCED)

    def _controller_lost(self, silent_s: float) -> None:
        """The controller did not answer for the bound: do not linger as an orphan."""
        self.events.emit("controller_lost", wid=self.status.wid, silent_s=round(silent_s, 3),
                         bound_s=self.contact.after_s)
        os._exit(EXIT_CONTROLLER_LOST)
