"""FaultInjectingComm on a real one-member gloo group: each armed fault surfaces as a real one would; and where a
dropped group goes."""

from __future__ import annotations

import threading
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch.distributed import TCPStore

from runner.faults.comm_faults import FaultInjectingComm
from runner.plumbing.protocol import Layout
from runner.training.comm import CollectiveFailure, Comm, GlooGroup
from runner.training.reducer import GradReducer

TIMEOUTS = SimpleNamespace(collective_timeout_s=10.0, rendezvous_timeout_s=10.0, recovery_timeout_s=10.0)
LAYOUT = Layout(gen=0, members=[0], logical=[0], dp=1)


@pytest.fixture
def comm():
    store = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    comm = FaultInjectingComm(store, 0, "gloo", torch.device("cpu"), TIMEOUTS)
    comm.join(LAYOUT)
    yield comm
    comm.abort()


def _reduction(comm) -> GradReducer:
    model = torch.nn.Linear(4, 2)
    model(torch.ones(3, 4)).sum().backward()
    return GradReducer(comm, model, 1 << 20, 3, lambda: torch.zeros(3, dtype=torch.float64))


def test_a_plain_comm_has_no_fault_to_arm():
    assert not any(hasattr(Comm, name) for name in ("fail_next_collective", "partition", "hold_next_shard_copy"))


def test_the_next_collective_fails_once_then_the_group_is_rebuilt_and_works(comm):
    comm.fail_next_collective()
    with pytest.raises(CollectiveFailure, match="injected transient connection error"):
        comm.barrier()
    assert comm.pg is None
    comm.join(Layout(gen=1, members=[0], logical=[0], dp=1))
    comm.barrier()


def test_a_reduction_fails_after_completing_and_other_collectives_do_not(comm):
    comm.fail_next_reduction()
    comm.barrier()  # not the step's reduction: untouched
    reducer = _reduction(comm)
    with pytest.raises(CollectiveFailure, match="after the reduction completed"):
        reducer.reduce()
    assert comm.pg is None and comm._in_flight == []


def test_a_partition_fails_collectives_and_the_next_rendezvous(comm):
    comm.partition(60.0)
    with pytest.raises(CollectiveFailure, match="network partition"):
        comm.barrier()
    with pytest.raises(CollectiveFailure, match="network partition"):
        comm.join(Layout(gen=1, members=[0], logical=[0], dp=1))


def test_a_dropped_group_is_closed_and_destroyed_on_a_thread_of_its_own(comm, monkeypatch):
    """``Comm.abort`` keeps no reference to the groups it drops: their connections close and their destructors
    run on the closing thread (each waits for a tick of gloo's event loop), not in the caller, whose next
    rendezvous would wait for them."""
    closed_on: list[str] = []
    close = GlooGroup.close_connections

    def recorded(group: GlooGroup) -> None:
        closed_on.append(threading.current_thread().name)
        close(group)

    monkeypatch.setattr(GlooGroup, "close_connections", recorded)
    comm.barrier()
    assert isinstance(comm.pg, GlooGroup)
    dropped = weakref.ref(comm.pg)
    comm.abort()
    assert comm.pg is None
    for thread in [t for t in threading.enumerate() if t.name == "close-groups"]:
        thread.join(timeout=10)
    assert dropped() is None  # destroyed: __del__ closed it once more, on the same thread
    assert closed_on == ["close-groups", "close-groups"]
