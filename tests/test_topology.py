"""Topology: placement, spares, the DeadPool ring, flash partners and NDB neighbours, without processes."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from runner.topology import Topology


def test_sizes_and_launch_placement():
    t = Topology(nodes=3, procs_per_node=2, spares=3)
    assert (t.world, t.dp, t.spare_nodes, t.total_nodes) == (6, 6, 2, 5)
    assert [t.place(r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(t.rank_at(*t.place(r)) == r for r in range(6))
    assert t.ranks_on(1) == [2, 3] and t.ranks_on(3) == []  # node 3 is a spare node
    assert [t.spare_place(i) for i in range(3)] == [(3, 0), (3, 1), (4, 0)]


@pytest.mark.parametrize("bad", [lambda t: t.place(4), lambda t: t.place(-1), lambda t: t.spare_place(1),
                                 lambda t: t.rank_at(2, 0), lambda t: t.replica_holder(4)])
def test_out_of_range_is_refused(bad):
    with pytest.raises(ValueError):
        bad(Topology(nodes=2, procs_per_node=2))


def test_invalid_shape_is_refused():
    with pytest.raises(ValueError, match="nodes >= 1"):
        Topology(nodes=0, procs_per_node=2)


def test_from_cfg_reads_the_parallel_group():
    cfg = OmegaConf.create({"parallel": {"nodes": 2, "procs_per_node": 4, "spares": 4}})
    assert Topology.from_cfg(cfg) == Topology(2, 4, 4)


def test_the_replication_ring_holds_each_shard_one_node_on():
    t = Topology(nodes=3, procs_per_node=2)
    assert [t.replica_holder(r) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert all(t.replica_owner(t.replica_holder(r)) == r for r in range(6))
    assert all(t.node_of(t.replica_holder(r)) != t.node_of(r) for r in range(6))


def test_a_shard_is_lost_only_with_its_holder():
    t = Topology(nodes=3, procs_per_node=2)
    assert t.shards_without_copy([2, 3]) == []  # a whole node: replicas are on the next one
    assert t.shards_without_copy([2, 4]) == [2]  # rank 2's holder is rank 4
    assert t.shards_without_copy([4, 0]) == [4]  # wraps around


@pytest.mark.parametrize("nodes, partners", [(1, [None]), (2, [1, 0]), (3, [1, 0, 0]), (4, [1, 0, 3, 2])])
def test_flash_partner_nodes_pair_up(nodes, partners):
    assert [Topology(nodes, 2).partner_node(n) for n in range(nodes)] == partners


def test_flash_partner_rank_keeps_the_local_rank():
    t = Topology(nodes=3, procs_per_node=2)
    assert [t.partner_rank(r) for r in range(6)] == [2, 3, 0, 1, 0, 1]
    assert Topology(1, 2).partner_rank(1) is None


def test_restart_of_every_rank_moves_a_lost_nodes_ranks_to_its_partner():
    t = Topology(nodes=3, procs_per_node=2)
    assert [t.restart_place(r, gone=set()) for r in range(6)] == [t.place(r) for r in range(6)]
    assert [t.restart_place(r, gone={1}) for r in (2, 3)] == [(0, 2), (0, 3)]  # node 1's partner is node 0
    assert {t.restart_place(r, gone={0, 1})[0] for r in range(4)} == {2}  # both partners gone: the first node up
    with pytest.raises(ValueError, match="every job node"):
        t.restart_place(0, gone={0, 1, 2})


def test_neighbour_policies_skip_dead_ranks():
    assert Topology.ndb_neighbour(1, [0, 2, 3], "ring_next") == 2
    assert Topology.ndb_neighbour(3, [0, 1, 2], "ring_next") == 0
    assert Topology.ndb_neighbour(2, [0, 1, 3], "ring_prev") == 1
    assert Topology.ndb_neighbour(0, [1, 2], "ring_prev") == 2
    with pytest.raises(ValueError):
        Topology.ndb_neighbour(0, [], "ring_next")
    with pytest.raises(ValueError, match="both failed and live"):
        Topology.ndb_neighbour(1, [1, 2], "ring_next")
