"""Whether this process still reaches the controller: the bound on every wait of a node agent or a worker.

A store call to a controller whose host went silent (a link down, a host powered off) neither answers nor fails:
TCPStore's ``check``, ``get`` and ``add`` wait for a reply with no timeout of their own, until the kernel gives the
connection up (about 15 minutes of TCP retransmissions), and a stopped controller process is never given up at all.
So the deadline is not left to the calls: the thread that beats marks each round of its store calls
(``asking``, then ``answered`` once the controller's store replied), and a watchdog thread of its own, which makes no
store call, calls ``lost`` once a round has gone unanswered for ``after_s``
(``HeartbeatConfig.controller_lost_after_s``), however the calls are blocked. ``lost`` ends the process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Optional


class ControllerContact:
    """The beat thread's rounds of store calls, watched: ``lost(silent_s)`` once one went unanswered for ``after_s``."""

    def __init__(self, after_s: float, lost: Callable[[float], None], name: str) -> None:
        self.after_s, self.lost = after_s, lost
        self._asked: Optional[float] = None  # when the oldest unanswered round began (monotonic); None: all answered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def asking(self) -> None:
        """A round of store calls begins (a failed round before it, not answered since, still counts from its start)."""
        if self._asked is None:
            self._asked = time.monotonic()

    def answered(self) -> None:
        """The controller's store replied to the round."""
        self._asked = None

    def _watch(self) -> None:
        # checks four times per bound: the process ends at most a quarter of the bound after it ran out
        while not self._stop.wait(self.after_s / 4):
            asked = self._asked
            if asked is not None and time.monotonic() - asked > self.after_s:
                self.lost(time.monotonic() - asked)
                return
