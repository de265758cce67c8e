"""The run's collaborators, as the recovery actions and the fault injectors get them in each call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runner.control.detection import Detector
    from runner.control.incidents import Incidents
    from runner.control.membership import Membership
    from runner.planning.topology import Topology
    from runner.plumbing.events import EventLog
    from runner.recovery.actions import RecoveryAction


@dataclass(frozen=True)
class RunContext:
    """Everything a hook may touch: the config, the layout, who is who, the open recovery, the store and
    the fleet (which starts and signals processes), and every action of the run."""

    cfg: Any  # DictConfig
    ft: list[str]
    topo: Topology
    members: Membership
    detector: Detector
    incidents: Incidents
    events: EventLog
    store: Any  # TCPStore, HashStore or a PrefixStore of the launcher's
    fleet: Any  # AgentFleet or ExternalFleet
    actions: tuple[RecoveryAction, ...]
