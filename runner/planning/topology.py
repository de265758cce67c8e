"""Topology: who runs where and who backs up whom, as one pure object.

Every placement rule of the runner lives here, so that the controller, the workers, the decision
and the recovery techniques agree by construction: logical rank <-> (node, local rank), the spare
nodes after the job's nodes, DeadPool's replication ring (each rank's optimizer shard is held at its
(pp, tp) coordinate in another DP replica on another node: one node further on at tp = pp = 1),
flash checkpoint partners (nodes paired 0-1, 2-3, ..., an odd last node with node 0), NDB
neighbours (the next or previous live model replica in ring order) and where a restart of every
rank puts the ranks of a lost node. It does no I/O and holds no process state: a unit test checks
it without starting anything.

Layout coordinates: each rank has a (dp, pp, tp) coordinate. ``order`` names the dimensions
innermost first; the default ``tp-pp-dp`` puts a tensor-parallel group on neighbouring ranks of one
node, then pipeline stages, and data-parallel replicas outermost. With tp = pp = 1 every rank is its
own replica; docs/parallelism.md says how each recovery rule generalises to "the same (pp, tp)
coordinate in another DP replica" (``dp_peer``, ``replica_holder``). DP replica groups
(``dp_group_size``, HSDP) say where ZeRO-1's shards and their copies live: a shard group per
replica group, and the same shard index in every group (``shard_group``, ``replica_group_peer``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal, Optional

NeighbourPolicy = Literal["ring_next", "ring_prev"]
DIMENSIONS = ("tp", "pp", "dp")
ORDER = "-".join(DIMENSIONS)  # the default placement: TP innermost (inside a node), then PP, DP outermost


def spare_count(cfg) -> int:
    """``parallel.spares``, or when it is null (the default) one spare node, ``procs_per_node`` spares, if a
    technique in ``ft`` uses spares (DeadPool), else none."""
    from runner.recovery.registry import with_  # the registry's techniques import this module's users

    spares = cfg.parallel.get("spares")
    if spares is not None:
        return int(spares)
    return int(cfg.parallel.procs_per_node) if with_(list(cfg.get("ft") or {}), "uses_spares") else 0


@dataclass(frozen=True)
class Topology:
    """``nodes`` job nodes of ``procs_per_node`` ranks each, and ``spares`` hot-spare processes that
    live on nodes of their own after the job's nodes (node ids ``nodes``, ``nodes + 1``, ...).

    The training ranks form ``dp`` model replicas of ``tp * pp`` ranks each; ``order`` lists the
    dimensions innermost first, joined by ``-`` (the default ``tp-pp-dp`` keeps a tensor-parallel
    group inside a node)."""

    nodes: int
    procs_per_node: int
    spares: int = 0
    tp: int = 1
    pp: int = 1
    order: str = ORDER
    dp_group_size: int = 0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.procs_per_node < 1 or self.spares < 0:
            raise ValueError(f"a topology needs nodes >= 1, procs_per_node >= 1 and spares >= 0 "
                             f"(got {self.nodes}, {self.procs_per_node}, {self.spares}).")
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"a topology needs tp >= 1 and pp >= 1 (got tp={self.tp}, pp={self.pp}).")
        if sorted(self.order.split("-")) != sorted(DIMENSIONS):
            raise ValueError(f"order {self.order!r} must name tp, pp and dp once each, innermost first, joined by "
                             "'-' (for example 'tp-pp-dp').")
        if self.world % (self.tp * self.pp):
            raise ValueError(f"tp*pp = {self.tp}*{self.pp} does not divide the {self.world} training ranks "
                             f"({self.nodes} node(s) x {self.procs_per_node}): change parallel.tp/parallel.pp or "
                             "the number of ranks so that tp*pp*dp equals the world size.")
        if self.dp_group_size < 0 or (self.dp_group_size and self.dp % self.dp_group_size):
            raise ValueError(f"dp_group_size={self.dp_group_size} must be 0 (one group) or divide the data-parallel "
                             f"size {self.dp}: change parallel.dp_group_size.")
        if self._dimensions[0] == "tp" and self.procs_per_node % self.tp:
            fits = [d for d in range(1, self.procs_per_node + 1) if self.procs_per_node % d == 0]
            raise ValueError(
                f"Tensor parallelism is placed innermost (order {self.order!r}) so that its all-reduces, two per "
                f"layer in each direction, stay on one node's fast links, but tp={self.tp} does not divide "
                f"procs_per_node={self.procs_per_node}: a tensor-parallel group would span two nodes. Set "
                f"parallel.tp to one of {fits}, or run a multiple of {self.tp} ranks per node "
                "(parallel.procs_per_node).")

    @classmethod
    def from_cfg(cls, cfg) -> Topology:
        """The topology a run's config asks for (``parallel.nodes``, ``procs_per_node``, ``spares``, and the
        layout degrees ``tp`` and ``pp``, their ``order`` and the replica groups' ``dp_group_size`` where the config
        has them)."""
        p = cfg.parallel
        return cls(int(p.nodes), int(p.procs_per_node), spare_count(cfg),
                   tp=int(p.get("tp", 1) or 1), pp=int(p.get("pp", 1) or 1), order=str(p.get("order", ORDER)),
                   dp_group_size=int(p.get("dp_group_size", 0) or 0))

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        """Training ranks (spares excluded)."""
        return self.nodes * self.procs_per_node

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the model, ``tp * pp`` ranks each (every rank when tp = pp = 1)."""
        return self.world // (self.tp * self.pp)

    @property
    def spare_nodes(self) -> int:
        """Nodes that hold only spares: ``ceil(spares / procs_per_node)``."""
        return -(-self.spares // self.procs_per_node)

    @property
    def total_nodes(self) -> int:
        """Job nodes and spare nodes: the node agents a launch starts."""
        return self.nodes + self.spare_nodes

    # -- placement --------------------------------------------------------------------------------
    def place(self, rank: int) -> tuple[int, int]:
        """(node, local rank) of logical ``rank`` at launch."""
        self._check_rank(rank)
        return divmod(rank, self.procs_per_node)

    def node_of(self, rank: int) -> int:
        return self.place(rank)[0]

    def rank_at(self, node: int, local: int) -> int:
        """The logical rank launched at (``node``, ``local``) on a job node."""
        if not 0 <= node < self.nodes or not 0 <= local < self.procs_per_node:
            raise ValueError(f"({node}, {local}) is not a job node's slot in {self}.")
        return node * self.procs_per_node + local

    def ranks_on(self, node: int) -> list[int]:
        """The logical ranks launched on job node ``node`` (none on a spare node)."""
        if not 0 <= node < self.nodes:
            return []
        return list(range(node * self.procs_per_node, (node + 1) * self.procs_per_node))

    def spare_place(self, index: int) -> tuple[int, int]:
        """(node, local rank) of hot spare ``index``: spares fill the nodes after the job's, in order."""
        if not 0 <= index < self.spares:
            raise ValueError(f"spare {index} does not exist: {self} has {self.spares} spare(s).")
        node, local = divmod(index, self.procs_per_node)
        return self.nodes + node, local

    def restart_place(self, rank: int, gone: Collection[int]) -> tuple[int, int]:
        """Where a restart of every rank starts ``rank`` when the nodes in ``gone`` are lost: on its
        own node if up, else on its node's flash partner (which holds its memory copies), else on the
        first job node still up; a moved rank takes a local slot after that node's own ranks."""
        node, local = self.place(rank)
        if node not in gone:
            return node, local
        partner = self.partner_node(node)
        if partner is not None and partner not in gone:
            return partner, local + self.procs_per_node
        up = [n for n in range(self.nodes) if n not in gone]
        if not up:
            raise ValueError(f"every job node is lost ({sorted(gone)}): there is no node to restart rank {rank} on.")
        return up[0], local + self.procs_per_node

    # -- layout coordinates ------------------------------------------------------------------------------
    @property
    def _dimensions(self) -> list[str]:
        return self.order.split("-")

    def _sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp}

    def _strides(self) -> dict[str, int]:
        """Per dimension, the rank distance between two ranks whose coordinates differ by one in it alone."""
        sizes, strides, step = self._sizes(), {}, 1
        for dim in self._dimensions:
            strides[dim] = step
            step *= sizes[dim]
        return strides

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp, pp, tp) coordinate of ``rank``: its model replica, pipeline stage and tensor-parallel slot."""
        self._check_rank(rank)
        sizes, strides = self._sizes(), self._strides()
        dp, pp, tp = ((rank // strides[dim]) % sizes[dim] for dim in ("dp", "pp", "tp"))
        return dp, pp, tp

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        """The rank at coordinate (``dp``, ``pp``, ``tp``); the inverse of ``coords``."""
        if not (0 <= dp < self.dp and 0 <= pp < self.pp and 0 <= tp < self.tp):
            raise ValueError(f"coordinate (dp={dp}, pp={pp}, tp={tp}) is outside {self} "
                             f"(dp < {self.dp}, pp < {self.pp}, tp < {self.tp}).")
        strides = self._strides()
        return dp * strides["dp"] + pp * strides["pp"] + tp * strides["tp"]

    def _group(self, rank: int, dim: str) -> list[int]:
        """The ranks that share every coordinate of ``rank`` but ``dim``, in order of that coordinate."""
        at = dict(zip(("dp", "pp", "tp"), self.coords(rank)))
        return [self.rank_of(**{**at, dim: i}) for i in range(self._sizes()[dim])]

    def tp_group(self, rank: int) -> list[int]:
        """The ranks that hold the other slices of ``rank``'s layers (same replica, same stage)."""
        return self._group(rank, "tp")

    def pp_group(self, rank: int) -> list[int]:
        """The pipeline stages of ``rank``'s replica at its tensor-parallel slot, first stage first."""
        return self._group(rank, "pp")

    def dp_group(self, rank: int) -> list[int]:
        """The ranks that hold the same parameters as ``rank`` in every replica (its gradient all-reduce)."""
        return self._group(rank, "dp")

    def dp_peer(self, rank: int) -> Optional[int]:
        """The rank at ``rank``'s (pp, tp) coordinate in the next DP replica (wrapping around): the one that
        holds the same parameters; None with a single replica."""
        dp, pp, tp = self.coords(rank)
        return None if self.dp == 1 else self.rank_of((dp + 1) % self.dp, pp, tp)

    # -- HSDP: replica groups of the DP dimension ------------------------------------------------------
    @property
    def shard_group_size(self) -> int:
        """DP replicas per replica group: ``dp_group_size``, or every replica when it is 0. ZeRO-1 cuts the
        optimizer state into this many shards."""
        return self.dp_group_size or self.dp

    @property
    def replica_groups(self) -> int:
        """How many replica groups the DP dimension splits into (1 when ``dp_group_size`` is 0 or ``dp``); each
        holds every ZeRO-1 shard once."""
        return self.dp // self.shard_group_size

    def shard_index(self, rank: int) -> int:
        """Which ZeRO-1 shard ``rank`` holds: its DP coordinate within its replica group."""
        return self.coords(rank)[0] % self.shard_group_size

    def shard_group(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s DP group in its replica group, by shard index: together they hold one copy of
        the optimizer state of ``rank``'s (pp, tp) coordinate (the all-gather of the ZeRO-1 shards)."""
        dp, pp, tp = self.coords(rank)
        first = dp - dp % self.shard_group_size
        return [self.rank_of(first + i, pp, tp) for i in range(self.shard_group_size)]

    def replica_group_peer(self, rank: int) -> Optional[int]:
        """The rank at ``rank``'s (pp, tp) coordinate and shard index in the next replica group (wrapping
        around): it holds the same ZeRO-1 shard, so a restarted ``rank`` takes its shard from it. None with a
        single replica group."""
        if self.replica_groups == 1:
            return None
        dp, pp, tp = self.coords(rank)
        return self.rank_of((dp + self.shard_group_size) % self.dp, pp, tp)

    def shard_copies(self, rank: int) -> list[int]:
        """The other ranks that hold ``rank``'s ZeRO-1 shard: its ``replica_group_peer``, that rank's peer and so on,
        nearest group first (none with a single replica group)."""
        copies, peer = [], self.replica_group_peer(rank)
        while peer is not None and peer != rank:
            copies.append(peer)
            peer = self.replica_group_peer(peer)
        return copies

    # -- DeadPool: the replication ring ---------------------------------------------------------------
    @cached_property
    def _ring_shift(self) -> int:
        """How many DP replicas further on each rank's optimizer-shard replica is held: the fewest that put every
        rank's holder on another node, or 0 when no shift does (one node, or replicas placed so that some DP peers
        always share a node: no copy outlives its node). One node on (``procs_per_node`` ranks) at
        tp = pp = 1 and whenever a node holds whole replicas; the next replica when a replica spans nodes."""
        for shift in range(1, self.dp):
            if all(self.node_of(self._replica_on(r, shift)) != self.node_of(r) for r in range(self.world)):
                return shift
        return 0

    def _replica_on(self, rank: int, shift: int) -> int:
        """The rank at ``rank``'s (pp, tp) coordinate ``shift`` DP replicas on (wrapping around)."""
        dp, pp, tp = self.coords(rank)
        return self.rank_of((dp + shift) % self.dp, pp, tp)

    @property
    def replicas_off_node(self) -> bool:
        """Whether every rank's optimizer-shard replica lives on another node than the rank (so that a lost node
        leaves a copy of each of its shards)."""
        return self._ring_shift > 0

    def replica_holder(self, rank: int) -> int:
        """The rank that holds ``rank``'s optimizer-shard replica: the rank at its (pp, tp) coordinate, so in
        its DP group (the same slice of the model and the same shard plan), in the nearest DP replica on that
        puts every holder on another node. At tp = pp = 1 (and whenever a node holds whole replicas) that is
        the same local rank one node on; ``rank`` itself when no replica is on another node."""
        self._check_rank(rank)
        return self._replica_on(rank, self._ring_shift)

    def replica_owner(self, rank: int) -> int:
        """The rank whose optimizer-shard replica ``rank`` holds (the inverse of ``replica_holder``)."""
        self._check_rank(rank)
        return self._replica_on(rank, -self._ring_shift)

    def shards_without_copy(self, victims: Collection[int]) -> list[int]:
        """Of the failed ``victims``, those whose replica holder failed with them: no live process keeps
        their shard."""
        lost = set(victims)
        return sorted(v for v in lost if self.replica_holder(v) in lost)

    # -- flash checkpoint: partner nodes --------------------------------------------------------------
    def partner_node(self, node: int) -> Optional[int]:
        """The node that keeps copies of ``node``'s snapshots; None on a single node."""
        if self.nodes < 2:
            return None
        other = node ^ 1
        return other if other < self.nodes else 0

    def partner_rank(self, rank: int) -> Optional[int]:
        """The rank whose memory keeps a copy of ``rank``'s snapshots (same local rank, partner node)."""
        node, local = self.place(rank)
        other = self.partner_node(node)
        return None if other is None else other * self.procs_per_node + local

    # -- a technique that covers failed ranks (NDB): neighbours ---------------------------------------------
    @staticmethod
    def covering_neighbour(failed: int, live: Sequence[int], policy: NeighbourPolicy) -> int:
        """The first live rank after (``ring_next``) or before (``ring_prev``) ``failed`` in ring order;
        skipping dead ranks keeps the choice defined when the adjacent rank is down too."""
        if not live:
            raise ValueError(f"no live data-parallel rank can take over rank {failed}.")
        if failed in live:
            raise ValueError(f"rank {failed} is listed as both failed and live.")
        ring = sorted(live)
        if policy == "ring_next":
            return next((r for r in ring if r > failed), ring[0])
        if policy == "ring_prev":
            return next((r for r in reversed(ring) if r < failed), ring[-1])
        raise ValueError(f"unknown neighbour policy {policy!r}: use ring_next or ring_prev.")

    def replica_ranks(self, dp: int) -> list[int]:
        """The ranks of model replica ``dp`` (its every (pp, tp) coordinate), in rank order."""
        return sorted(self.rank_of(dp, pp, tp) for pp in range(self.pp) for tp in range(self.tp))

    def covering_assignment(self, failed: int, live: Collection[int], busy: Collection[int],
                            policy: NeighbourPolicy) -> dict[int, int]:
        """Who computes each rank of ``failed``'s model replica once it failed (NDB), as {rank: live rank}.

        A replica's collectives need all of its tp*pp ranks, so the takeover is per replica: the failed one leaves
        whole, and the neighbour replica (``covering_neighbour`` over DP coordinates, among the replicas whose every
        rank is in ``live``, preferring those with no rank in ``busy``, i.e. not taking over already) computes it, each
        of its ranks the failed replica's rank at its own (pp, tp) coordinate. With tp = pp = 1 a replica is one
        rank and this is ``covering_neighbour`` over the live ranks."""
        lost = self.coords(failed)[0]
        whole = [d for d in range(self.dp) if d != lost and all(r in live for r in self.replica_ranks(d))]
        free = [d for d in whole if not any(r in busy for r in self.replica_ranks(d))] or whole
        if not free:
            raise ValueError(f"no live data-parallel replica can take over rank {failed}'s replica (dp={lost}).")
        neighbour = self.covering_neighbour(lost, free, policy)
        return {r: self.rank_of(neighbour, *self.coords(r)[1:]) for r in self.replica_ranks(lost)}

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ValueError(f"logical rank {rank} is outside {self} (ranks 0..{self.world - 1}).")
