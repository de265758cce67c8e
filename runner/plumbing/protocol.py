"""The control-plane protocol between the controller, the node agents and the workers, carried by a TCPStore.

Node agents (runner.agents; one process per host, reached only through the store):
  agents/config       the digest of the config file the agents run, signed by the controller (runner.agents.auth)
  agent/<n>           node n's agent registered (JSON: node, pid, host); agent/<n>/refused: why it would not start
  agent/<n>/hb        the agent's heartbeat: when it last beat (time.time() on its host)
  agent/<n>/cmds, agent/<n>/cmd/<i>   counter and the i-th command to the agent (signed JSON)
  agent/<n>/ack/<i>   the agent carried out command i (a spawn's: the worker's pid)
  agent/<n>/exits, agent/<n>/exit/<k>  counter and the k-th worker exit the agent saw (JSON: wid, code, t);
                      the controller ends the list with {"end": true} once the agent is gone
  fenced/node/<n>     node n was declared lost (signed JSON: node, reason, gen): once lost, a host stays lost; its
                      agent, heard again (a link healed, a process resumed), kills its workers and exits non-zero

Keys (all under the job's store, or a namespace of it under torchrun):
  gen                 latest generation number (decimal string), written after gen/<g>
  gen/<g>             the Layout of generation g (JSON)
  cut_off/<g>         members of generation g were lost silently (a host's heartbeat stopped): its collectives
                      are given up on, not waited out (the controller's reason)
  pg/<g>/...          generation g's process-group rendezvous (a PrefixStore: arrived/<rank> first)
  ready/<wid>         a replacement finished its start-up and can join
  hb/<wid>            heartbeat payload (JSON: seq, step, phase, rss, t, timing: the newest steps' timings)
  reports, report/<n> counter and the n-th symptom a worker reported (JSON)
  fault/claim/<i>     counter that makes fault i fire once per job
  fault/hit/<i>       fault i's victim reached its trigger point (JSON)
  fault/released/<i>  the controller carried fault i out
  restart/<g>/held/<r> the snapshot steps logical rank r, restarted into generation g, holds (JSON list): where no
                      rank holds one (the fault struck before the first), every rank starts where the run did
  resume/held/<r>     the same, for a launcher's restart of a failed attempt (runner.launch.external)
  done/<wid>          a worker finished training (JSON: step, checksum, logical rank); counter done_count
  fenced/worker/<wid> worker wid was written off (JSON: wid, logical, gen, reason): heard again, it exits at once
  released/<wid>      worker wid was released in a planned hand-over (a straggler's ranks moved, or its process
                      restarted: JSON wid, logical, gen, recovery, reason): it leaves cleanly at its next regroup
  abort               the run is over (controller to all): the reason
  stop                checkpoint at the next committed step and stop (controller to all, on SIGINT/SIGTERM)
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field, fields
from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore

from runner.plumbing.store_counts import counted

STOP = "stop"


def cut_off_key(gen: int) -> str:
    return f"cut_off/{gen}"


def node_fence_key(node: int) -> str:
    """Node ``node`` was declared lost: its agent must not act again (signed by the controller)."""
    return f"fenced/node/{node}"


def worker_fence_key(wid: int) -> str:
    """Worker ``wid`` was written off: it must not act again."""
    return f"fenced/worker/{wid}"


def released_key(wid: int) -> str:
    """Worker ``wid`` was released (``runner.control.handover``): it ends its training cleanly, exit code 0."""
    return f"released/{wid}"


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
        """Its fields as they are (``dataclasses.asdict`` deep-copies every list: 0.1 s at 16,384 members)."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})

    @staticmethod
    def from_json(raw: bytes | str) -> Layout:
        return Layout(**json.loads(raw))


AGENT_CONFIG = "agents/config"
AGENT_CONFIG_FILE = "agent_config.json"  # in the run dir: the config the agents run, written before they start


def agent_key(node: int, *parts: object) -> str:
    """A key of node ``node``'s agent: ``agent/<node>/<parts...>``."""
    return "/".join(["agent", str(node), *map(str, parts)])


def host_store(host: str, timeout_s: float) -> TCPStore:
    """The job's store, listening on ``host`` only (TCPStore itself listens on every interface). Here and in
    ``connect``, a client is counted when ``RUNNER_STORE_COUNTS`` is set (``runner.plumbing.store_counts``)."""
    listener = socket.create_server((host, 0), backlog=1024)
    port = listener.getsockname()[1]
    return counted(TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
                            master_listen_fd=listener.detach()))


def connect(host: str, port: int, timeout_s: float, namespace: str = ""):
    """A client connection to the job's store (one per thread that uses it), inside ``namespace``."""
    store = counted(TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False))
    return PrefixStore(namespace, store) if namespace else store


def get_json(store: TCPStore, key: str) -> dict:
    return json.loads(store.get(key))


def set_json(store: TCPStore, key: str, value: dict) -> None:
    store.set(key, json.dumps(value))


def latest_layout(store: TCPStore, at_least: int = 0) -> Layout:
    """The newest generation; ``gen/<g>`` is written before ``gen``, so trust what the caller saw too."""
    gen = max(int(store.get("gen")), at_least)
    return Layout.from_json(store.get(f"gen/{gen}"))


def steps_held_by_each_rank(store, key: str, rank: int, world: int, held: list[int], timeout_s: float) -> list[set]:
    """Every rank's ``held`` steps, each published under ``<key>/<rank>``: the ranks of a restart choose its starting
    point from the same table, so all of them choose alike."""
    store.set(f"{key}/{rank}", json.dumps(sorted(held)))
    keys = [f"{key}/{r}" for r in range(world)]
    store.wait(keys, timedelta(seconds=timeout_s))
    return [set(json.loads(raw)) for raw in store.multi_get(keys)]


def report(store: TCPStore, payload: dict) -> None:
    """Append a symptom for the controller (atomic counter, then the record)."""
    n = store.add("reports", 1)
    set_json(store, f"report/{n}", payload)


def read_refusal(store, node: int) -> str:
    """Node ``node``'s agent's refusal, acknowledged: the agent waits for that before it exits."""
    why = store.get(agent_key(node, "refused")).decode()
    store.set(agent_key(node, "refusal_read"), "1")
    return why
