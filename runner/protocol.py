"""The control-plane protocol between the controller and the workers, carried by a TCPStore.

Keys (all under the job's store, or a namespace of it under torchrun):
  gen                 latest generation number (decimal string), written after gen/<g>
  gen/<g>             the Layout of generation g (JSON)
  pg/<g>/...          generation g's process-group rendezvous (a PrefixStore: arrived/<rank> first)
  ready/<wid>         a replacement finished its start-up and can join
  hb/<wid>            heartbeat payload (JSON: seq, step, phase, rss, t)
  reports, report/<n> counter and the n-th symptom a worker reported (JSON)
  fault/claim/<i>     counter that makes fault i fire once per job
  fault/hit/<i>       fault i's victim reached its trigger point (JSON)
  fault/released/<i>  the controller carried fault i out
  done/<wid>          a worker finished training (JSON: step, checksum, logical rank); counter done_count
  abort               the run is over (controller to all): the reason
  stop                checkpoint at the next committed step and stop (controller to all, on SIGINT/SIGTERM)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore

STOP = "stop"


@dataclass
class Layout:
    """One generation's membership: member i of the process group computes logical rank logical[i]."""

    gen: int
    members: list[int]  # worker ids, in process-group rank order
    logical: list[int]  # logical DP rank computed by each member
    dp: int  # logical data-parallel size
    pending: list[int] = field(default_factory=list)  # logical ranks nobody computes yet (survivors-only stage)
    joiners: list[int] = field(default_factory=list)  # worker ids that need state from a replica
    recovery: int = -1  # id of the recovery this generation belongs to (-1: start-up)
    extra: list[list[int]] = field(default_factory=list)  # NDB: logical ranks member i computes besides its own

    def extra_of(self, wid: int) -> list[int]:
        return self.extra[self.pg_rank(wid)] if self.extra else []

    @property
    def takeovers(self) -> int:
        return sum(len(e) for e in self.extra)

    @property
    def complete(self) -> bool:
        return not self.pending

    def pg_rank(self, wid: int) -> int:
        return self.members.index(wid)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(raw: bytes | str) -> Layout:
        return Layout(**json.loads(raw))


def connect(host: str, port: int, timeout_s: float, namespace: str = ""):
    """A client connection to the job's store (one per thread that uses it), inside ``namespace``."""
    store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return PrefixStore(namespace, store) if namespace else store


def get_json(store: TCPStore, key: str) -> dict:
    return json.loads(store.get(key))


def set_json(store: TCPStore, key: str, value: dict) -> None:
    store.set(key, json.dumps(value))


def latest_layout(store: TCPStore, at_least: int = 0) -> Layout:
    """The newest generation; ``gen/<g>`` is written before ``gen``, so trust what the caller saw too."""
    gen = max(int(store.get("gen")), at_least)
    return Layout.from_json(store.get(f"gen/{gen}"))


def report(store: TCPStore, payload: dict) -> None:
    """Append a symptom for the controller (atomic counter, then the record)."""
    n = store.add("reports", 1)
    set_json(store, f"report/{n}", payload)
