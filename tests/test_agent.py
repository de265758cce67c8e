"""The node agent's worker watch on real processes: every worker exit is reported exactly once."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from queue import Empty, Queue

import pytest

from runner.agents.node_agent import WorkerWatch


@pytest.fixture
def watch():
    exits: Queue = Queue()
    watch = WorkerWatch(lambda wid, code: exits.put(("exit", wid, code, time.time())))
    yield watch, exits
    watch.stop()


def _sleeper() -> multiprocessing.Process:
    proc = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
    proc.start()
    return proc


def _exits(events: Queue, n: int) -> list[tuple]:
    out = []
    try:
        while len(out) < n:
            out.append(events.get(timeout=10))
        out.append(events.get(timeout=0.3))  # nothing more than n may come
    except Empty:
        pass
    return out


def test_an_exit_another_thread_reaped_first_is_still_reported(watch):
    """Reading ``Process.exitcode`` reaps the child: the agent does that (pids()) while it shuts its
    workers down. An exit reaped before the watch looked at it was never reported, so the decision
    went ahead without that rank (a soak run handed every rank to the one it missed)."""
    watch, events = watch
    a, b = _sleeper(), _sleeper()
    watch.add(1, a)
    os.kill(b.pid, signal.SIGKILL)
    b.join()  # reaped here, before the watch has seen it
    watch.add(2, b)
    os.kill(a.pid, signal.SIGKILL)
    exits = _exits(events, 2)
    assert sorted((wid, code) for _, wid, code, _ in exits) == [(1, -9), (2, -9)]
    assert watch.reported == {1, 2}
