"""Where a worker's heartbeat goes under ``heartbeat.route=agent``: its host's node agent's Unix datagram socket,
named in ``BEAT_SOCKET_ENV`` by the agent that started it (``runner.agents.beat_relay``). The name is abstract (no
file to leave behind) and holds the agent's pid: in the simulation every host's agent shares one network namespace."""

from __future__ import annotations

BEAT_SOCKET_ENV = "RUNNER_BEAT_SOCKET"  # the agent's socket name, without the abstract namespace's leading NUL
MAX_DATAGRAM = 65536


def socket_address(name: str) -> str:
    """The abstract-namespace address of a socket ``name`` (Linux: no file, gone with its process)."""
    return "\0" + name
