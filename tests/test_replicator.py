"""DeadPool's shard replicator on two real processes and a real gloo side group. Copy mode: a recovery does not wait
for an exchange of the broken generation that its peer will never complete. Replay mode
(``ft.deadpool.replication=replay``): after the seed no byte goes over the network between verifications, each
replica stays bit-identical to its owner's shard, and a replica corrupted on its holder is found at the next
verification and reseeded."""

from __future__ import annotations

import multiprocessing
import queue
import socket
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from runner.planning.topology import Topology
from runner.recovery.common.hooks import ABANDON_AFTER_S, ReplicaLost
from runner.recovery.deadpool.replicator import ShardReplicator
from runner.training.shard_state import DIGEST_BYTES
from runner.training.zero import ZeroOne

COLLECTIVE_TIMEOUT_S = 30.0


def _replicator(rank: int, mode: str = "copy", verify_every_n_steps: int = 50) -> ShardReplicator:
    torch.manual_seed(rank)  # each rank's parameters differ, so a replica shows whose it is
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    zero = ZeroOne(module, torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1), dp=2)
    zero.shard_for(rank)
    return ShardReplicator(zero, Topology(nodes=2, procs_per_node=1), timeout_s=COLLECTIVE_TIMEOUT_S, mode=mode,
                           verify_every_n_steps=verify_every_n_steps)


def _group(store, gen: int, rank: int) -> SimpleNamespace:
    """What ShardReplicator.start() reads of a Comm: the generation, its side group, the logical ranks, the hook
    before a payload (nothing held here)."""
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"gen{gen}/", store), rank, 2, timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return SimpleNamespace(gen=gen, side_pg=pg, logical_rank=rank, layout=SimpleNamespace(logical=[0, 1]),
                           before_side_payload=lambda: None)


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


def _two_ranks(target) -> dict:
    """Run ``target(rank, port, results)`` in two spawned processes sharing a store on a port from the OS; each puts
    (key, *values) in ``results``: {key: [values]}."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(rank, port, results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    got = {}
    while len(got) < len(procs):  # a rank that fails exits without a result: stop waiting then
        try:
            key, *rest = results.get(timeout=1)
            got[key] = rest
        except queue.Empty:
            assert all(p.is_alive() or p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


def test_a_recovery_abandons_an_exchange_its_peer_never_completes():
    got = _two_ranks(_rank_main)
    abandoned, drained_s, gen, params, lost = got["holder"]
    (peer_params,) = got["peer"]
    assert abandoned and drained_s < ABANDON_AFTER_S + 2.0 < COLLECTIVE_TIMEOUT_S  # not the collective timeout
    assert gen == 3 and params == peer_params  # the next generation's replica, the peer's own bytes
    assert "the updates up to 2 were not all recorded" in lost  # the abandoned copy of update 2 left nothing


# -- replay mode -----------------------------------------------------------------------------------------------
VERIFY_EVERY = 4
STEPS = 9  # the last one in a new group generation
CORRUPT_AFTER = 5  # rank 1 corrupts its replica of rank 0's shard after this update; the verification of 8 finds it


class CountingGroup:
    """The real side group, counting the bytes this rank sends over it."""

    def __init__(self, pg) -> None:
        self.pg, self.sent = pg, 0

    def send(self, tensors, dst, tag):
        self.sent += sum(t.numel() * t.element_size() for t in tensors)
        return self.pg.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self.pg.recv(tensors, src, tag)


def _shard_bytes(params: list[torch.Tensor], state: dict) -> list[bytes]:
    """A shard's tensors as raw bytes, parameters then each one's state in key order."""
    out = []
    for pos, p in enumerate(params):
        out.append(_raw(p.detach()))
        for _, value in sorted(state.get(pos, {}).items()):
            out.append(_raw(value) if torch.is_tensor(value) else repr(value).encode())
    return out


def _raw(t: torch.Tensor) -> bytes:
    return t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def _replay_rank_main(rank: int, port: int, results) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60))
    rep = _replicator(rank, "replay", VERIFY_EVERY)
    zero = rep.zero
    comm = _group(store, 0, rank)
    comm.side_pg = pg = CountingGroup(comm.side_pg)
    sent = []
    rep.start(comm, 0)  # the seed: a full copy each way (as a run's setup starts it)
    rep.wait()
    sent.append(pg.sent)
    for gen in range(1, STEPS + 1):
        if gen == STEPS:  # a recovery's new group generation: its first update seeds the replicas again
            comm = _group(store, 1, rank)
            comm.side_pg = pg = CountingGroup(comm.side_pg)
        before = pg.sent
        torch.manual_seed(1000 + gen)  # the full reduced gradients: the same on every rank, as after the all-reduce
        for p in zero.params:
            p.grad = torch.randn_like(p)
        rep.wait()
        rep.record(rank, gen)
        zero.optimizer.step()
        rep.start(comm, gen)
        rep.wait()
        sent.append(pg.sent - before)
        if gen == CORRUPT_AFTER and rank == 1:
            live = rep._live
            assert live is not None and live.gen == gen
            with torch.no_grad():
                live.params[0].view(-1)[0] += 1.0  # one element of the replica drifts
        if gen == STEPS - 1:  # the last update of the first generation: the replicas as replays left them
            own, replica = zero.own_optimizer_params(), rep.replica_of(1 - rank, gen)
            shards = (_shard_bytes(own, {i: zero.optimizer.state[p] for i, p in enumerate(own)}),
                      _shard_bytes(replica.params, replica.state), replica.gen - replica.base_gen)
    results.put((rank, sent, rep.drifts, *shards, rep.replica_of(1 - rank, STEPS).gen, rep.bytes_per_step))
    rep.close()


def test_replay_sends_nothing_between_verifications_and_reseeds_a_drifted_replica():
    got = _two_ranks(_replay_rank_main)
    (sent0, drifts0, own0, replica_of1, replayed1, gen0, per_step0) = got[0]
    (sent1, drifts1, own1, replica_of0, replayed0, gen1, per_step1) = got[1]
    digests = 2 * DIGEST_BYTES  # one's own shard's to the holder, one's replica's to the owner
    assert min(sent0[0], sent1[0]) > digests  # the seed: header, layout and the whole shard, each way
    for gen in range(1, STEPS):
        want1 = digests if gen % VERIFY_EVERY == 0 else 0
        assert sent1[gen] == want1, (gen, sent1)
        if gen == 8:  # rank 1's replica of rank 0's shard drifted after update 5: rank 0 copies its shard again
            assert sent0[gen] > 2 * digests, (gen, sent0)
        else:
            assert sent0[gen] == want1, (gen, sent0)
    assert drifts1 == [8] and drifts0 == []  # found by its holder at the next verification, and only there
    assert replica_of1 == own1  # replayed every update since the seed: bit-identical
    assert replica_of0 == own0  # reseeded by the copy of update 8: bit-identical again
    assert replayed0 == replayed1 == 0  # current: nothing left to replay when asked
    assert min(sent0[STEPS], sent1[STEPS]) > digests  # a new group generation: seeded again, each way
    assert gen0 == gen1 == STEPS and per_step0 == per_step1 == 0
