"""NDB as the runner sees it: a live data-parallel neighbour computes a failed rank's micro-batches too."""

from __future__ import annotations

from runner.recovery.ndb.action import Takeover
from runner.recovery.ndb.config import NDBConfig
from runner.recovery.technique import Technique

TECHNIQUE = Technique(
    name="ndb",
    title="NDB",
    options=NDBConfig,
    actions=(Takeover,),
    worker="runner.recovery.ndb.worker:NDBWorker",
    covers_ranks=True,
    checks="runner.recovery.ndb.checks:config_problems",
)
