"""The store a gloo group's rendezvous reads through: every member's address in one batched read.

Gloo's rendezvous (torch 2.13.0+cpu) publishes this member's address under ``<device>/<rank>`` with one ``set``
and reads a peer's with a ``wait`` for its key (with the rendezvous timeout) and a ``get``: for each rank 0 .. N - 1
in turn, its own included, while the group is built when its pairs connect eagerly (``connectFullMesh``: 2N + 1
store operations per member, O(N²) per group), or, connected lazily as the runner's groups are
(``comm.GlooGroup``), when a collective first uses the pair to that peer. Gloo's own batched read
(``GLOO_ENABLE_STORE_V2_API``) would ``multi_get`` the keys with no ``wait``, bounded by the store client's
timeout instead of the rendezvous's, and only when a process-wide environment variable says so.

``BatchedAddressStore`` answers gloo's first ``wait`` for a device's address key with one ``wait`` for all N of
them (gloo's own timeout: a member that dies before publishing fails the first use at it) and one ``multi_get``,
and the remaining waits and gets from what that read: 3 store operations per member (set, wait, multi_get)
whatever N, O(N) per group. Each member's address is written once under a group's prefix and never changed, so
serving it from what was read is exact. Gloo makes no other store call for a group
(tests/test_gloo_rendezvous.py checks the sequence).
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Optional

import torch.distributed as dist


class BatchedAddressStore(dist.Store):
    """``inner`` (a group's store, its prefix included) as gloo's rendezvous of ``size`` members reads it."""

    def __init__(self, inner: dist.Store, size: int) -> None:
        super().__init__()
        self.inner, self.size = inner, size
        self.addresses: dict[str, bytes] = {}  # every member's address, by gloo's key, once a device's were read

    def _device(self, key: str) -> Optional[str]:
        """The device of one of gloo's address keys (``<device>/<rank>``), None for any other key."""
        device, _, rank = key.rpartition("/")
        return device if device.isdigit() and rank.isdigit() and int(rank) < self.size else None

    def _read(self, device: str, timeout: Optional[timedelta]) -> None:
        """Every member's address on ``device``: one wait for them all, one multi_get."""
        keys = [f"{device}/{rank}" for rank in range(self.size)]
        _wait(self.inner, keys, timeout)
        self.addresses.update(zip(keys, self.inner.multi_get(keys)))

    def set(self, key: str, value) -> None:
        self.inner.set(key, value)

    def wait(self, keys: list[str], timeout: Optional[timedelta] = None) -> None:
        devices = [self._device(key) for key in keys if key not in self.addresses]
        if None in devices:  # not only gloo's address keys: as asked
            _wait(self.inner, keys, timeout)
            return
        for device in {device for device in devices if device is not None}:
            self._read(device, timeout)

    def get(self, key: str) -> bytes:
        if key not in self.addresses:
            device = self._device(key)
            if device is None:
                return self.inner.get(key)
            self._read(device, None)  # waits as long as a get would: the store's timeout
        return self.addresses[key]


def _wait(store: dist.Store, keys: list[str], timeout: Optional[timedelta]) -> None:
    """``store.wait`` for ``keys``, with the store's own timeout when ``timeout`` is None."""
    if timeout is None:
        store.wait(keys)
    else:
        store.wait(keys, timeout)


def published_address(blob: bytes) -> tuple[str, str, int]:
    """(host name, IP, port) of the listener a gloo member published for its group (the value of its
    ``<device>/<rank>`` key): gloo's tcp ``Rank`` record, a length-prefixed host name then a length-prefixed
    ``Address`` (a ``sockaddr_storage`` and a sequence number), little-endian lengths. The listener is where its
    peers connect to it: what ``runner.training.health`` checks a joining spare can reach. Raises ValueError on a
    record of another layout (a gloo that changed it)."""
    def field(at: int) -> tuple[bytes, int]:
        if at + 8 > len(blob):
            raise ValueError(f"a gloo address record of {len(blob)} bytes ends inside a length at byte {at}")
        size = int.from_bytes(blob[at:at + 8], "little")
        if at + 8 + size > len(blob):
            raise ValueError(f"a gloo address record of {len(blob)} bytes ends inside a {size}-byte field")
        return blob[at + 8:at + 8 + size], at + 8 + size

    host, at = field(0)
    sockaddr, _ = field(at)
    family = int.from_bytes(sockaddr[:2], "little")
    port = int.from_bytes(sockaddr[2:4], "big")
    if family == socket.AF_INET and len(sockaddr) >= 8:
        return host.decode(), socket.inet_ntop(socket.AF_INET, sockaddr[4:8]), port
    if family == socket.AF_INET6 and len(sockaddr) >= 24:
        return host.decode(), socket.inet_ntop(socket.AF_INET6, sockaddr[8:24]), port
    raise ValueError(f"a gloo address record with address family {family}: not IPv4 or IPv6")
