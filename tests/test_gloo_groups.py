"""The runner's gloo groups connect eagerly, whatever ``TORCH_GLOO_LAZY_INIT`` says: a lazily connected group can
block forever when it is dropped after a failed collective (docs/recovery.md, "Why lazy gloo groups stay off")."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore

from runner.comm import _gloo_group
from runner.store_counts import socket_inodes


def test_a_group_is_connected_when_built_even_with_lazy_init_asked_for(monkeypatch):
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    server = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    clients = [TCPStore("127.0.0.1", server.port, 1, False) for _ in range(2)]  # one each: a wait holds its client
    for client in clients:
        client.add("connected", 1)  # a round trip: the server has accepted this client before the count starts
    before = socket_inodes()
    wait = timedelta(seconds=10)
    with ThreadPoolExecutor(2) as pool:  # both members of a two-member group, in this process
        groups = list(pool.map(lambda rank: _gloo_group(PrefixStore("g/", clients[rank]), rank, 2, wait, wait),
                               (0, 1)))
    opened = len(socket_inodes() - before)
    assert opened >= 4, opened  # a listener per member and both ends of their connection; lazily: the listeners
    del groups
