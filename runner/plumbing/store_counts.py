"""The control plane's cost counted at its source: store operations and new connections, per process.

Off unless the environment variable ``RUNNER_STORE_COUNTS`` names a directory (``bench/recovery.py --world``
sets it); then nothing else changes. When it is set, every store client ``runner.plumbing.protocol`` opens is a
``CountingStore``, and each process appends one line per event to ``<dir>/<pid>.tsv``:

    <wall time> TAB <what> TAB <key class> TAB <keys> TAB <thread>

``what`` is a store operation (``set``, ``get``, ``add``, ``check``, ``wait``, ``multi_get``, ...), ``connect``
(a new store client: one TCP connection), or ``sockets`` (the sockets a generation's groups opened, from
``/proc/self/fd``: gloo's connections to its peers, made when a collective first uses a pair). The key class
is ``pg`` for a member's arrival at a generation's group rendezvous, ``gloo`` for gloo's own rendezvous keys
under it (PrefixStore hands them down to this store), else the key's first path component (``hb``, ``gen``,
``agent``, ...); ``keys`` is how many keys the operation carried. Lines are written unbuffered at once,
so a SIGKILLed process leaves what it did; the reader sums them over any time window (a recovery's phases,
fault-free steps).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Optional, TypeVar, cast

import torch.distributed as dist

ENV = "RUNNER_STORE_COUNTS"
_files: dict[tuple[int, str], int] = {}  # (pid, directory) -> its record file (a forked child opens its own)


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def record(what: str, key_class: str = "", keys: int = 1) -> None:
    """Append one line to this process's record file (counting must be on)."""
    pid, directory = os.getpid(), os.environ[ENV]
    fd = _files.get((pid, directory))
    if fd is None:
        fd = _files[pid, directory] = os.open(os.path.join(directory, f"{pid}.tsv"),
                                              os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    line = f"{time.time():.6f}\t{what}\t{key_class}\t{keys}\t{threading.current_thread().name}\n"
    os.write(fd, line.encode())


StoreT = TypeVar("StoreT", bound=dist.Store)


def counted(store: StoreT) -> StoreT:
    """``store`` (a new client connection), wrapped in a CountingStore when counting is on. The wrapper passes
    on every attribute it does not count (a TCPStore's ``port``), so callers keep the type they opened."""
    if not enabled():
        return store
    record("connect", "store")
    return cast(StoreT, CountingStore(store))


def _key_class(key: str) -> str:
    """``pg``: a member's arrival at a generation's group rendezvous (``Comm._arrive``); ``gloo``: gloo's own
    rendezvous keys under it; ``agent_hb``: an agent's heartbeat, and under ``heartbeat.route=agent`` the record of its
    ranks (driven by the clock and the steps, unlike the rest of an agent's keys: its commands, acknowledgements, exit
    reports and notices); else the key's first path component."""
    parts = key.lstrip("/").split("/")
    if parts[0] == "pg":
        return "pg" if "arrived" in parts else "gloo"
    if parts[0] == "agent" and parts[-1] in ("hb", "ranks"):
        return "agent_hb"
    return parts[0]


class CountingStore(dist.Store):
    """A store that records each operation, then lets ``inner`` carry it out. It is a ``dist.Store``, so that
    a PrefixStore over it (a generation's group, and gloo's rendezvous inside it) is counted too."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner

    def __getattr__(self, name: str):  # what the TCPStore has besides the Store API (port, host, ...)
        return getattr(self.__dict__["inner"], name)

    def set(self, key: str, value) -> None:
        record("set", _key_class(key))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        record("get", _key_class(key))
        return self.inner.get(key)

    def add(self, key: str, value: int) -> int:
        record("add", _key_class(key))
        return self.inner.add(key, value)

    def compare_set(self, key: str, expected, desired) -> bytes:
        record("compare_set", _key_class(key))
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        record("delete_key", _key_class(key))
        return self.inner.delete_key(key)

    def check(self, keys: list[str]) -> bool:
        record("check", _key_class(keys[0]) if keys else "", len(keys))
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: Optional[timedelta] = None) -> None:
        record("wait", _key_class(keys[0]) if keys else "", len(keys))
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        record("multi_get", _key_class(keys[0]) if keys else "", len(keys))
        return self.inner.multi_get(keys)

    def num_keys(self) -> int:
        record("num_keys")
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


class SocketsOpened:
    """The sockets this process opened since construction or the last ``record()``, counted from /proc/self/fd:
    a generation's connections to its peers, opened by its groups' builds and, gloo groups being lazily
    connected, by the collectives that first use each pair. Does nothing when counting is off."""

    def __init__(self) -> None:
        self.before = socket_inodes() if enabled() else None

    def record(self) -> None:
        if self.before is not None:
            now = socket_inodes()
            if now - self.before:
                record("sockets", "gloo", len(now - self.before))
            self.before = now


def socket_inodes() -> set[str]:
    """The sockets this process holds now, by inode (from /proc/self/fd)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:"):
            out.add(target)
    return out


# -- reading the records ---------------------------------------------------------------------------------
PHASES = (("detect", "t_fault", "t_detect"), ("decide", "t_detect", "t_decide"),
          ("replace", "t_decide", "t_replacement_ready"), ("rebuild", "t_replacement_ready", "t_group_formed"),
          ("restore", "t_group_formed", "t_first_commit"))


def load(directory: str | os.PathLike) -> list[tuple[float, str, str, int]]:
    """Every process's records under ``directory``: (time, what, key class, keys), in time order."""
    out = []
    for name in os.listdir(directory):
        with open(os.path.join(directory, name)) as f:
            for line in f:
                t, what, key_class, keys, _thread = line.rstrip("\n").split("\t")
                out.append((float(t), what, key_class, int(keys)))
    return sorted(out)


def tally(records: list[tuple[float, str, str, int]], t0: float, t1: float) -> dict[str, int]:
    """What every process did in [t0, t1): store operations (``arrival_ops``: members arriving at a group's
    rendezvous; ``gloo_ops``: gloo's own rendezvous; ``group_ops``: both; ``other_ops``: everything else), the
    keys the group operations carried, and new connections (``store_clients`` opened, ``group_sockets``
    opened by the groups: their builds and first uses)."""
    out = dict.fromkeys(("store_ops", "arrival_ops", "gloo_ops", "other_ops", "group_keys", "store_clients",
                         "group_sockets"), 0)
    for t, what, key_class, keys in records:
        if not t0 <= t < t1:
            continue
        if what == "connect":
            out["store_clients"] += 1
        elif what == "sockets":
            out["group_sockets"] += keys
        else:
            out["store_ops"] += 1
            out[{"pg": "arrival_ops", "gloo": "gloo_ops"}.get(key_class, "other_ops")] += 1
            out["group_keys"] += keys if key_class in ("pg", "gloo") else 0
    out["group_ops"] = out["arrival_ops"] + out["gloo_ops"]
    out["connections"] = out["store_clients"] + out["group_sockets"]
    return out


def by_phase(records: list[tuple[float, str, str, int]], recovery: dict) -> dict[str, dict[str, int]]:
    """``tally`` over each RTO phase of one summary.json recovery entry, and over the whole recovery."""
    out = {name: tally(records, recovery[a], recovery[b]) for name, a, b in PHASES}
    out["recovery"] = tally(records, recovery["t_fault"], recovery["t_first_commit"])
    return out
