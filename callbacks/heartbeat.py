"""Worker heartbeats, sent from a daemon thread so the training step never waits for them.

Payload: sequence number, step, phase, RSS, and the newest committed steps' timings (compute,
reduction wait, link: ``runner.control.stragglers``), and the generation and the count of collectives
in flight (where a hang is stuck: ``runner.control.diagnosis``). The thread also reads the newest generation number,
so a planned change (a repaired rank rejoining) is noticed at the next step at no cost to it, and
whether the controller asked the run to stop (``protocol.STOP``). The
controller declares a worker dead after ``misses`` silent intervals (SIGSTOP, a wedged process)
and hung when the step stops advancing while heartbeats still arrive. If the store itself is gone
(the controller died), the worker exits: no orphan keeps running.
"""

from __future__ import annotations

import json
import os
import threading
import time

from lightning.pytorch.callbacks import Callback

from runner import protocol
from runner.status import WorkerStatus

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class Heartbeat(Callback):
    def __init__(self, host: str, port: int, namespace: str, status: WorkerStatus, interval_s: float,
                 orphan_after_s: float, comm=None) -> None:
        """``comm``: whose generation and collectives in flight each beat reports (where a hang is stuck)."""
        self.host, self.port, self.namespace, self.status = host, port, namespace, status
        self.comm = comm
        self.interval_s, self.orphan_after_s = interval_s, orphan_after_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5 * self.interval_s + 1)

    def on_train_end(self, trainer, pl_module) -> None:
        self.status.phase = "finishing"  # callbacks' end-of-fit work (a persist drain) is no stalled step

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.stop()

    def _run(self) -> None:
        store = protocol.connect(self.host, self.port, max(2.0, 2 * self.interval_s), self.namespace)
        key = f"hb/{self.status.wid}"
        seq = 0
        last_ok = time.monotonic()
        while not self._stop.is_set():
            seq += 1
            payload = {"seq": seq, "step": self.status.step, "phase": self.status.phase, "rss": rss_bytes(),
                       "t": time.time()}
            if self.status.timings:
                payload["timing"] = self.status.timings
            if self.comm is not None:  # read only: the count of launched collectives not waited for yet
                payload["gen"] = self.comm.gen
                payload["in_flight"] = len(getattr(self.comm, "_in_flight", ()))
            try:
                store.set(key, json.dumps(payload))
                if self.status.latest_gen >= 0 or store.check(["gen"]):  # planned membership changes reach
                    self.status.latest_gen = int(store.get("gen"))  # the trainer without a per-step cost
                if not self.status.stop_requested and store.check([protocol.STOP]):
                    self.status.stop_requested = True
                last_ok = time.monotonic()
            except Exception:
                if time.monotonic() - last_ok > self.orphan_after_s:
                    os._exit(70)  # the controller is gone: do not linger as an orphan
            self._stop.wait(self.interval_s)
