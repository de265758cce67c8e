"""DeadPool's update hook under ZeRO-1: every update's shard is replicated to its holder (``ShardReplicator``: the
holder replays the update onto its replica, or the owner copies the shard, ``ft.deadpool.replication``).

Before an update the previous replication must be complete and what a replay of the update needs is kept;
after it the new replication starts, and overlaps the next step. While NDB covers a failed rank nothing is replicated.
"""

from __future__ import annotations

from runner.plumbing.events import EventLog
from runner.recovery.deadpool.replicator import ShardReplicator
from runner.training.comm import CollectiveFailure, Comm, RunFailedError


class ShardReplication:
    """``runner.recovery.common.hooks.UpdateReplication`` for DeadPool."""

    def __init__(self, replicator: ShardReplicator, comm: Comm, events: EventLog) -> None:
        self.replicator, self.comm, self.events = replicator, comm, events
        self._failed_in: int | None = None  # group generation of the last failed exchange
        self._suspended_in = -1  # the last generation whose replication NDB's takeover suspended

    def start(self, gen: int) -> None:
        if not self._suspended():
            self.replicator.start(self.comm, gen)

    def record(self, gen: int) -> None:
        if not self._suspended():
            self.replicator.record(self.comm.logical_rank, gen)

    def _suspended(self) -> bool:
        """While NDB covers failed ranks, the holders of their replicas carry their shards (``ZeroOne.carry``) and
        the ring of holders has gaps: nothing is replicated until every rank has a process of its own again, and
        the controller counts no shard as having a copy (``runner.control.decision.shards_without_copy``)."""
        layout = self.comm.joined
        if not layout.takeovers:
            return False
        if self._suspended_in != layout.gen and self.comm.rank == 0:
            covered = sorted(r for extra in layout.extra for r in extra)
            self.events.emit("replication_suspended", gen=layout.gen, covered=covered, reason=(
                f"NDB covers logical rank(s) {covered}, whose shards the holders of their replicas carry: no ZeRO-1 "
                "shard has a copy until they have processes again, so a further failure cannot be recovered from a "
                "replica"))
        self._suspended_in = layout.gen
        return True

    def wait_previous(self) -> None:
        """The previous exchange must be complete before the shard changes again. A failed one is logged
        only: the main group's next collective meets the same fault, and recovery starts there, at a
        point where every rank agrees on the step. A second failure in a row in the same group
        generation is no peer's fault (every collective between them succeeded): the run fails, as
        its shards would go on without a replica."""
        try:
            self.replicator.wait()
        except CollectiveFailure as err:
            self.events.emit("replication_failed", gen=self.comm.gen, error=str(err))
            if self._failed_in == self.comm.gen:
                raise RunFailedError(
                    f"the replication of logical rank {self.comm.logical_rank}'s ZeRO-1 optimizer shard to its "
                    f"neighbour failed twice in a row while every rank was alive ({err}); its replica would stay "
                    "stale and a node loss could not be recovered from it. This is not a peer failure: check the "
                    "side group's network (the same interface as the main group's) and the worker's events.jsonl, "
                    "or run without ft=deadpool's ZeRO-1 replication (parallel.zero=0) until it is fixed.") from None
            self._failed_in = self.comm.gen
        else:
            self._failed_in = None
            self._report_drifts()

    def _report_drifts(self) -> None:
        """Replay: each replica this rank held that differed from its owner's shard at a verification (and was
        reseeded by a full copy)."""
        replicator = self.replicator
        for step in replicator.drifts:
            self.events.emit("replica_drift", gen=self.comm.gen, step=step,
                             owner=replicator.partner(self.comm.logical_rank), holder=self.comm.logical_rank,
                             reason="the replica kept by replaying its owner's updates differed from the owner's shard "
                                    "at a verification; reseeded with a full copy")
        replicator.drifts.clear()

    def close(self) -> None:
        self.replicator.close()
