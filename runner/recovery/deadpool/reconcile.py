"""Reconciling a generation under ZeRO-1, where no rank holds another rank's optimizer state.

Called by ``ReplicaRecovery`` once the new generation's group is formed and every member shared
its committed step count. With sharded state the replica-wide hand-over of ZeRO-0 does not work
(the source's optimizer state is only its own shard), so:

1. *laggards* (the failure hit while the others had finished the reduction of the newest step)
   receive the final gradients of that step from the source, which still has them (the others
   can only be waiting in the next step's parameter sync), and apply their own update with them:
   the very update they would have made;
2. *joiners* (spares, restarted ranks) receive their own shard from its holder's replica
   (``ShardReplicator.replica_of``, which replays at most the updates whose copy was in flight
   when the owner died); a joiner whose holder is lost too has no source for it, and the run fails
   with that reason;
3. everyone runs the parameter sync: each owner's current shard reaches every member, so members
   that were in different collectives when the fault struck (one in the sync, the others already
   in the reduction) all leave the recovery up to date, and the sync is never retried alone;
4. joiners receive the source's Lightning state (taken after the sync) with their own shard's
   optimizer state put in.
"""

from __future__ import annotations

from typing import Optional

from runner.comm import Comm, RunFailedError
from runner.events import EventLog
from runner.recovery.deadpool.replicator import ABANDON_AFTER_S, ReplicaLost, ShardReplicator
from runner.recovery.deadpool.shard_state import ShardState
from runner.training.state import ReplicaState, ShardedState
from runner.training.transfer import exchange


def reconcile_shards(comm: Comm, state: ReplicaState, sharded: ShardedState, table: list[list[int]],
                     events: EventLog) -> Optional[dict]:
    layout = comm.layout
    assert layout is not None  # reconciling happens in the generation just joined
    me, logical = comm.rank, layout.logical
    holders = [(c, r) for r, (c, j) in enumerate(table) if not j]
    newest = max(c for c, _ in holders)
    source = min(r for c, r in holders if c == newest)
    laggards = [r for r, (c, j) in enumerate(table) if not j and c < newest]
    joiners = [r for r, (_, j) in enumerate(table) if j]
    replicator = sharded.replicator
    if replicator is not None and replicator.drain():  # the broken generation's exchange, if one was in flight
        events.emit("replication_abandoned", gen=comm.gen, waited_s=ABANDON_AFTER_S)
    if laggards:
        final = exchange(comm, sharded.final_gradients() if me == source else None, source, receive=me in laggards)
        if me in laggards:
            sharded.finish_update(final)
            events.emit("shard_update_finished", gen=comm.gen, step=newest, source=logical[source])
    if not layout.complete:
        return None  # survivors only: joiners are served, and everyone synced, in the complete generation
    shard = None
    for j in joiners:
        received = _fetch_shard(comm, replicator, logical[j], joiners, newest)
        if me == j:
            shard = received
            sharded.zero.load_own(shard.params)
            events.emit("shard_restored", gen=comm.gen, step=newest, holder=replicator.holder(logical[j]),
                        replayed_updates=shard.gen - shard.base_gen)
    sharded.zero.sync(comm)
    if not joiners:
        return None
    ckpt = exchange(comm, state.dump_state() if me == source else None, source, receive=me in joiners)
    if me not in joiners:
        return None
    assert shard is not None
    sharded.adopt_shard_state(ckpt, shard.state)
    return ckpt


def _fetch_shard(comm: Comm, replicator: ShardReplicator | None, lrank: int, joiners: list[int],
                 gen: int) -> ShardState:
    """Logical rank ``lrank``'s shard after ``gen`` updates, from its holder to every member (so that all
    of them fail alike when it cannot be had)."""
    holder = replicator.holder(lrank) if replicator is not None else None
    assert comm.layout is not None  # fetched in the generation just joined
    h = comm.layout.logical.index(holder) if holder is not None else None
    if h is None or h in joiners:
        lost = (f"with its replica on logical rank {holder}" if holder is not None
                else "and nothing replicates it (add ft=deadpool)")
        raise RunFailedError(f"logical rank {lrank}'s ZeRO-1 optimizer shard was lost {lost}: no member of the new "
                             "generation holds it")
    payload = None
    if comm.rank == h:
        assert replicator is not None  # h is set only when a replicator names the holder
        try:
            payload = replicator.replica_of(lrank, gen).to_payload()
        except ReplicaLost as err:
            payload = {"lost": str(err)}
    payload = exchange(comm, payload, h, receive=True)
    if "lost" in payload:
        raise RunFailedError(f"logical rank {lrank}'s optimizer shard cannot be rebuilt: {payload['lost']}")
    return ShardState.from_payload(payload)
