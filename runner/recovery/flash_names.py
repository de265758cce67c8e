"""How the runner names flash checkpoints: one job id per run.

The job id must be the same for every incarnation of a rank within a run (a restarted rank finds
its predecessor's snapshots by it) and different between runs (segments of two runs on one host
never mix), so it is derived from the run directory. Which node keeps a copy of which
node's snapshots is ``Topology.partner_node``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def flash_job_id(run_dir: str | Path) -> str:
    digest = hashlib.blake2b(str(Path(run_dir).resolve()).encode(), digest_size=8).hexdigest()
    return f"rr-{digest}"
