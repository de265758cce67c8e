"""Topology: placement, spares, the DeadPool ring, flash partners and NDB neighbours, without processes."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from runner.planning.topology import Topology


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


@pytest.mark.parametrize("nodes, ppn", [(2, 1), (2, 2), (3, 2), (2, 4), (4, 2), (1, 2), (1, 1)])
def test_at_tp_and_pp_of_one_the_ring_is_the_same_local_rank_one_node_on(nodes, ppn):
    t = Topology(nodes, ppn)
    assert [t.replica_holder(r) for r in range(t.world)] == [(r + ppn) % t.world for r in range(t.world)]
    assert t.replicas_off_node == (nodes > 1)


@pytest.mark.parametrize("nodes, ppn, tp, pp, holders", [
    (2, 4, 2, 2, [4, 5, 6, 7, 0, 1, 2, 3]),  # a replica per node: the same slot on the other node
    (2, 4, 2, 1, [4, 5, 6, 7, 0, 1, 2, 3]),  # two replicas per node: two replicas on, one node on
    (4, 2, 2, 2, [4, 5, 6, 7, 0, 1, 2, 3]),  # a replica spans two nodes: the next replica, two nodes on
])
def test_the_ring_holds_each_shard_at_its_coordinate_in_another_replica_on_another_node(nodes, ppn, tp, pp, holders):
    t = Topology(nodes, ppn, tp=tp, pp=pp)
    assert [t.replica_holder(r) for r in range(t.world)] == holders
    for r in range(t.world):
        holder = t.replica_holder(r)
        assert t.coords(holder)[1:] == t.coords(r)[1:] and holder in t.dp_group(r)  # the same slice and shard plan
        assert t.node_of(holder) != t.node_of(r) and t.replica_owner(holder) == r
    assert t.replicas_off_node


def test_a_layout_whose_replicas_always_share_a_node_has_no_ring():
    t = Topology(2, 6, tp=2, pp=2)  # dp=3: replica 1 straddles both nodes, so no shift moves every rank off its node
    assert not t.replicas_off_node
    assert all(t.replica_holder(r) == r for r in range(t.world)) and t.shards_without_copy([0]) == [0]


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
    assert Topology.covering_neighbour(1, [0, 2, 3], "ring_next") == 2
    assert Topology.covering_neighbour(3, [0, 1, 2], "ring_next") == 0
    assert Topology.covering_neighbour(2, [0, 1, 3], "ring_prev") == 1
    assert Topology.covering_neighbour(0, [1, 2], "ring_prev") == 2
    with pytest.raises(ValueError):
        Topology.covering_neighbour(0, [], "ring_next")
    with pytest.raises(ValueError, match="both failed and live"):
        Topology.covering_neighbour(1, [1, 2], "ring_next")


def test_ndb_hands_a_failed_ranks_whole_replica_to_the_neighbour_replica_by_coordinate():
    t = Topology(nodes=2, procs_per_node=4, tp=2, pp=2, order="tp-pp-dp")  # replica 0: ranks 0-3, replica 1: 4-7
    assert t.replica_ranks(1) == [4, 5, 6, 7]
    assert t.covering_assignment(6, live=[0, 1, 2, 3, 4, 5, 7], busy=[], policy="ring_next") == {4: 0, 5: 1, 6: 2, 7: 3}
    t = Topology(nodes=3, procs_per_node=2, tp=2)  # replicas {0, 1}, {2, 3}, {4, 5}
    assert t.covering_assignment(3, live=[0, 1, 2, 4, 5], busy=[], policy="ring_next") == {2: 4, 3: 5}
    assert t.covering_assignment(3, live=[0, 1, 2, 4, 5], busy=[], policy="ring_prev") == {2: 0, 3: 1}
    assert t.covering_assignment(3, live=[0, 1, 2, 4, 5], busy=[4], policy="ring_next") == {2: 0, 3: 1}  # spread out
    # replica 0 is broken
    assert t.covering_assignment(3, live=[1, 2, 4, 5], busy=[], policy="ring_prev") == {2: 4, 3: 5}
    with pytest.raises(ValueError, match="no live data-parallel replica"):
        t.covering_assignment(3, live=[1, 2, 5], busy=[], policy="ring_next")
    flat = Topology(nodes=4, procs_per_node=1)  # tp = pp = 1: a replica is a rank, the ring over live ranks
    for failed, live, busy in ((1, [0, 2, 3], []), (3, [0, 1, 2], []), (1, [0, 2, 3], [2])):
        free = [r for r in live if r not in busy]
        assert flat.covering_assignment(failed, live, busy, "ring_next") == {
            failed: Topology.covering_neighbour(failed, free, "ring_next")}


# -- layout coordinates (dp, pp, tp) --------------------------------------------------------------------
LAYOUTS = [  # nodes, procs_per_node, tp, pp, order
    (2, 4, 2, 2, "tp-pp-dp"),  # the 2 nodes x 4 ranks: tp=2 pp=2 dp=2
    (2, 4, 1, 1, "tp-pp-dp"),
    (1, 8, 2, 2, "tp-pp-dp"),
    (4, 2, 2, 2, "tp-pp-dp"),  # a replica spans two nodes
    (2, 4, 4, 1, "tp-pp-dp"),
    (3, 2, 1, 3, "tp-pp-dp"),
    (2, 4, 2, 2, "pp-tp-dp"),
    (2, 4, 2, 2, "dp-pp-tp"),
]


@pytest.mark.parametrize("nodes, ppn, tp, pp, order", LAYOUTS)
def test_coordinates_and_ranks_are_one_to_one(nodes, ppn, tp, pp, order):
    t = Topology(nodes, ppn, tp=tp, pp=pp, order=order)
    assert t.dp == t.world // (tp * pp)
    coords = [t.coords(r) for r in range(t.world)]
    assert sorted(coords) == [(d, p, k) for d in range(t.dp) for p in range(pp) for k in range(tp)]
    assert all(t.rank_of(*c) == r for r, c in enumerate(coords))


@pytest.mark.parametrize("nodes, ppn, tp, pp, order", LAYOUTS)
def test_each_group_varies_one_coordinate_and_the_groups_partition_the_ranks(nodes, ppn, tp, pp, order):
    t = Topology(nodes, ppn, tp=tp, pp=pp, order=order)
    for axis, group_of, size in ((2, t.tp_group, tp), (1, t.pp_group, pp), (0, t.dp_group, t.dp)):
        groups = {tuple(group_of(r)) for r in range(t.world)}
        assert sorted(r for g in groups for r in g) == list(range(t.world))  # every rank in exactly one group
        for r in range(t.world):
            g = group_of(r)
            assert len(g) == size and r in g
            assert [t.coords(m)[axis] for m in g] == list(range(size))  # in order of the varying coordinate
            fixed = [tuple(c for i, c in enumerate(t.coords(m)) if i != axis) for m in g]
            assert len(set(fixed)) == 1  # every other coordinate is shared


@pytest.mark.parametrize("nodes, ppn, tp, pp, order", LAYOUTS)
def test_the_dp_peer_has_the_same_stage_and_slice_in_the_next_replica(nodes, ppn, tp, pp, order):
    t = Topology(nodes, ppn, tp=tp, pp=pp, order=order)
    for r in range(t.world):
        dp, p, k = t.coords(r)
        assert t.coords(t.dp_peer(r)) == ((dp + 1) % t.dp, p, k)


def test_the_default_order_keeps_tp_inside_a_node_then_pp_then_dp():
    t = Topology(nodes=2, procs_per_node=4, tp=2, pp=2)
    assert [t.coords(r) for r in range(8)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
                                               (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert [t.tp_group(r) for r in (0, 3, 5)] == [[0, 1], [2, 3], [4, 5]]
    assert [t.pp_group(r) for r in (0, 3, 5)] == [[0, 2], [1, 3], [5, 7]]
    assert [t.dp_group(r) for r in (0, 3)] == [[0, 4], [3, 7]]
    assert [t.dp_peer(r) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]  # the same slot, the other node
    assert all(len({t.node_of(m) for m in t.tp_group(r)}) == 1 for r in range(8))


def test_with_tp_and_pp_of_one_every_rank_is_a_replica():
    t = Topology(nodes=3, procs_per_node=2)
    assert [t.coords(r) for r in range(6)] == [(r, 0, 0) for r in range(6)]
    assert t.dp_group(4) == list(range(6)) and t.tp_group(4) == [4] and t.pp_group(4) == [4]
    assert [t.dp_peer(r) for r in range(6)] == [1, 2, 3, 4, 5, 0]
    assert Topology(1, 1).dp_peer(0) is None  # a single replica has no peer


@pytest.mark.parametrize("kwargs, match", [
    (dict(nodes=3, procs_per_node=4, tp=3), r"tp=3 does not divide procs_per_node=4.*one of \[1, 2, 4\]"),
    (dict(nodes=2, procs_per_node=2, tp=4), "a tensor-parallel group would span two nodes"),
    (dict(nodes=1, procs_per_node=3, pp=2), r"tp\*pp = 1\*2 does not divide the 3 training ranks"),
    (dict(nodes=2, procs_per_node=4, order="tp-dp"), "must name tp, pp and dp once each"),
    (dict(nodes=2, procs_per_node=4, order="tp-tp-dp"), "must name tp, pp and dp once each"),
    (dict(nodes=2, procs_per_node=4, pp=0), "tp >= 1 and pp >= 1"),
])
def test_an_impossible_layout_is_refused_with_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Topology(**kwargs)


def test_tp_across_nodes_is_accepted_when_the_order_does_not_put_it_innermost():
    t = Topology(nodes=2, procs_per_node=2, tp=2, pp=2, order="pp-tp-dp")
    assert t.tp_group(0) == [0, 2] and t.node_of(2) != t.node_of(0)


@pytest.mark.parametrize("bad", [lambda t: t.rank_of(2, 0, 0), lambda t: t.rank_of(0, 0, 2), lambda t: t.coords(8),
                                 lambda t: t.tp_group(-1)])
def test_out_of_range_coordinates_are_refused(bad):
    with pytest.raises(ValueError):
        bad(Topology(nodes=2, procs_per_node=4, tp=2, pp=2))


def test_from_cfg_reads_the_layout_degrees():
    cfg = OmegaConf.create({"parallel": {"nodes": 2, "procs_per_node": 4, "spares": 0, "tp": 2, "pp": 2}})
    assert Topology.from_cfg(cfg) == Topology(2, 4, tp=2, pp=2)
    assert Topology.from_cfg(cfg).dp == 2
