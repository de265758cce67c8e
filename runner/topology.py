"""Topology: who runs where and who backs up whom, as one pure object.

Every placement rule of the runner lives here, so that the controller, the workers, the decision
and the recovery techniques agree by construction: logical rank <-> (node, local rank), the spare
nodes after the job's nodes, DeadPool's replication ring (each rank's optimizer shard is held one
node further on), flash checkpoint partners (nodes paired 0-1, 2-3, ..., an odd last node with
node 0), NDB neighbours (the next or previous live rank in ring order) and where a restart of
every rank puts the ranks of a lost node. It does no I/O and holds no process state: a unit test
checks it without starting anything.

Today every rank is a data-parallel rank (``world == dp``); tensor and pipeline coordinates will
extend this object, not the callers.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal, Optional

NeighbourPolicy = Literal["ring_next", "ring_prev"]


@dataclass(frozen=True)
class Topology:
    """``nodes`` job nodes of ``procs_per_node`` ranks each, and ``spares`` hot-spare processes that
    live on nodes of their own after the job's nodes (node ids ``nodes``, ``nodes + 1``, ...)."""

    nodes: int
    procs_per_node: int
    spares: int = 0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.procs_per_node < 1 or self.spares < 0:
            raise ValueError(f"a topology needs nodes >= 1, procs_per_node >= 1 and spares >= 0 "
                             f"(got {self.nodes}, {self.procs_per_node}, {self.spares}).")

    @classmethod
    def from_cfg(cls, cfg) -> Topology:
        """The topology a run's config asks for (``parallel.nodes``, ``procs_per_node``, ``spares``)."""
        p = cfg.parallel
        return cls(int(p.nodes), int(p.procs_per_node), int(p.get("spares", 0) or 0))

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        """Training ranks (spares excluded)."""
        return self.nodes * self.procs_per_node

    @property
    def dp(self) -> int:
        """Data-parallel replicas: every training rank is one today."""
        return self.world

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

    # -- DeadPool: the replication ring ---------------------------------------------------------------
    def replica_holder(self, rank: int) -> int:
        """The rank that holds ``rank``'s optimizer-shard replica: the same local rank one node on."""
        self._check_rank(rank)
        return (rank + self.procs_per_node) % self.world

    def replica_owner(self, rank: int) -> int:
        """The rank whose optimizer-shard replica ``rank`` holds (the inverse of ``replica_holder``)."""
        self._check_rank(rank)
        return (rank - self.procs_per_node) % self.world

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

    # -- NDB: neighbours ----------------------------------------------------------------------------------
    @staticmethod
    def ndb_neighbour(failed: int, live: Sequence[int], policy: NeighbourPolicy) -> int:
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
        raise ValueError(f"unknown ndb.neighbour policy {policy!r}: use ring_next or ring_prev.")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ValueError(f"logical rank {rank} is outside {self} (ranks 0..{self.world - 1}).")
