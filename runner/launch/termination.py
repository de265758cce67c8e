"""SIGTERM ends a rank of a torchrun/SLURM job at once.

torchrun stops its ranks with SIGTERM (on a restart, or when it is stopped itself) and sends SIGKILL
only 30 s later; SLURM does the same on a cancel or a time limit. Lightning installs a SIGTERM handler
that only stops training at the next step, and a Python handler runs only once the main thread
returns to the interpreter: a rank blocked in a collective with a dead peer would sit out the whole
grace period. Here the interpreter's C-level handler also writes the signal's number to a wake-up
pipe (``signal.set_wakeup_fd``), and a thread reading it ends the process at once, whatever the main
thread is doing (after ``on_term``: rank 0 records how its attempt ended). Lightning keeps this
module's Python handler in its chain, which does the same when the main thread gets to it first.

A node agent under torchrun or SLURM (``launcher.mode=per_host``) halts this way too: torchrun ends it with SIGTERM
when its rendezvous store went away with node 0's host, and the default action would end it at once, its persister
with it, halfway through the breakpoint persists its workers' deaths started.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Optional

EXIT_TERMINATED = 128 + signal.SIGTERM  # what a shell reports for a process SIGTERM ended


class PromptTermination:
    """Install in the main thread, before training starts. ``main_thread_acts``: the Python-level handler ends the
    process too when the main thread gets to it first; false where ``on_term`` may wait for what the main thread is
    doing (a node agent's halt already under way there): then only the watching thread acts."""

    def __init__(self, on_term: Optional[Callable[[], None]] = None, main_thread_acts: bool = True) -> None:
        self.on_term, self.main_thread_acts = on_term, main_thread_acts
        self._once = threading.Lock()

    def install(self) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C handler must never block
        signal.signal(signal.SIGTERM, lambda signum, frame: self.terminate() if self.main_thread_acts else None)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="sigterm-watch", daemon=True).start()

    def _watch(self, read_fd: int) -> None:
        while True:
            numbers = os.read(read_fd, 64)
            if not numbers:
                return
            if signal.SIGTERM in numbers:  # other signals with Python handlers wake it too
                self.terminate()

    def terminate(self) -> None:
        self._once.acquire()  # a second caller waits for the first one's exit
        try:
            if self.on_term is not None:
                self.on_term()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_TERMINATED)
