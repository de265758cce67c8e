"""A worker's rebuildable communicator: its process group, generation and logical rank.

The group is a ``ProcessGroupGloo``/``ProcessGroupNCCL`` created directly over a ``PrefixStore``
named after the generation, so a new group can be built inside a live process (no
``init_process_group``, no restart). On a failure the group is aborted, which makes every peer's
pending collective fail at once instead of waiting for a timeout.

With tensor or pipeline parallelism (``Topology.tp`` or ``pp`` > 1) every complete generation also builds,
over the same store, this rank's DP group (the ranks holding the same slice of the model in every replica:
its gradient all-reduce), its TP group (the ranks holding the other slices of its layers) with tp > 1, and
its PP group (the stages of its replica at its TP slot, point to point) with pp > 1. With DP replica groups
(``Topology.dp_group_size`` below dp) it also builds its shard group: the members of its DP group in its replica
group, over which ZeRO-1's shards are all-gathered. They are rebuilt and dropped with the world group, so a
replacement rank joins them like any other member.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from runner.planning.topology import Topology
from runner.plumbing import protocol, store_counts
from runner.plumbing.gloo_rendezvous import BatchedAddressStore
from runner.plumbing.protocol import Layout

_CUT_OFF_POLL = timedelta(seconds=0.1)  # how often a long wait asks whether its peers were cut off
_WAIT_MARGIN = timedelta(seconds=5)  # a launched op fails by itself at the collective timeout; waits allow this more
_FENCE_WAIT_S = 2.0  # how long given-up work may take to fail once its connections are closed
EXIT_UNFENCED = 5  # a worker's exit: work of a dropped generation it gave up on would not end (``Comm._fence``)


class CollectiveFailure(RuntimeError):
    """A collective failed (peer died, connection reset, timeout, injected error)."""


class RunAborted(RuntimeError):
    """The controller ended the run, or no usable generation came in time."""


class WorkerReleased(RuntimeError):
    """The controller released this worker in a planned hand-over: its ranks train elsewhere from the next
    generation on, and it ends cleanly (``protocol.released_key``)."""

    def __init__(self, record: dict) -> None:
        super().__init__(record.get("reason", "released"))
        self.record = record


class RunFailedError(RuntimeError):
    """Recovery cannot succeed; the worker reports it and the run ends 'failed'."""


class Comm:
    def __init__(self, store: TCPStore, wid: int, backend: str, device: torch.device, timeouts,
                 topology: Topology | None = None) -> None:
        self.store, self.wid, self.backend, self.device = store, wid, backend, device
        self.topology = topology  # the (dp, pp, tp) layout of logical ranks; None: data parallel only
        self.collective_timeout = timedelta(seconds=timeouts.collective_timeout_s)
        self.rendezvous_timeout_s = timeouts.rendezvous_timeout_s
        self.recovery_timeout_s = timeouts.recovery_timeout_s
        self.pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL | None = None  # a backend built directly, no wrapper
        self.want_side_group = False  # DeadPool's shard replication: a second, gloo-only group per generation
        self.side_pg: dist.ProcessGroupGloo | None = None
        self.tp_pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL | None = None  # tp > 1: this rank's TP group
        self.pp_pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL | None = None  # pp > 1: this rank's PP group
        self.dp_pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL | None = None  # tp*pp > 1: this rank's DP group
        self.shard_pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL | None = None  # replica groups: its shard group
        self.layout: Layout | None = None
        self._in_flight: list = []  # work objects of launched collectives not waited for yet
        self._sends: list = []  # work objects of launched pipeline sends not waited for yet
        self._failure: str | None = None  # why a launch failed, raised by the next wait_all
        self._stuck: list = []  # gloo work given up on (a peer cut off): fenced by the next abort
        self.stranded = 0  # given-up work the fence left waiting on closed connections (``_fence``)
        self._sockets = store_counts.SocketsOpened()  # the generation's connections, when counting is on
        # NCCL's abort() ends in-flight work itself, and its waits are not sliced
        self._cut_off_check = None if backend == "nccl" else self._cut_off

    # -- membership -----------------------------------------------------------------------------
    @property
    def gen(self) -> int:
        return self.layout.gen if self.layout else -1

    @property
    def rank(self) -> int:
        return self.joined.pg_rank(self.wid)

    @property
    def size(self) -> int:
        return len(self.joined.members)

    @property
    def logical_rank(self) -> int:
        return self.joined.logical[self.rank]

    @property
    def tp(self) -> int:
        """Ranks per model replica (the tensor-parallel degree; 1 without a topology)."""
        return self.topology.tp if self.topology is not None else 1

    @property
    def pp(self) -> int:
        """Pipeline stages per model replica (1 without a topology)."""
        return self.topology.pp if self.topology is not None else 1

    @property
    def replica_size(self) -> int:
        """Ranks per model replica (tp * pp): above 1, each rank holds a slice of the model."""
        return self.tp * self.pp

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: the logical ranks over the ranks per replica."""
        return self.joined.dp // self.replica_size

    @property
    def live_replicas(self) -> int:
        """DP replicas with processes of their own in this generation: ``dp_size`` less those a neighbour replica
        computes (NDB), which have no member."""
        return self.size // self.replica_size

    @property
    def covered_replicas(self) -> int:
        """DP replicas a neighbour replica computes besides its own (NDB): each of their ranks is taken over by
        the rank at its (pp, tp) coordinate, so a replica counts ``replica_size`` takeovers."""
        return self.joined.takeovers // self.replica_size

    @property
    def dp_rank(self) -> int:
        """This rank's model replica (its DP coordinate): which data it reads and where it is counted."""
        return self.coords_of(self.logical_rank)[0]

    @property
    def replica_groups(self) -> int:
        """DP replica groups (``Topology.replica_groups``): each holds every ZeRO-1 shard once; 1 without a topology."""
        return self.topology.replica_groups if self.topology is not None else 1

    @property
    def shard_size(self) -> int:
        """ZeRO-1 shards per copy of the optimizer state: the DP replicas of one replica group."""
        return self.dp_size // self.replica_groups

    @property
    def shard_rank(self) -> int:
        """Which ZeRO-1 shard this rank holds: its DP coordinate within its replica group."""
        return self.dp_rank % self.shard_size

    @property
    def tp_rank(self) -> int:
        """This rank's slice of the layers (its TP coordinate)."""
        return self.coords_of(self.logical_rank)[2]

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (its PP coordinate)."""
        return self.coords_of(self.logical_rank)[1]

    def coords_of(self, logical_rank: int) -> tuple[int, int, int]:
        """The (dp, pp, tp) coordinate of ``logical_rank``; (rank, 0, 0) without a topology."""
        return self.topology.coords(logical_rank) if self.topology is not None else (logical_rank, 0, 0)

    @property
    def joined(self) -> Layout:
        """The generation this worker joined: its ranks and sizes are only asked for after ``join``."""
        assert self.layout is not None, "no generation joined yet"
        return self.layout

    def await_layout(self, timeout_s: float, *, newer_than: int) -> Layout:
        """Block until the controller publishes a generation newer than ``newer_than`` with this worker in it."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if self.store.check(["abort"]):
                raise RunAborted(self.store.get("abort").decode())
            if remaining <= 0:
                raise RunAborted(f"no new generation after gen {newer_than} within {timeout_s:.0f}s")
            try:
                self.store.wait([f"gen/{newer_than + 1}"], timedelta(seconds=min(remaining, 1.0)))
            except Exception:  # the 1 s slice expired: look at 'abort' again
                continue
            layout = protocol.latest_layout(self.store, at_least=newer_than + 1)
            if self.wid in layout.members:
                return layout
            if self.store.check([protocol.released_key(self.wid)]):  # written before the generation without it
                raise WorkerReleased(protocol.get_json(self.store, protocol.released_key(self.wid)))
            newer_than = layout.gen

    def join(self, layout: Layout, timeout_s: float | None = None) -> None:
        """Build this generation's process group (a rendezvous of all its members)."""
        self.abort()
        self.layout = layout
        prefix = PrefixStore(f"pg/{layout.gen}/", self.store)
        wait = timedelta(seconds=timeout_s or self.rendezvous_timeout_s)
        self._arrive(prefix, wait)
        self._sockets = store_counts.SocketsOpened()  # from here on: the generation's connections
        try:
            self.pg = self._backend_group(prefix, self.rank, self.size, wait)
            if self.want_side_group:  # host-memory traffic beside the main group, never queued behind it
                side = PrefixStore(f"pg/{layout.gen}/side/", self.store)
                self._arrive(side, wait)
                self.side_pg = _gloo_group(side, self.rank, self.size, wait, self.collective_timeout)
            if self.replica_size > 1 and layout.complete:  # a survivors-only generation trains nothing: no subgroups
                self.tp_pg = self._subgroup("tp", wait) if self.tp > 1 else None
                self.pp_pg = self._subgroup("pp", wait) if self.pp > 1 else None
                self.dp_pg = self._subgroup("dp", wait)
            if self.replica_groups > 1 and layout.complete:
                self.shard_pg = self._subgroup("shard", wait)
            self._sockets.record()
        except Exception as err:  # a member died during the rendezvous
            for group in (self.pg, self.side_pg, self.tp_pg, self.pp_pg, self.dp_pg, self.shard_pg):
                _close_connections(group)
            self.pg = self.side_pg = self.tp_pg = self.pp_pg = self.dp_pg = self.shard_pg = None
            raise CollectiveFailure(f"rendezvous of gen {layout.gen} failed: {err}") from err

    def _subgroup(self, dim: str, wait: timedelta):
        """This rank's ``dim`` group ("tp", "pp", "dp" or "shard") of the generation: the logical ranks ``Topology``
        lists for it, ranked by that coordinate (a shard group by shard index), over a store prefix of its own."""
        assert self.topology is not None
        lists = {"tp": self.topology.tp_group, "pp": self.topology.pp_group, "dp": self.topology.dp_group,
                 "shard": self.topology.shard_group}
        ranks = self._live(lists[dim](self.logical_rank))
        prefix = PrefixStore(f"pg/{self.joined.gen}/{dim}/{ranks[0]}/", self.store)
        rank, size = ranks.index(self.logical_rank), len(ranks)
        self._arrive(prefix, wait, rank, size)
        return self._backend_group(prefix, rank, size, wait)

    def _live(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` that are members of the generation: a replica NDB took over has no member, so its DP
        group is the live replicas (a live one is complete), in the same order."""
        return [r for r in ranks if r in self.joined.logical]

    def _backend_group(self, prefix: PrefixStore, rank: int, size: int, wait: timedelta):
        """The run's backend over ``prefix``: NCCL with the collective timeout, or gloo."""
        if self.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.collective_timeout
            return dist.ProcessGroupNCCL(prefix, rank, size, opts)
        return _gloo_group(prefix, rank, size, wait, self.collective_timeout)

    def _arrive(self, prefix: PrefixStore, wait: timedelta, rank: int | None = None, size: int | None = None) -> None:
        """Wait in the store until every member arrived, so the group's constructor never blocks.

        The constructor holds the GIL while it waits for peers, which would silence this process's
        heartbeat thread; the store's wait releases it. ``rank`` and ``size``: in a subgroup (default: the world).
        """
        prefix.set(f"arrived/{self.rank if rank is None else rank}", "1")
        keys = [f"arrived/{r}" for r in range(self.size if size is None else size)]
        deadline = time.monotonic() + wait.total_seconds()
        while True:  # in slices, so that a generation the controller already replaced is given up at once
            try:
                prefix.wait(keys, timedelta(seconds=max(0.01, min(0.5, deadline - time.monotonic()))))
                return
            except Exception:
                pass
            if self.store.check(["abort"]):  # the run ended (a repaired rank published to rejoin as it completed)
                raise RunAborted(self.store.get("abort").decode())
            gen = self.joined.gen
            if self.store.check([f"gen/{gen + 1}"]):
                raise CollectiveFailure(f"gen {gen} was replaced before every member arrived")
            if time.monotonic() >= deadline:
                raise CollectiveFailure(f"gen {gen}: not every member arrived within {wait.total_seconds():.0f}s")

    def before_side_payload(self) -> None:
        """A sender on the side group calls this before a message that carries its payload (a shard's bytes, not a
        bare header): nothing happens here; a fault injector holds one such message there
        (``runner.faults.comm_faults``), so that a kill lands while a copy is in flight."""

    def abort(self) -> None:
        """Drop this process's groups: their connections close first, so peers' pending collectives fail within
        milliseconds and no gloo destructor waits on a socket (``GlooGroup.close_connections``), on a thread of
        their own while this one goes on to the next generation (``_close_and_drop``). The side group
        is only let go of: an exchange still in flight on it ends with its peers, and the group closes its
        connections when its last holder lets go (``GlooGroup.__del__``). A generation with work given up on
        is fenced first (``_fence``)."""
        if self.backend != "nccl":  # NCCL's abort() ends in-flight work itself
            self._drain()  # gloo: nothing may be in flight when the group goes (see the collectives below)
        self._in_flight, self._sends, self._failure = [], [], None
        groups = [self.pg, self.tp_pg, self.pp_pg, self.dp_pg, self.shard_pg]
        side, self.side_pg = self.side_pg, None
        self.pg = self.tp_pg = self.pp_pg = self.dp_pg = self.shard_pg = None
        if self.backend == "nccl":
            for group in groups:
                if group is not None:
                    group.abort()  # NCCL: abort the communicator instead of waiting for its timeout
        groups[:] = [group for group in groups if group is not None]  # the list's holder is the only one left
        if self._stuck:
            self._fence(groups + [side])
        del side
        if groups:
            _close_and_drop(groups)

    def _fence(self, groups: list) -> None:
        """Nothing of a generation whose work was given up on (a peer cut off) may reach this process again:
        kept open, its connections would resume when a partition heals, and the stuck collective would write its
        peers' late data into tensors the next generation uses (a gradient bucket, a parameter). Every one of
        its groups, the side group included, is closed now, on this thread: a closed pair fails the work posted
        on it, and the work is waited for (``_FENCE_WAIT_S``) before anything else runs.

        Work can outlast that wait on a closed connection: gloo fails a closed pair's posted receives, but not
        the one whose message it was reading when the connection closed, which waits out its own timeout
        (docs/recovery.md, "Fencing a dropped generation"). Such work is left to end by itself (``stranded``)
        once every peer the groups received from refuses a new receive, so nothing can reach it. A worker whose
        given-up work still runs while a connection it used still takes a receive cannot keep its memory out of
        the old generation's reach: it stops at once (``EXIT_UNFENCED``, no report, no destructor), and the
        controller replaces it as after a crash."""
        stuck, self._stuck = self._stuck, []
        for group in groups:
            _close_connections(group)
        deadline = time.monotonic() + _FENCE_WAIT_S
        while not all(w.is_completed() for w in stuck) and time.monotonic() < deadline:
            time.sleep(0.001)
        running = sum(not w.is_completed() for w in stuck)
        if running and not all(_connections_closed(group) for group in groups):
            print(f"worker {self.wid}: {running} collective(s) of gen {self.gen}, given up on, still ran "
                  f"{_FENCE_WAIT_S:.0f}s after their connections were closed, and a connection still takes a "
                  "receive: stopping, as they could still write into this worker's tensors", file=sys.stderr,
                  flush=True)
            os._exit(EXIT_UNFENCED)
        if running:
            self.stranded += running
            print(f"worker {self.wid}: {running} collective(s) of gen {self.gen}, given up on, wait on closed "
                  "connections (a message cut off midway): nothing can reach them, they end at their own timeout",
                  file=sys.stderr, flush=True)

    # -- collectives: every failure surfaces as CollectiveFailure -------------------------------
    # Collectives are launched, then waited for together. After an error every launched one is
    # waited for (it completes, or fails once its peers drop their groups, or at the collective
    # timeout) before the group is dropped: gloo's destructor waits for the work queued on it.
    # Dropping a group closes its connections first (``GlooGroup.close_connections``), which is what makes
    # peers fail at once (gloo's abort()/shutdown() leave the sockets open); no frame may keep a reference
    # to the group or its work objects once a collective failed, so that the group goes with the generation.
    def launch(self, op) -> None:
        """Start ``op(pg)`` without waiting for it. A failure to start (and every launch after it,
        which is skipped) is raised by the next ``wait_all``, never here: this runs inside backward."""
        if self._failure is not None:
            return
        if self.pg is None:
            self._failure = "no process group (aborted)"
            return
        try:
            self._in_flight.append(op(self.pg))
        except Exception as err:
            self._failure = _first_line(err)

    def launch_reduction(self, op) -> None:
        """``launch`` on the group that reduces gradients: this rank's DP group with tp*pp > 1, else the world."""
        self.launch(lambda pg: op(self._reduction_pg(pg)))

    def _reduction_pg(self, world):
        return world if self.dp_pg is None else self.dp_pg

    def subgroup_collective(self, dim: str, op) -> None:
        """Run ``op(group)`` on this rank's ``dim`` group ("tp" or "pp": a TP layer's all-reduce or all-gather, a
        pipeline receive) and wait for it alone, not for the reduction's buckets or the sends in flight beside
        it; a failure drops every group and raises. On the PP group the wait is whole, never in slices: a gloo
        send or receive whose wait times out closes every connection of its group."""
        self._raise_on(self._subgroup_wait(dim, op))

    def launch_send(self, op) -> None:
        """Start ``op(pp group)`` (a pipeline send) without waiting for it; the next ``wait_all`` waits for it
        (whole, as a receive). A failure to start is raised by that ``wait_all``, as ``launch``'s."""
        if self._failure is not None:
            return
        try:
            self._sends.append(op(self._dim_pg("pp")))
        except Exception as err:
            self._failure = _first_line(err)

    def _dim_pg(self, dim: str):
        group = {"tp": self.tp_pg, "pp": self.pp_pg}[dim]
        if group is None:
            raise RuntimeError(f"no {dim} group (aborted)")
        return group

    def _subgroup_wait(self, dim: str, op) -> str | None:
        """A function of its own so that no frame holds on to the group or its work once it returns."""
        if self._failure is not None:
            return self._failure
        try:
            work = op(self._dim_pg(dim))
        except Exception as err:
            return _first_line(err)
        cut_off = None if dim == "pp" else self._cut_off_check
        failure = _wait_each([work], self.collective_timeout + _WAIT_MARGIN, cut_off)
        if not work.is_completed():
            self._stuck.append(work)
        return failure

    def wait_all(self) -> None:
        """Wait for every launched collective; on any failure drop the group and raise."""
        self._raise_on(self._drain())

    def wait_reduction(self) -> None:
        """``wait_all`` for the step's gradient all-reduce: an entry point of its own, so that a wrapper
        can tell the reduction apart from every other collective."""
        self.wait_all()

    def _raise_on(self, failure: str | None) -> None:
        if failure is not None:
            self.abort()
            raise CollectiveFailure(failure)
        self._sockets.record()  # a lazily connected group connects a pair when a collective first uses it

    def _drain(self) -> str | None:
        """Wait for every launched collective, failed or not; the reason of the first failure."""
        failed = _wait_each(self._in_flight, self.collective_timeout + _WAIT_MARGIN, self._cut_off_check)
        sent = _wait_each(self._sends, self.collective_timeout + _WAIT_MARGIN, None)
        failure = self._failure or failed or sent
        # a send given up on reads this worker's tensors but never writes them: only receiving work is fenced
        self._stuck += [w for w in self._in_flight if not w.is_completed()]
        self._in_flight, self._sends, self._failure = [], [], None
        return failure

    def _cut_off(self) -> str | None:
        """Why this generation's collectives are given up on: the controller found members of it cut off
        silently (``protocol.cut_off_key``), or already announced the next generation. A silent peer
        neither answers nor closes its connections, and gloo's own abort() leaves a pending collective
        waiting to the timeout; a peer that dropped its group closes only the connections it opened,
        which with lazily connected groups need not include this rank's."""
        gen = self.gen
        if self.store.check([protocol.cut_off_key(gen)]):
            return f"gen {gen}: {self.store.get(protocol.cut_off_key(gen)).decode()}"
        if self.store.check([f"gen/{gen + 1}"]):
            return f"gen {gen} was replaced while this collective waited"
        return None

    def _run(self, ops) -> None:
        for op in ops:
            self.launch(op)
        self.wait_all()

    def allreduce(self, tensors: list[torch.Tensor], op=dist.ReduceOp.SUM) -> None:
        opts = _opts(op)
        self._run([lambda pg, t=t: pg.allreduce([t], opts) for t in tensors])

    def agree(self, tensors: list[torch.Tensor]) -> None:
        """A step's agreement (tp*pp > 1): the all-reduce over the world group that follows the DP reductions."""
        self.allreduce(tensors)

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self._run([lambda pg: pg.allgather([out], [tensor])])
        return out

    def allgather_replicas(self, tensor: torch.Tensor) -> dict[int, torch.Tensor]:
        """Every live model replica's ``tensor`` by DP coordinate (ZeRO-1's shards): over the DP group with tp*pp > 1,
        whose members are the live replicas in DP order (a replica NDB took over has none), else over the world, each
        member's by its logical rank."""
        if self.dp_pg is None:
            return {self.joined.logical[r]: t for r, t in enumerate(self.allgather(tensor))}
        assert self.topology is not None
        replicas = [self.coords_of(r)[0] for r in self._live(self.topology.dp_group(self.logical_rank))]
        out = [torch.empty_like(tensor) for _ in replicas]
        self._run([lambda pg: self._reduction_pg(pg).allgather([out], [tensor])])
        return dict(zip(replicas, out))

    def allgather_shards(self, tensor: torch.Tensor) -> dict[int, torch.Tensor]:
        """Every ZeRO-1 shard's ``tensor`` by shard index: over the shard group with DP replica groups, whose group
        rank is the shard index, else ``allgather_replicas`` (each DP coordinate holds its own shard)."""
        if self.replica_groups == 1:
            return self.allgather_replicas(tensor)
        out = [torch.empty_like(tensor) for _ in range(self.shard_size)]
        self._run([lambda pg: self._shard_pg().allgather([out], [tensor])])
        return dict(enumerate(out))

    def _shard_pg(self):
        if self.shard_pg is None:
            raise RuntimeError("no shard group (aborted)")
        return self.shard_pg

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._run([lambda pg: pg.broadcast([tensor], opts)])

    def broadcast_replicas(self, tensor: torch.Tensor) -> None:
        """From the first replica to the others: over the DP group with tp*pp > 1 (every rank holds its own
        slice), else from rank 0 to the world."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._run([lambda pg: self._reduction_pg(pg).broadcast([tensor], opts)])

    def barrier(self) -> None:
        self.allreduce([torch.zeros(1, device=self.device)])


def _wait_each(works: list, bound: timedelta, cut_off: Callable[[], str | None] | None) -> str | None:
    """Wait for every work object (each at most ``bound``), the first error message, if any; once
    ``cut_off`` (asked every ``_CUT_OFF_POLL`` of a wait, when given) gives a reason, stop waiting and return it.
    A function of its own so that no frame holds on to a work object after it returns."""
    failure = None
    for work in works:
        failure = failure or _wait_one(work, bound, cut_off)
    return failure


def _wait_one(work, bound: timedelta, cut_off: Callable[[], str | None] | None) -> str | None:
    if cut_off is None:
        try:
            work.wait(bound)
            return None
        except Exception as err:
            return _first_line(err)
    deadline = time.monotonic() + bound.total_seconds()
    while True:
        try:
            # at least 1 ms: gloo rounds a wait to whole milliseconds and reads 0 as "the group's own timeout"
            work.wait(min(_CUT_OFF_POLL, timedelta(seconds=max(0.001, deadline - time.monotonic()))))
            return None
        except Exception as err:
            if work.is_completed():  # it ended as the slice ran out: its own outcome, not the slice's timeout
                return _outcome(work)
            if time.monotonic() >= deadline:
                return _first_line(err)
            reason = cut_off()
            if reason is not None:
                return reason


def _outcome(work) -> str | None:
    """A completed work object's error message, or None when it succeeded (waiting returns at once)."""
    try:
        work.wait()
        return None
    except Exception as err:
        return _first_line(err)


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _opts(op) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return opts


class GlooGroup(dist.ProcessGroupGloo):
    """A gloo group whose pairs connect on first use: a ring collective connects
    each member to its two neighbours, a send or receive the one peer, so a generation's groups open O(1)
    connections per member, O(N) in all, where a full mesh opens N - 1 per member. It holds the store its
    rendezvous reads through (``BatchedAddressStore``): gloo reads a peer's address from it when it first talks to
    that peer, long after the constructor returned.

    Drop it only after ``close_connections``: a lazily connected group's destructor stops its event loop before
    it closes its pairs, and a socket still holding bytes for a receive whose buffer is gone (a collective that
    failed while a peer still sent) keeps that loop busy forever (docs/recovery.md, "Lazy gloo groups"). Closing
    needs a pair that is connected already (a first use of a pair waits until the peer uses it too, up to the
    rendezvous timeout), so the group records, per gloo context, the peers its calls used (``peers``)."""

    def __init__(self, store: BatchedAddressStore, rank: int, size: int, opts) -> None:
        super().__init__(store, rank, size, opts)
        self.address_store = store
        self.devices = len(opts._devices)  # a gloo context each; a send or receive runs on context ``tag % devices``
        self.peers: list[dict[int, None]] = [{} for _ in range(self.devices)]  # per context, in order of first use
        self.closed: list[dict[int, None]] = [{} for _ in range(self.devices)]  # the peers closed so far, per context
        self._ring = ((rank + 1) % size, (rank - 1) % size)  # the neighbours gloo's ring collectives use
        self._ring_recorded: set[int] = set()  # contexts it is recorded on: once, not at every collective of a step
        self._collectives = 0  # gloo tags each collective with this count and runs it on context ``tag % devices``

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int):
        work = super().send(tensors, dst, tag)  # type: ignore[misc]  # the stubs declare no send, recv, allreduce...
        self.peers[tag % self.devices][dst] = None
        return work

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int):
        work = super().recv(tensors, src, tag)  # type: ignore[misc]
        self.peers[tag % self.devices][src] = None
        return work

    def allreduce(self, *args, **kwargs):
        return self._ring_used(super().allreduce(*args, **kwargs))  # type: ignore[misc]

    def allgather(self, *args, **kwargs):
        return self._ring_used(super().allgather(*args, **kwargs))  # type: ignore[misc]

    def _ring_used(self, work):
        context = self._next_context()
        if context not in self._ring_recorded:
            self._used(context, *self._ring)
            self._ring_recorded.add(context)
        return work

    def broadcast(self, tensors: list[torch.Tensor], opts=None):
        opts = dist.BroadcastOptions() if opts is None else opts
        work = super().broadcast(tensors, opts)  # type: ignore[misc]
        # gloo's binomial tree, over ranks relative to the root: a member receives from its relative rank with the
        # top bit cleared; the root sends to the next rank first
        size, root = self.size(), opts.rootRank
        relative = (self.rank() - root) % size
        parent = relative ^ (1 << (relative.bit_length() - 1)) if relative else 1
        self._used(self._next_context(), (parent + root) % size)
        return work

    def _next_context(self) -> int:
        """The context of the collective just started: every collective (all go through the three methods above)
        takes the next of the group's tags, and runs on context ``tag % devices`` (torch's ``nextTag`` and
        ``getContext``)."""
        context = self._collectives % self.devices
        self._collectives += 1
        return context

    def _used(self, context: int, *peers: int) -> None:
        self.peers[context].update(dict.fromkeys(p for p in peers if p != self.rank()))

    def __del__(self) -> None:
        """Whoever lets go of the group last (the side group's: an exchange's thread) closes it first."""
        if hasattr(self, "peers"):  # not set when the constructor failed
            self.close_connections()

    def close_connections(self) -> None:
        """Close every connection of the group at once, so that its destructor finds no socket in its event loop
        and every peer's pending collective fails. A receive whose wait times out makes gloo close every pair of
        its context (``tcp::Context::signalException``): one is posted per context, on the pair of a peer that
        context already used (``peers``), and waited for 1 ms. A pair that already failed refuses the receive;
        then the next peer's is tried. A context that never used a pair has nothing to close, and must not start
        a connection here: a pair's first use waits until the peer uses it too, up to the rendezvous timeout
        (a side group's receive from a ring neighbour it never talked to stalled every recovery that way)."""
        for context, peers in enumerate(self.peers):
            for src in list(peers):  # a copy: an exchange's thread may still add to it
                if _timed_out_receive(self, src, self._closing_tag(context)):
                    break
        self.closed = [{**closed, **peers} for closed, peers in zip(self.closed, self.peers)]
        self.peers = [{} for _ in self.peers]  # closed: nothing left to close when the group goes
        self._ring_recorded = set()

    def connections_closed(self) -> bool:
        """Whether every peer the group's calls used (closed before or recorded since) refuses a receive now: its
        connection is closed, so nothing it sends reaches this process. A peer that takes one has its context
        closed by that receive (as in ``close_connections``), and the answer is False: it was open."""
        for context, (closed, peers) in enumerate(zip(self.closed, self.peers)):
            for src in {**closed, **peers}:
                if _timed_out_receive(self, src, self._closing_tag(context)):
                    return False
        return True

    def _closing_tag(self, context: int) -> int:
        return _CLOSING_TAG - (_CLOSING_TAG - context) % self.devices  # the largest tag on this context


_CLOSING_TAG = 2**31 - 1  # no message is ever sent with it (or the tags just below it, one per context)


def _timed_out_receive(group: GlooGroup, src: int, tag: int) -> bool:
    """Post a receive from ``src`` that nothing will match and let its wait time out after 1 ms; False when the pair
    refuses it (it failed before). A function of its own so that no frame holds on to the work once it returns."""
    try:
        work = group.recv([torch.zeros(1)], src, tag)
    except Exception:
        return False
    try:
        work.wait(timedelta(milliseconds=1))
    except Exception:
        pass  # the expected timeout: every pair of the context is closed
    return True


def _close_connections(group) -> None:
    """``GlooGroup.close_connections`` for a gloo group; nothing for NCCL's."""
    if isinstance(group, GlooGroup):
        group.close_connections()


def _connections_closed(group) -> bool:
    """``GlooGroup.connections_closed`` for a gloo group; True for NCCL's (its abort ended its work) and None."""
    return not isinstance(group, GlooGroup) or group.connections_closed()


def _close_and_drop(groups: list) -> None:
    """Close ``groups``' connections and let go of them on a thread of its own, which holds the only references
    left, so that their destructors run there. Both wait for a tick of gloo's event loop (up to 10 ms each, the
    GIL released): a recovery's next group is built meanwhile instead of after 20 ms per generation dropped. Not a
    daemon thread: the interpreter's exit waits for it (a daemon thread ended inside gloo's destructor aborts the
    process)."""
    def close() -> None:
        for group in groups:
            _close_connections(group)
        groups.clear()  # the destructors run here, each after its connections closed

    threading.Thread(target=close, name="close-groups").start()


def _gloo_group(store, rank: int, size: int, rendezvous: timedelta, timeout: timedelta) -> GlooGroup:
    """A ``GlooGroup`` over loopback (or the interfaces ``GLOO_SOCKET_IFNAME`` names, as torch's default), lazily
    connected; the rendezvous reads every member's address in one batch
    (``BatchedAddressStore``), waiting at most ``rendezvous``, which also bounds each first-use connect."""
    interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the stubs call it Options
    opts._devices = ([dist.ProcessGroupGloo.create_device(interface=name, lazy_init=True) for name in interfaces]
                     or [dist.ProcessGroupGloo.create_default_device(lazy_init=True)])
    opts._threads, opts._timeout = 2 * len(opts._devices), rendezvous  # torch's defaults
    pg = GlooGroup(BatchedAddressStore(store, size), rank, size, opts)
    pg.set_timeout(timeout)
    return pg
