"""The controller's exit watchers are connected before the launch goes on: an exit reported in the first seconds is
read as an exit, however slow a new store connection is (the store's reverse DNS lookup of each peer)."""

from __future__ import annotations

import threading
import time
from queue import Queue

import pytest
from torch.distributed import DistNetworkError

from runner.agents.fleet import AgentFleet, AgentHandle
from runner.plumbing import protocol


def _fleet(store, nodes: int, start_timeout_s: float) -> AgentFleet:
    """An AgentFleet holding only what its exit watchers use, over a real store (no agents are started)."""
    fleet = AgentFleet.__new__(AgentFleet)
    fleet.store, fleet.address, fleet.events = store, ("127.0.0.1", store.port), Queue()
    fleet.start_timeout_s = start_timeout_s
    fleet.agents = [AgentHandle(n, None, silence_s=1.0) for n in range(nodes)]
    return fleet


def test_watchers_are_connected_when_the_launch_goes_on_and_read_an_exit_at_once(monkeypatch):
    store = protocol.host_store("127.0.0.1", 10)
    real_connect = protocol.connect

    def slow_connect(*args, **kwargs):
        time.sleep(0.3)  # a connection that the store's name lookup holds up
        return real_connect(*args, **kwargs)

    monkeypatch.setattr(protocol, "connect", slow_connect)
    fleet = _fleet(store, 3, start_timeout_s=10)
    fleet._start_watchers(fleet.agents)
    assert all(a.watching.is_set() for a in fleet.agents)
    k = store.add(protocol.agent_key(1, "exits"), 1)
    protocol.set_json(store, protocol.agent_key(1, "exit", k), {"wid": 5, "code": -9, "t": 1.0})
    assert fleet.events.get(timeout=10) == ("exit", 5, -9, 1.0)
    for a in fleet.agents:
        fleet._end_exits(a)
        a.watcher.join(timeout=10)
        assert not a.watcher.is_alive()


# the watcher thread ends with the connection error it could not get past (printed: the "error above" the message)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_watcher_that_cannot_connect_stops_the_launch_with_the_timeout_to_change(monkeypatch):
    store = protocol.host_store("127.0.0.1", 10)
    release = threading.Event()

    def stuck_connect(*args, **kwargs):
        release.wait(30)
        raise DistNetworkError("no connection")

    monkeypatch.setattr(protocol, "connect", stuck_connect)
    fleet = _fleet(store, 1, start_timeout_s=0.5)
    with pytest.raises(RuntimeError, match=r"node 0's exits did not connect .* launcher.start_timeout_s=0.5"):
        fleet._start_watchers(fleet.agents)
    release.set()
    fleet.agents[0].watcher.join(timeout=10)
    assert not fleet.agents[0].watcher.is_alive()
