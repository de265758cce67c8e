"""Which live data-parallel peer takes over a failed rank's micro-batch (``ndb.neighbour``)."""

from __future__ import annotations

from collections.abc import Sequence


def neighbour_of(failed: int, live: Sequence[int], policy: str) -> int:
    """The first live rank after (``ring_next``) or before (``ring_prev``) ``failed`` in ring order.

    ``live`` holds the DP group's surviving ranks; skipping dead ranks keeps the choice defined when
    the adjacent rank is down too.
    """
    if not live:
        raise ValueError(f"no live data-parallel rank can take over rank {failed}.")
    if failed in live:
        raise ValueError(f"rank {failed} is listed as both failed and live.")
    ring = sorted(live)
    if policy == "ring_next":
        return next((r for r in ring if r > failed), ring[0])
    if policy == "ring_prev":
        return next((r for r in reversed(ring) if r < failed), ring[-1])
    raise ValueError(f"unknown ndb.neighbour policy {policy!r}: use ring_next or ring_prev.")
