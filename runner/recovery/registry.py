"""The registry: which controller-side actions each fault-tolerance strategy in ``ft`` brings.

Adding a technique is adding its package with an ``action.py`` and one line here. An action two
strategies provide (an in-place restart: FlashRecovery's, which DeadPool uses for crashes too) is one
class listed under both; ``runner/config/policy.py`` states the same providers for the config check.
"""

from __future__ import annotations

from pathlib import Path

from runner.planning.topology import Topology
from runner.recovery.actions import RecoveryAction
from runner.recovery.deadpool.action import SwapSpare
from runner.recovery.flash_ckpt.action import RestartAll
from runner.recovery.flashrecovery.action import RestartRank, Retry
from runner.recovery.ndb.action import Takeover

BY_TECHNIQUE: dict[str, tuple[type[RecoveryAction], ...]] = {
    "flashrecovery": (Retry, RestartRank),
    "deadpool": (Retry, RestartRank, SwapSpare),
    "ndb": (Takeover,),
    "flash_ckpt": (RestartAll,),
}
# policy action name -> its class (``recompute`` is the workers' guard, not a controller action)
BY_NAME: dict[str, type[RecoveryAction]] = {cls.name: cls for classes in BY_TECHNIQUE.values() for cls in classes}


def build_actions(ft: list[str], cfg, topo: Topology, run_dir: Path) -> dict[str, RecoveryAction]:
    """One instance of every action the mix brings, by policy name, in ``ft`` order."""
    out: dict[str, RecoveryAction] = {}
    for technique in ft:
        for cls in BY_TECHNIQUE[technique]:
            if cls.name not in out:
                out[cls.name] = cls(cfg, topo, run_dir)
    return out


def replicates_shards(ft: list[str]) -> bool:
    """Some strategy in ``ft`` keeps a copy of every ZeRO-1 optimizer shard on another node."""
    return any(cls.replicates_shards for t in ft for cls in BY_TECHNIQUE[t])
