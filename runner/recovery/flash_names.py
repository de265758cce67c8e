"""How the runner names and pairs flash checkpoints: one job id per run, one partner per node.

The job id must be the same for every incarnation of a rank within a run (a restarted rank finds
its predecessor's snapshots by it) and different between runs (segments of two runs on one host
never mix), so it is derived from the run directory. Nodes are paired (0-1, 2-3, ...; an odd last
node pairs with node 0): each rank's snapshot is copied into the memory of the rank with the same
local rank on the partner node, so losing one node leaves a copy of everything it held.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional


def flash_job_id(run_dir: str | Path) -> str:
    digest = hashlib.blake2b(str(Path(run_dir).resolve()).encode(), digest_size=8).hexdigest()
    return f"rr-{digest}"


def partner_node(node: int, nodes: int) -> Optional[int]:
    """The node that holds copies of `node`'s snapshots; None on a single node."""
    if nodes < 2:
        return None
    other = node ^ 1
    return other if other < nodes else 0


def partner_rank(rank: int, nodes: int, procs_per_node: int) -> Optional[int]:
    """The logical rank whose memory keeps a copy of `rank`'s snapshots (same local rank, partner node)."""
    node, local = divmod(rank, procs_per_node)
    other = partner_node(node, nodes)
    return None if other is None else other * procs_per_node + local
