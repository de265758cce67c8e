"""GradReducer and Comm's launched collectives on a real one-member gloo group (no other process)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed import TCPStore

from runner.faults.comm_faults import FaultInjectingComm
from runner.plumbing.protocol import Layout
from runner.training.comm import CollectiveFailure
from runner.training.reducer import GradReducer

TIMEOUTS = SimpleNamespace(collective_timeout_s=10.0, rendezvous_timeout_s=10.0, recovery_timeout_s=10.0)


@pytest.fixture
def comm():
    store = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    comm = FaultInjectingComm(store, 0, "gloo", torch.device("cpu"), TIMEOUTS)
    comm.join(Layout(gen=0, members=[0], logical=[0], dp=1))
    yield comm
    comm.abort()


def _model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)


def _backward(model: torch.nn.Module) -> None:
    model.zero_grad(set_to_none=True)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1)).to(next(model.parameters()).dtype)
    model(x).square().sum().backward()


def _reducer(comm, model, bucket_bytes=200):
    return GradReducer(comm, model, bucket_bytes, 3, lambda: torch.tensor([1.0, 2.5, 0.0], dtype=torch.float64))


def test_armed_backward_launches_every_bucket_before_it_returns(comm):
    model = _model()
    reducer = _reducer(comm, model)
    assert len(reducer.buckets) > 1
    reducer.arm()
    _backward(model)
    assert len(comm._in_flight) == len(reducer.buckets)  # launched from the hooks, inside backward
    local = [p.grad.clone() for p in model.parameters()]
    grads, accounting = reducer.reduce()
    assert accounting.tolist() == [1.0, 2.5, 0.0]
    reducer.write_back(dp=1)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), local))
    assert sum(g.numel() for g in grads) == sum(p.numel() for p in model.parameters())


def test_unarmed_backward_launches_nothing_and_reduce_does_it_all(comm):
    model = _model()
    reducer = _reducer(comm, model)
    _backward(model)  # a retry's, a recompute's or a taken-over micro-batch's backward
    assert comm._in_flight == []
    _, accounting = reducer.reduce()
    assert accounting.tolist() == [1.0, 2.5, 0.0]


def test_a_failed_launch_inside_backward_surfaces_at_reduce_with_grads_intact(comm):
    model = _model()
    reducer = _reducer(comm, model)
    reducer.arm()
    comm.fail_next_collective()
    _backward(model)  # the hooks do not raise
    local = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(CollectiveFailure, match="injected"):
        reducer.reduce()
    assert comm._in_flight == [] and comm.pg is None
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), local))


def test_the_accounting_rides_in_the_last_float_bucket_or_in_a_float64_one_of_its_own(comm):
    floats = _reducer(comm, _model())
    assert [b.accounting is not None for b in floats.buckets].count(True) == 1
    assert floats.buckets[-1].accounting is not None and floats.buckets[-1].params  # no bucket of its own
    halves = _reducer(comm, _model(torch.bfloat16))
    carrier = halves.buckets[-1]
    assert carrier.params == [] and carrier.flat.dtype == torch.float64  # bf16 cannot count exactly
