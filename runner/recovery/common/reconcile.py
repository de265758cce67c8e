"""Reconciling a generation under ZeRO-1, where no rank holds another rank's optimizer state.

Called by ``ReplicaRecovery`` once the new generation's group is formed and every member shared
its committed step count. With sharded state the replica-wide hand-over of ZeRO-0 does not work
(the source's optimizer state is only its own shard), so:

0. with tp*pp > 1, members whose step agreement failed while another member's completed roll that step
   forward (``runner.recovery.common.roll_forward``): each updates its own shard (and any it carries) with its
   own reduced gradients and the full model's norm, recording the update for the replica it holds, so that
   it then holds the newest step; step 4's sync hands its shard to everyone;
1. *laggards* (the failure hit while the others had finished the reduction of the newest step)
   receive the final gradients of that step from the source, which still has them (the others
   can only be waiting in the next step's parameter sync), and apply their own update with them:
   the very update they would have made;
2. *joiners* (spares, restarted ranks) receive their own shard: from its holder's replica
   (``ShardReplicator.replica_of``, which replays at most the updates whose copy was in flight
   when the owner died) when DeadPool replicates shards, else from the rank at the same shard index
   in another DP replica group (``Topology.replica_group_peer``), which holds the same shard; a joiner
   whose every copy is lost too has no source for it, and the run fails with that reason (a joiner whose
   rank NDB covered until now gets the shard its replica's holder carried: ``ZeroOne.carry``);
3. the shard of each rank NDB covers is carried by the holder of its replica (``_carry_covered_shards``);
4. everyone runs the parameter sync: each owner's current shard reaches every member, so members
   that were in different collectives when the fault struck (one in the sync, the others already
   in the reduction) all leave the recovery up to date, and the sync is never retried alone;
5. joiners receive the source's Lightning state (taken after the sync) with their own shard's
   optimizer state put in.

With tensor or pipeline parallelism a member's parameters, gradients and shard plan are those of its
(pp, tp) coordinate: final gradients and Lightning state come from a member at the receiver's
coordinate, and a shard from its holder, which ``Topology.replica_holder`` places at that coordinate.
"""

from __future__ import annotations

from typing import Optional

from runner.plumbing.events import EventLog
from runner.recovery.common.hooks import ABANDON_AFTER_S, ReplicaLost
from runner.recovery.common.roll_forward import roll_forward
from runner.training.comm import Comm, RunFailedError
from runner.training.shard_state import ShardState
from runner.training.state import ReplicaState, ShardedState
from runner.training.transfer import exchange


def reconcile_shards(comm: Comm, state: ReplicaState, sharded: ShardedState, table: list[list[int]],
                     events: EventLog) -> Optional[dict]:
    """``table``: every member's (committed steps, joining, awaiting agreement), in group-rank order; returns the
    Lightning state a joiner restores (None on the others)."""
    layout = comm.layout
    assert layout is not None  # reconciling happens in the generation just joined
    me, logical = comm.rank, layout.logical
    replicator = sharded.replicator
    if replicator is not None and replicator.drain():  # the broken generation's exchange, if one was in flight
        events.emit("replication_abandoned", gen=comm.gen, waited_s=ABANDON_AFTER_S)
    # after the drain: a roll-forward changes this rank's shard and the records of the replica it holds
    table = [row[:2] for row in roll_forward(comm, state, table, events)]
    newest = max(c for c, j in table if not j)
    laggards = [r for r, (c, j) in enumerate(table) if not j and c < newest]
    joiners = [r for r, (_, j) in enumerate(table) if j]
    source = _sources(comm, table, newest, laggards + joiners)
    for src, receivers in _by_source(source, laggards):
        final = exchange(comm, sharded.final_gradients() if me == src else None, src, receive=me in receivers)
        if me in receivers:
            sharded.finish_update(final)
            events.emit("shard_update_finished", gen=comm.gen, step=newest, source=logical[src])
    if not layout.complete:
        return None  # survivors only: joiners are served, and everyone synced, in the complete generation
    shard = None
    for j in joiners:
        holder, received = _fetch_shard(comm, sharded, logical[j], joiners, newest)
        if me == j:
            shard = received
            sharded.zero.load_own(shard.params)
            events.emit("shard_restored", gen=comm.gen, step=newest, holder=holder,
                        replayed_updates=shard.gen - shard.base_gen)
    _carry_covered_shards(comm, sharded, newest, events)
    sharded.zero.sync(comm)
    ckpt = None
    for src, receivers in _by_source(source, joiners):
        got = exchange(comm, state.dump_state() if me == src else None, src, receive=me in receivers)
        ckpt = got if me in receivers else ckpt
        if me == src:
            events.emit("state_sent", gen=comm.gen, receivers=len(receivers), step=newest)
    if ckpt is None:
        return None
    assert shard is not None
    sharded.adopt_shard_state(ckpt, sharded.zero.shard_state_dict(shard.params, shard.state))
    return ckpt


