"""Worker side of a recovery: abandon the step, regroup, reconcile, hand state over, retry.

Called by the strategy when a collective fails (healthy ranks never restart), at a step boundary
when the controller published a planned generation (``reason == "planned"``: a repaired rank
rejoining), and by a replacement process when it restores (``reason == "join"``). The loop runs until this worker is
in a complete generation whose members all hold the same committed state:

1. abort the broken group (peers' pending collectives fail at once), end what techniques still run on
   its groups (a flash checkpoint's partner exchange: ``on_groups_dropped``) and report the symptom;
2. wait at the controller for the next generation that includes this worker;
3. build that generation's group (a rendezvous with a timeout);
4. reconcile: every member shares (committed steps, needs state). A member that committed one
   step fewer than the others (the failure hit while some ranks had finished the reduction) is
   a laggard; replacements are joiners. With tp*pp > 1 a laggard whose step's agreement failed after
   its DP reduction rolls the step forward first (``runner.recovery.common.roll_forward``). The lowest-ranked
   member holding the newest committed state broadcasts its full Lightning checkpoint; joiners restore
   from it, laggards adopt its model and optimizer state and skip their own update (ZeRO-1:
   ``runner.recovery.common.reconcile``). With tensor or pipeline parallelism this is done per (pp, tp) coordinate: a
   rank's state is its slice of the model, so it comes from the DP replica at the same coordinate;
5. a survivors-only generation (replacement still starting) waits for the next one.
Any failure on the way goes back to step 1; every wait is bounded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Optional

import torch

from runner.plumbing import protocol
from runner.plumbing.events import EventLog
from runner.plumbing.protocol import Layout
from runner.recovery.common.reconcile import reconcile_shards
from runner.recovery.common.roll_forward import roll_forward
from runner.training.comm import CollectiveFailure, Comm, RunFailedError, WorkerReleased
from runner.training.state import ReplicaState
from runner.training.status import WorkerStatus
from runner.training.transfer import exchange


class ReplicaRecovery:
    def __init__(self, comm: Comm, events: EventLog, status: WorkerStatus, recovery_timeout_s: float,
                 on_start: Callable[[], None] = lambda: None) -> None:
        self.comm, self.events, self.status = comm, events, status
        self.recovery_timeout_s = recovery_timeout_s
        self.on_start = on_start  # the fault injector's hook for faults that strike during a recovery
        self.on_groups_dropped: list[Callable[[], None]] = []  # techniques end their work on the dropped groups

    def __call__(self, state: ReplicaState, reason: str) -> Optional[dict]:
        joining = reason == "join"
        need_new_group = not joining
        if reason == "planned":  # the controller published a new generation; nothing failed
            self._drop_groups()
        elif not joining:
            self.abandon(state, reason)
            self.on_start()
        while True:
            try:
                if need_new_group:
                    layout = self._await_layout()
                    t0 = time.time()
                    self.comm.join(layout)
                    self._emit_once("group_formed", gen=layout.gen, members=len(layout.members),
                                    complete=layout.complete, rebuild_s=time.time() - t0, recovery=layout.recovery)
                ckpt = self._reconcile(state, joining)
                assert self.comm.layout is not None  # joined above, or joining one already
                if self.comm.layout.complete:
                    return ckpt
                need_new_group = True  # survivors-only: wait for the replacement's generation
            except CollectiveFailure as err:
                self.abandon(state, f"during recovery: {err}")
                need_new_group = True

    def _await_layout(self) -> Layout:
        """The next generation with this worker in it; a worker released in a planned hand-over says so and leaves."""
        try:
            return self.comm.await_layout(self.recovery_timeout_s, newer_than=self.comm.gen)
        except WorkerReleased as released:
            self.events.emit("worker_released", wid=self.status.wid, logical=released.record.get("logical"),
                             committed_steps=self.status.step, recovery=released.record.get("recovery"),
                             reason=str(released))
            raise

    def abandon(self, state: ReplicaState, reason: str) -> None:
        self._drop_groups()
        self.status.phase = "recovering"
        protocol.report(self.comm.store, {
            "wid": self.comm.wid, "gen": self.comm.gen, "reason": reason, "t": time.time(),
            "step": state.global_step,
        })

    def _drop_groups(self) -> None:
        """Drop this generation's groups, then end what techniques still run on them (``on_groups_dropped``),
        before the next generation's groups are built."""
        self.comm.abort()
        for end in self.on_groups_dropped:
            end()

    def _reconcile(self, state: ReplicaState, joining: bool) -> Optional[dict]:
        committed = -1 if joining else state.committed_steps()
        awaiting = not joining and state.awaiting_agreement()
        mine = torch.tensor([committed, int(joining), int(awaiting)], dtype=torch.int64, device=self.comm.device)
        table = [t.tolist() for t in self.comm.allgather(mine)]
        holders = [(c, r) for r, (c, j, _) in enumerate(table) if not j]
        if not holders:
            raise RunFailedError(f"every data-parallel replica of the model and optimizer state was lost: no member of "
                                 f"generation {self.comm.gen} holds it")
        sharded = state.sharded
        if sharded is not None:  # sharded optimizer state: laggards and joiners are served differently
            return reconcile_shards(self.comm, state, sharded, table, self.events)
        table = roll_forward(self.comm, state, table, self.events)
        # with tp*pp > 1 a member's state is its slice of the model: each (pp, tp) coordinate is served by a replica
        # at it
        slot = [self.comm.coords_of(lrank)[1:] for lrank in self.comm.joined.logical]
        newest = max(c for c, j, _ in table if not j)
        ckpt = None
        for coordinate in sorted(set(slot)):
            members = [r for r in range(len(table)) if slot[r] == coordinate]
            got = self._serve(state, joining, table, members, newest)
            ckpt = got if self.comm.rank in members else ckpt
        return ckpt

    def _serve(self, state: ReplicaState, joining: bool, table: list[list[int]], members: list[int],
               newest: int) -> Optional[dict]:
        """Hand the newest committed state to the joiners and laggards among ``members`` (group ranks holding
        one (pp, tp) coordinate), from the lowest-ranked of them that holds it; every member of the group takes
        part."""
        receivers = [r for r in members if table[r][1] or table[r][0] < newest]
        if not receivers:
            return None
        sources = [r for r in members if not table[r][1] and table[r][0] == newest]
        if not sources:
            raise RunFailedError(f"no live replica holds step {newest} of the model slice that group ranks "
                                 f"{receivers} need in generation {self.comm.gen} (a failure during the gradient "
                                 "reduction left the model-parallel slices of the model at different steps)")
        source = sources[0]
        t0 = time.time()
        me = self.comm.rank
        ckpt = exchange(self.comm, state.dump_state() if me == source else None, source, receive=me in receivers)
        if me == source:
            self.events.emit("state_sent", gen=self.comm.gen, receivers=len(receivers), step=newest)
        if me in receivers:
            self.events.emit("state_restored", gen=self.comm.gen, restore_s=time.time() - t0,
                             role="joiner" if joining else "laggard", step=newest)
            if not joining:
                state.adopt_committed_state(ckpt)
                return None
        return ckpt

    def _emit_once(self, kind: str, **details) -> None:
        if self.comm.rank == 0:
            self.events.emit(kind, **details)
