"""A gloo group's rendezvous reads every member's address in one batch (``runner.gloo_rendezvous``): 3 store
operations per member and gloo device whatever the group's size, counted at the store (``runner.store_counts``)
over a real TCPStore, and a member that never publishes fails the others' build at the rendezvous timeout, as
before."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
from torch.distributed import PrefixStore, TCPStore

from runner import store_counts
from runner.comm import _gloo_group


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
        total = torch.tensor([float(rank)])
        pg.allreduce([total]).wait()  # every pair connected to the right peer
        return total.item()

    with ThreadPoolExecutor(n) as pool:  # every member of the group, in this process
        totals = list(pool.map(member, range(n)))
    assert totals == [n * (n - 1) / 2] * n
    gloo = [(what, keys) for _t, what, key_class, keys in store_counts.load(tmp_path) if key_class == "gloo"]
    assert Counter(what for what, _ in gloo) == dict.fromkeys(("set", "wait", "multi_get"), n * devices), gloo
    assert all(keys == (1 if what == "set" else n) for what, keys in gloo), gloo  # one wait, one read of N keys


def test_a_member_that_never_publishes_fails_the_build_at_the_rendezvous_timeout():
    server, clients = _members(3)
    wait = timedelta(seconds=1)

    def member(rank: int) -> str:
        try:
            _gloo_group(PrefixStore("pg/0/", clients[rank]), rank, 3, wait, wait)
        except Exception as err:  # the store's wait timed out, through gloo's constructor
            return str(err)
        return "built"

    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:  # rank 2 never comes
        outcomes = list(pool.map(member, range(2)))
    assert all("timeout" in outcome.lower() for outcome in outcomes), outcomes
    assert time.monotonic() - start >= wait.total_seconds()
