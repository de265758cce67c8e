"""The runner's gloo groups connect lazily (a pair when a collective first uses it), and a group dropped while a
socket holds bytes for a receive whose buffer is gone (a collective that failed while its peer still sent) goes
at once once its connections are closed (``GlooGroup.close_connections``); without that, gloo's destructor spins
forever (docs/recovery.md, "Lazy gloo groups"). Closing touches only pairs the group used: a group that talked point to
point to a member two ranks on (DeadPool's and flash_ckpt's side group) closes at once too."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from runner.plumbing.store_counts import socket_inodes
from runner.training.comm import _gloo_group

REPO = Path(__file__).resolve().parents[1]


def test_a_group_connects_a_pair_when_a_collective_first_uses_it():
    server = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    clients = [TCPStore("127.0.0.1", server.port, 1, False) for _ in range(2)]  # one each: a wait holds its client
    for client in clients:
        client.add("connected", 1)  # a round trip: the server has accepted this client before the count starts
    before = socket_inodes()
    wait = timedelta(seconds=10)
    with ThreadPoolExecutor(2) as pool:  # both members of a two-member group, in this process
        groups = list(pool.map(lambda rank: _gloo_group(PrefixStore("g/", clients[rank]), rank, 2, wait, wait),
                               (0, 1)))
        assert len(socket_inodes() - before) == 2  # a listener per member, no connection yet
        totals = [torch.tensor([float(rank)]) for rank in (0, 1)]
        works = [group.allreduce([total]) for group, total in zip(groups, totals)]
        for work in works:
            work.wait()
    assert [t.item() for t in totals] == [1.0, 1.0]
    assert len(socket_inodes() - before) == 4  # and both ends of their connection
    del works
    for group in groups:
        group.close_connections()
    del groups


def _groups_in_one_process(prefix: str, size: int, use) -> list:
    """``size`` members of a lazily connected group, each on a thread of its own in this process, after each ran
    ``use(group, rank)``."""
    server = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    clients = [TCPStore("127.0.0.1", server.port, 1, False) for _ in range(size)]
    wait = timedelta(seconds=20)
    with ThreadPoolExecutor(size) as pool:
        groups = list(pool.map(lambda rank: _gloo_group(PrefixStore(prefix, clients[rank]), rank, size, wait, wait),
                               range(size)))
        list(pool.map(use, groups, range(size)))
    return groups


def _assert_each_closes_at_once(groups: list, order: list[int]) -> None:
    """One after the other (no two close the same pair at once); a receive on a pair the group never used would
    start a connection the peer never answers, for the rendezvous timeout (what stalled a lazy side group)."""
    for rank in order:
        start = time.monotonic()
        groups[rank].close_connections()
        assert time.monotonic() - start < 5, f"rank {rank} waited for a pair it never used"


def test_a_group_used_point_to_point_closes_only_the_pairs_it_used():
    """Each of 4 members sends to and receives from the member two ranks on, never a ring neighbour."""
    def exchange(group, rank: int) -> None:
        works = [group.send([torch.ones(4)], (rank + 2) % 4, 0), group.recv([torch.zeros(4)], (rank + 2) % 4, 0)]
        for work in works:
            work.wait()

    groups = _groups_in_one_process("p2p/", 4, exchange)
    assert [list(group.peers[0]) for group in groups] == [[2], [3], [0], [1]]
    _assert_each_closes_at_once(groups, [1, 0, 3, 2])


def test_a_group_that_only_broadcast_closes_through_its_parent_in_gloos_tree():
    """7 members, root 2: gloo's binomial tree connects rank 1 (6 ranks after the root) only to rank 4."""
    def broadcast(group, rank: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 2
        group.broadcast([torch.full((4,), float(rank))], opts).wait()

    groups = _groups_in_one_process("bcast/", 7, broadcast)
    assert list(groups[1].peers[0]) == [4]
    _assert_each_closes_at_once(groups, [1, 0, 3, 5, 6, 4, 2])


def test_a_group_reports_its_connections_closed_only_once_every_peer_it_used_refuses_a_receive():
    """What the fence asks before it leaves given-up work waiting (``Comm._fence``): an open connection takes the
    probe's receive (and is closed by its timed-out wait, as ``close_connections`` closes), a closed one refuses."""
    def allreduce(group, rank: int) -> None:
        group.allreduce([torch.ones(4)]).wait()

    groups = _groups_in_one_process("probe/", 3, allreduce)
    assert groups[0].connections_closed() is False  # its ring neighbours' connections were up
    assert groups[0].connections_closed() is True  # the probe closed them
    groups[1].close_connections()
    assert groups[1].connections_closed() is True
    assert groups[1].closed == [{2: None, 0: None}]  # what it closed is kept, the ring neighbours it used
    _assert_each_closes_at_once(groups, [2, 0, 1])


@pytest.mark.parametrize("collectives", [1, 2])
def test_with_two_devices_a_group_closes_through_the_contexts_its_collectives_ran_on(collectives, monkeypatch):
    """``GLOO_SOCKET_IFNAME`` naming two interfaces gives a group two gloo contexts, and its collectives take them
    in turn: after one all-reduce only the first context has pairs, and closing must not start one on the second."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,lo")

    def reduce(group, rank: int) -> None:
        for _ in range(collectives):
            group.allreduce([torch.ones(4)]).wait()

    groups = _groups_in_one_process(f"two/{collectives}/", 4, reduce)
    assert [group.devices for group in groups] == [2] * 4
    assert [[sorted(context) for context in group.peers] for group in groups][1] == (
        [[0, 2], []] if collectives == 1 else [[0, 2], [0, 2]])
    _assert_each_closes_at_once(groups, [0, 1, 2, 3])


_STRANDED = """
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
sys.path.insert(0, {repo!r})
import torch
from torch.distributed import PrefixStore, TCPStore
from runner.training.comm import _gloo_group

server = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
clients = [TCPStore("127.0.0.1", server.port, 1, False) for _ in range(2)]
wait = timedelta(seconds=10)
with ThreadPoolExecutor(2) as pool:
    groups = list(pool.map(lambda rank: _gloo_group(PrefixStore("g/", clients[rank]), rank, 2, wait, wait), (0, 1)))
    works = [group.allreduce([torch.ones(4)]) for group in groups]  # connects the pair
    for work in works:
        work.wait()
del works
groups[0].recv([torch.zeros(1024)], 1, 7)  # posted, then its buffer goes with the discarded work
groups[1].send([torch.ones(1024)], 0, 7).wait()  # the bytes sit in rank 0's socket, for no buffer
for group in groups:
    if {how!r} == "close":
        group.close_connections()
    elif {how!r} == "neither":
        group.peers = [{{}} for _ in group.peers]  # it forgets the pairs it used: nothing closes them first
del groups  # "drop": the group closes its connections as it goes (GlooGroup.__del__)
print("dropped", flush=True)
"""


def _drop_with_stranded_bytes(how: str, timeout_s: float) -> subprocess.CompletedProcess | None:
    """Run the script above (``how``: "close" its connections, "drop" it, or "neither" close them nor let the
    group close them as it goes); None when it did not end within ``timeout_s`` (it is killed)."""
    try:
        return subprocess.run([sys.executable, "-c", _STRANDED.format(repo=str(REPO), how=how)],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_group_holding_bytes_no_receive_will_take_is_dropped_once_its_connections_are_closed(how):
    done = _drop_with_stranded_bytes(how, timeout_s=60)
    assert done is not None and done.returncode == 0, done and done.stderr[-2000:]
    assert done.stdout.strip() == "dropped"


@pytest.mark.slow  # run time: the control of the test above keeps a core busy for 10 s
def test_without_closing_its_connections_such_a_group_never_goes():
    """What the test above guards against: gloo's destructor waits for its event loop, which the socket keeps
    busy (the process is killed after 10 s)."""
    assert _drop_with_stranded_bytes("neither", timeout_s=10) is None
