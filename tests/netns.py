"""Hosts of their own on one machine for the tests: one network namespace per host, each with its own address
on a bridge, so that a host can be cut off (its link taken down) without any connection being reset.

Needs root and iproute2's ``ip``; ``skip_reason`` says why not when either is missing. Every name carries
this process's id, and ``close`` removes everything ``__enter__`` made, also after a failure halfway.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional


def skip_reason() -> Optional[str]:
    """Why network namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """``n`` namespaces on a bridge, host ``i`` at ``address(i)`` on its interface ``IFNAME``."""

    IFNAME = "eth0"  # the host's side of its veth pair, inside its namespace

    def __init__(self, n: int) -> None:
        tag = os.getpid() % 100000
        self.n, self.tag = n, tag
        self.bridge = f"rrb{tag}"
        self.subnet = f"10.{200 + tag % 50}.{tag % 250}"
        self._made: list[tuple[str, ...]] = []  # undo commands, in the order things were made

    def ns(self, i: int) -> str:
        return f"rr{self.tag}n{i}"

    def veth(self, i: int) -> str:
        """The bridge's side of host ``i``'s link, in the root namespace: down means the host is cut off."""
        return f"rr{self.tag}v{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def __enter__(self) -> Hosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", "del", self.bridge))
            _ip("link", "set", self.bridge, "up")
            for i in range(self.n):
                ns, veth = self.ns(i), self.veth(i)
                _ip("netns", "add", ns)
                self._made.append(("netns", "del", ns))
                _ip("link", "add", veth, "type", "veth", "peer", "name", f"rr{self.tag}p{i}")
                self._made.append(("link", "del", veth))
                _ip("link", "set", f"rr{self.tag}p{i}", "netns", ns)
                _ip("-n", ns, "link", "set", f"rr{self.tag}p{i}", "name", self.IFNAME)
                _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", self.IFNAME)
                _ip("-n", ns, "link", "set", self.IFNAME, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def exec_prefix(self, i: int) -> list[str]:
        """What runs a command on host ``i``."""
        return ["ip", "netns", "exec", self.ns(i)]

    def cut_off(self, i: int) -> None:
        """Host ``i``'s link goes down: its packets go nowhere, and nothing tells its peers."""
        _ip("link", "set", self.veth(i), "down")

    def partition(self, i: int) -> None:
        """Both ends of host ``i``'s link go down (a cable pulled): nothing is reset, and its connections stay
        open on either side, waiting for the link to come back."""
        _ip("link", "set", self.veth(i), "down")
        _ip("-n", self.ns(i), "link", "set", self.IFNAME, "down")

    def heal(self, i: int) -> None:
        """Host ``i``'s link comes back on both ends: TCP's retransmissions resume the connections of either
        side that nobody closed meanwhile."""
        _ip("-n", self.ns(i), "link", "set", self.IFNAME, "up")
        _ip("link", "set", self.veth(i), "up")

    def unreachable(self, i: int, j: int) -> None:
        """Host ``i`` loses its route to host ``j`` (a broken path between two hosts, each fine with the rest): its
        connections to ``j``'s address fail at once with "No route to host". Gone with ``i``'s namespace."""
        _ip("-n", self.ns(i), "route", "add", "unreachable", f"{self.address(j)}/32")

    def close(self) -> None:
        for undo in reversed(self._made):
            subprocess.run(["ip", *undo], capture_output=True)  # a veth goes with its namespace too
        self._made = []
