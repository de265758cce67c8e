"""A host started later joins a running ``launcher.mode=per_host`` job as a spare host: both sides of the exchange.

torchrun restarts every worker when a node enters its rendezvous, so a late host never enters it: it reaches
the controller's store directly (``launcher.join=HOST:PORT``). It draws a ticket (``join/tickets``), writes a
request signed with the job's secret that carries its config file's digest (``join/<ticket>``) and awaits the
answer (``join/<ticket>/answer``). The controller's side, ``HostJoins``, polled with the heartbeats, refuses a
request whose MAC does not verify (another secret, or a request copied under another ticket) or whose digest
differs from the config the controller signed: it logs ``join_refused`` with the reason and answers with it.
Otherwise it grants the next node index (a signed answer); the host then runs a node agent under that index,
which checks the controller's signed digest and registers as every agent does, and once it has registered the
controller adopts it into its fleet and logs ``host_joined``. No generation is published: the training ranks
never notice the join.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

from torch.distributed import DistStoreError

from runner.agents import auth
from runner.plumbing import protocol

TICKETS = "join/tickets"


class JoinRefused(Exception):
    """The controller refused this host, or never answered; the message says why."""


def request_key(ticket: int, *parts: str) -> str:
    return "/".join(["join", str(ticket), *parts])


def request_node(store, secret: bytes, config_digest: str, timeout_s: float) -> int:
    """The joining host's side: the node index the controller grants it (``JoinRefused`` with the reason)."""
    ticket = store.add(TICKETS, 1)
    store.set(request_key(ticket), auth.sign(secret, {"ticket": ticket, "sha256": config_digest,
                                                      "host": socket.gethostname(), "pid": os.getpid()}))
    answer = request_key(ticket, "answer")
    try:
        store.wait([answer], timedelta(seconds=timeout_s))
    except DistStoreError as e:
        raise JoinRefused(f"the controller did not answer within launcher.start_timeout_s={timeout_s:g} (is "
                          "launcher.join the control-plane address of a running launcher.mode=per_host job?)") from e
    raw = store.get(answer)
    granted = auth.verify(secret, raw)
    if granted is not None and granted.get("ticket") == ticket:
        return int(granted["node"])
    try:
        refused = json.loads(raw)["refused"]
    except (ValueError, TypeError, KeyError):
        refused = "the controller's answer does not carry a valid MAC for this job's secret"
    raise JoinRefused(refused)


@dataclass
class _Granted:
    """A join granted a node index, until its agent registers."""

    ticket: int
    node: int
    deadline: float


class HostJoins:
    """The controller's side: hands late hosts their node index and adopts their agents into ``fleet`` once they
    registered. ``poll`` serves one join at a time, so node indices follow the fleet's."""

    def __init__(self, store, fleet, events, address: tuple[str, int], timeout_s: float) -> None:
        self.store, self.fleet, self.events = store, fleet, events
        self.address, self.timeout_s = address, timeout_s
        self.served = 0  # tickets answered
        self.first_seen: Optional[float] = None  # when the next ticket was drawn without its request yet
        self.granted: Optional[_Granted] = None

    def poll(self) -> list[int]:
        """The nodes whose agents joined since the last poll (registered and adopted into the fleet)."""
        joined = []
        while True:
            if self.granted is not None:
                node = self._registered()
                if node is not None:
                    joined.append(node)
                if self.granted is not None:  # its agent is still starting
                    return joined
            if self.store.add(TICKETS, 0) <= self.served or not self._serve(self.served + 1):
                return joined

    def _serve(self, ticket: int) -> bool:
        """Answer ticket ``ticket``; False while its request is not written yet."""
        key = request_key(ticket)
        if not self.store.check([key]):
            now = time.monotonic()
            self.first_seen = self.first_seen or now
            if now - self.first_seen < self.timeout_s:
                return False
            self._refuse(ticket, {}, "the host drew a ticket but wrote no request")
            return True
        self.first_seen = None
        raw = self.store.get(key)
        body = auth.verify(self.fleet.secret, raw)
        if body is None:
            self._refuse(ticket, {}, "its request does not carry a valid MAC for this job's secret")
        elif body.get("ticket") != ticket:
            self._refuse(ticket, body, f"its request was signed for ticket {body.get('ticket')}, not this one "
                                       "(a replay)")
        elif body.get("sha256") != self.fleet.config_digest:
            self._refuse(ticket, body, "its config differs from the one the controller signed (a joining host "
                                       "runs the job's command with the same overrides, hydra.run.dir included, "
                                       "plus launcher.join)")
        else:
            node = len(self.fleet.agents)
            self.granted = _Granted(ticket, node, time.monotonic() + self.timeout_s)
            self.store.set(request_key(ticket, "answer"),
                           auth.sign(self.fleet.secret, {"ticket": ticket, "node": node}))
        self.served = ticket
        return True

    def _registered(self) -> Optional[int]:
        """The granted node once its agent registered (adopted now); None while it is still starting."""
        granted = self.granted
        assert granted is not None
        if self.store.check([protocol.agent_key(granted.node)]):
            self.granted = None
            self.fleet.adopt(granted.node)
            record = protocol.get_json(self.store, protocol.agent_key(granted.node))
            self.events.emit("host_joined", node=granted.node, pid=record["pid"], host=record["host"],
                             control_store=f"{self.address[0]}:{self.address[1]}", role="late_spare")
            return granted.node
        refused = protocol.agent_key(granted.node, "refused")
        if self.store.check([refused]):
            why = protocol.read_refusal(self.store, granted.node)
        elif time.monotonic() > granted.deadline:
            why = f"did not register within launcher.start_timeout_s={self.timeout_s:g}"
        else:
            return None
        self.granted = None
        self.fleet.adopt(granted.node, registered=False)  # its index is spent: no later host takes it
        self.events.emit("join_failed", ticket=granted.ticket, node=granted.node, reason=why)
        return None

    def _refuse(self, ticket: int, body: dict, reason: str) -> None:
        self.events.emit("join_refused", ticket=ticket, host=body.get("host"), pid=body.get("pid"), reason=reason)
        protocol.set_json(self.store, request_key(ticket, "answer"), {"refused": reason})