def _carry_covered_shards(comm: Comm, sharded: ShardedState, gen: int, events: EventLog) -> None:
    """NDB: the shard of each rank a neighbour covers is carried by the holder of its replica, which rebuilds it from
    the replica (after ``gen`` updates) the first time; a shard whose owner has a process again is no longer carried.
    Every member learns its shard group's carriers from the layout, for the all-gather. With tp*pp > 1 NDB covers
    whole replicas and each (pp, tp) coordinate carries its own: the holder at the coordinate of a covered rank (in
    the same DP group) carries that rank's shard of the coordinate's slice of the model."""
    layout, replicator, zero = comm.joined, sharded.replicator, sharded.zero
    covered = sorted(r for extra in layout.extra for r in extra)
    if covered and replicator is None:
        raise RunFailedError(f"NDB covers logical rank(s) {covered}, but nothing replicates their ZeRO-1 optimizer "
                             "shards (add deadpool to ft)")
    for lrank in covered:
        if (holder := replicator.holder(lrank)) not in layout.logical:
            raise RunFailedError(f"logical rank {lrank}'s ZeRO-1 optimizer shard was lost with its replica on logical "
                                 f"rank {holder}: no member of generation {comm.gen} can carry it")
    here = comm.coords_of(comm.logical_rank)[1:]
    covered = [r for r in covered if comm.coords_of(r)[1:] == here]  # the covered ranks of this rank's DP group
    carriers = {comm.coords_of(lrank)[0]: comm.coords_of(replicator.holder(lrank))[0] for lrank in covered}
    zero.set_carriers(carriers)
    for lrank in covered:
        shard = comm.coords_of(lrank)[0]
        if carriers[shard] != zero.rank or zero.carries(shard):
            continue
        try:
            copy = replicator.replica_of(lrank, gen)
        except ReplicaLost as err:
            raise RunFailedError(f"logical rank {lrank}'s optimizer shard cannot be rebuilt to carry: {err}") from None
        zero.carry(shard, copy.params, copy.state)
        events.emit("shard_carried", gen=comm.gen, step=gen, logical=lrank, replayed_updates=copy.gen - copy.base_gen,
                    reason="NDB covers this rank: the holder of its shard's replica updates the shard in its place")


def _sources(comm: Comm, table: list[list[int]], newest: int, receivers: list[int]) -> dict[int, int]:
    """For each group rank in ``receivers``, the group rank it takes the step's final gradients or the Lightning
    state from: the lowest-ranked member holding step ``newest`` at its (pp, tp) coordinate (with tp*pp > 1 a
    member's model and gradients are its slice; at tp = pp = 1 every member shares the one coordinate)."""
    logical = comm.joined.logical
    slot = [comm.coords_of(lrank)[1:] for lrank in logical]
    holders = [r for r, (c, j) in enumerate(table) if not j and c == newest]
    out = {}
    for r in receivers:
        at = [h for h in holders if slot[h] == slot[r]]
        if not at:
            raise RunFailedError(f"no live replica holds step {newest} of the model slice (pp, tp) = {slot[r]} that "
                                 f"logical rank {logical[r]} needs in generation {comm.gen} (a failure during the "
                                 "gradient reduction left the model-parallel slices of the model at different steps)")
        out[r] = at[0]
    return out


def _by_source(source: dict[int, int], receivers: list[int]) -> list[tuple[int, list[int]]]:
    """``receivers`` grouped by the source that serves them, sources in group-rank order (every member runs the
    same exchanges in the same order)."""
    return [(src, [r for r in receivers if source[r] == src]) for src in sorted({source[r] for r in receivers})]


def _fetch_shard(comm: Comm, sharded: ShardedState, lrank: int, joiners: list[int],
                 gen: int) -> tuple[int, ShardState]:
    """Logical rank ``lrank``'s shard after ``gen`` updates and the logical rank that held it, from its holder to
    every member (so that all of them fail alike when it cannot be had): DeadPool's replica holder, else the first
    live rank at the same shard index in the next DP replica groups."""
    assert comm.layout is not None  # fetched in the generation just joined
    members, replicator = comm.layout.logical, sharded.replicator
    if replicator is not None:
        holder = replicator.holder(lrank)
        lost = f"with its replica on logical rank {holder}"
        candidates = [holder]
    else:
        candidates = comm.topology.shard_copies(lrank) if comm.topology is not None else []
        lost = (f"with every copy of it (logical ranks {candidates}, the same shard in the other DP replica groups)"
                if candidates else "and nothing replicates it (add ft=deadpool, or parallel.dp_group_size below dp)")
    live = [c for c in candidates if c in members and members.index(c) not in joiners]
    if not live:
        raise RunFailedError(f"logical rank {lrank}'s ZeRO-1 optimizer shard was lost {lost}: no member of the new "
                             "generation holds it")
    holder, h = live[0], members.index(live[0])
    payload = None
    if comm.rank == h:
        if replicator is None:
            own = sharded.own_shard()
            payload = ShardState(gen, own["params"], own["state"], gen).to_payload()
        elif sharded.zero.carries(comm.coords_of(lrank)[0]):  # NDB covered it until now: the carried shard is current
            params, state = sharded.zero.carried_shard(comm.coords_of(lrank)[0])
            payload = ShardState(gen, params, state, gen).to_payload()
        else:
            try:
                payload = replicator.replica_of(lrank, gen).to_payload()
            except ReplicaLost as err:
                payload = {"lost": str(err)}
    payload = exchange(comm, payload, h, receive=True)
    if "lost" in payload:
        raise RunFailedError(f"logical rank {lrank}'s optimizer shard cannot be rebuilt: {payload['lost']}")
    return holder, ShardState.from_payload(payload)
