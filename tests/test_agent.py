"""The node agent on real processes: every worker exit reaches the controller's queue exactly once."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from queue import Empty, Queue

import pytest

from runner.agent import NodeAgent


@pytest.fixture
def agent():
    events: Queue = Queue()
    agent = NodeAgent(0, events, interval_s=0.05)
    yield agent, events
    agent.stop()


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


def test_an_exit_another_thread_reaped_first_is_still_reported(agent):
    """Reading ``Process.exitcode`` reaps the child: the controller does that (pids()) while it waits
    for the victims of kill_all. An exit reaped before the agent looked at it was never reported, so
    the decision went ahead without that rank (a soak run handed every rank to the one it missed)."""
    agent, events = agent
    a, b = _sleeper(), _sleeper()
    agent.add(1, a)
    os.kill(b.pid, signal.SIGKILL)
    b.join()  # reaped here, before the agent has seen it
    agent.add(2, b)
    os.kill(a.pid, signal.SIGKILL)
    exits = _exits(events, 2)
    assert sorted((wid, code) for _, wid, code, _ in exits) == [(1, -9), (2, -9)]
    assert agent.exit_reported(1) and agent.exit_reported(2)


def test_a_lost_node_reports_no_exit_but_counts_it_as_seen(agent):
    agent, events = agent
    a = _sleeper()
    agent.add(1, a)
    assert not agent.exit_reported(1)
    assert agent.lose_node() == [1]
    a.join()
    assert _exits(events, 0) == []  # the controller learns of a lost node from its silence
    assert agent.exit_reported(1)
