"""A gloo group's rendezvous reads every member's address in one batch (``runner.plumbing.gloo_rendezvous``): 3 store
operations per member and gloo device whatever the group's size, counted at the store (``runner.plumbing.store_counts``)
over a real TCPStore, and a member that never publishes fails the others' first collective (gloo groups connect
lazily: a device's addresses are read when a collective first uses it) at the rendezvous timeout."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
from torch.distributed import PrefixStore, TCPStore

from runner.plumbing import store_counts
from runner.training.comm import _gloo_group


def _members(n: int) -> tuple[TCPStore, list]:
    """A store server and one client per member (a wait holds its client), counted when counting is on."""
    server = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    return server, [store_counts.counted(TCPStore("127.0.0.1", server.port, 1, False)) for _ in range(n)]


@pytest.mark.parametrize(("n", "interfaces"), [(4, ""), (8, ""), (4, "lo,lo")])  # "lo,lo": two gloo devices
def test_each_member_reads_every_address_in_three_store_operations(n, interfaces, tmp_path, monkeypatch):
    monkeypatch.setenv(store_counts.ENV, str(tmp_path))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", interfaces)
    devices = len(interfaces.split(","))
    server, clients = _members(n)
    wait = timedelta(seconds=30)

    def member(rank: int) -> float:
        pg = _gloo_group(PrefixStore("pg/0/", clients[rank]), rank, n, wait, wait)
        totals = [torch.tensor([float(rank)]) for _ in range(devices)]
        for total in totals:  # one collective per device (they take turns): each reads its device's addresses
            pg.allreduce([total]).wait()  # the pairs it uses connected to the right peers
        return totals[-1].item()

    with ThreadPoolExecutor(n) as pool:  # every member of the group, in this process
        totals = list(pool.map(member, range(n)))
    assert totals == [n * (n - 1) / 2] * n
    gloo = [(what, keys) for _t, what, key_class, keys in store_counts.load(tmp_path) if key_class == "gloo"]
    assert Counter(what for what, _ in gloo) == dict.fromkeys(("set", "wait", "multi_get"), n * devices), gloo
    assert all(keys == (1 if what == "set" else n) for what, keys in gloo), gloo  # one wait, one read of N keys


def test_a_member_that_never_publishes_fails_the_others_first_collective_at_the_rendezvous_timeout():
    server, clients = _members(3)
    wait = timedelta(seconds=1)

    def member(rank: int) -> str:
        pg = _gloo_group(PrefixStore("pg/0/", clients[rank]), rank, 3, wait, wait)  # returns at once: lazily built
        try:
            pg.allreduce([torch.zeros(1)]).wait()
        except Exception as err:  # the store's wait for the peers' addresses timed out, through gloo's first use
            return str(err)
        return "reduced"

    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:  # rank 2 never comes
        outcomes = list(pool.map(member, range(2)))
    assert all("timeout" in outcome.lower() for outcome in outcomes), outcomes
    assert time.monotonic() - start >= wait.total_seconds()
