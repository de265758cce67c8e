"""DeadPool's shard replicator on two real processes and a real gloo group: a recovery does not wait
for an exchange of the broken generation that its peer will never complete."""

from __future__ import annotations

import multiprocessing
import socket
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from runner.recovery.deadpool.replicator import ABANDON_AFTER_S, ReplicaLost, ShardReplicator
from runner.topology import Topology
from runner.zero import ZeroOne

COLLECTIVE_TIMEOUT_S = 30.0


def _replicator(rank: int) -> ShardReplicator:
    torch.manual_seed(rank)  # each rank's parameters differ, so a replica shows whose it is
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    zero = ZeroOne(module, torch.optim.AdamW(module.parameters(), lr=1e-2), dp=2)
    zero.shard_for(rank)
    return ShardReplicator(zero, Topology(nodes=2, procs_per_node=1), timeout_s=COLLECTIVE_TIMEOUT_S)


def _group(store, gen: int, rank: int) -> SimpleNamespace:
    """What ShardReplicator.start() reads of a Comm: the generation, its side group, the logical ranks."""
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"gen{gen}/", store), rank, 2, timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return SimpleNamespace(gen=gen, side_pg=pg, logical_rank=rank, layout=SimpleNamespace(logical=[0, 1]))


def _own_shard(rep: ShardReplicator, rank: int) -> list[torch.Tensor]:
    return [rep.zero.params[i].detach().clone() for i in rep.zero.plan.flat_shard(rank)]


def _rank_main(rank: int, port: int, results) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60))
    rep = _replicator(rank)
    comm = _group(store, 0, rank)
    rep.start(comm, 1)  # a complete exchange: each holds the other's shard after 1 update
    rep.wait()
    if rank == 0:
        rep.start(comm, 2)  # its peer never joins this one: the exchange blocks on the peer's message
        stuck = [t for t in threading.enumerate() if t.name.startswith("deadpool-replicate")]
        t0 = time.monotonic()
        abandoned = rep.drain()
        drained_s = time.monotonic() - t0
        del comm  # the recovery drops the broken generation's group (Comm.abort)
        store.set("drained", "1")
    else:
        store.wait(["drained"])
    comm = _group(store, 1, rank)  # the next generation
    rep.start(comm, 3)
    rep.wait()
    if rank == 1:
        results.put(("peer", [t.tolist() for t in _own_shard(rep, 1)]))
        return  # exiting closes the old group's connections: the abandoned exchange now fails
    for thread in stuck:  # the peer's exit closed the old group's connections: the abandoned exchange fails
        thread.join(timeout=COLLECTIVE_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in stuck)
    replica = rep.replica_of(1, 3)
    try:
        rep.replica_of(1, 2)
        lost = ""
    except ReplicaLost as err:
        lost = str(err)
    results.put(("holder", abandoned, drained_s, replica.gen, [t.tolist() for t in replica.params], lost))


def test_a_recovery_abandons_an_exchange_its_peer_never_completes():
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:  # a port from the OS for the store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank_main, args=(rank, port, results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        kind, *rest = results.get(timeout=120)
        got[kind] = rest
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    abandoned, drained_s, gen, params, lost = got["holder"]
    (peer_params,) = got["peer"]
    assert abandoned and drained_s < ABANDON_AFTER_S + 2.0 < COLLECTIVE_TIMEOUT_S  # not the collective timeout
    assert gen == 3 and params == peer_params  # the next generation's replica, the peer's own bytes
    assert "the updates up to 2 were not all recorded" in lost  # the abandoned copy of update 2 left nothing
