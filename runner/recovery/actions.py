"""What a recovery technique offers the controller: one typed interface per policy action.

Each technique's package holds its controller-side action(s) in ``action.py``; ``runner/recovery/registry.py``
maps the ``ft`` names to them. The decision asks an action's ``obstacle`` (can it act on this fault now, and
why not) as a pure function of a ``Situation``; the controller builds one instance per action of the run's
mix and calls its hooks generically, so neither names a technique.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Protocol

if TYPE_CHECKING:
    from runner.control.context import RunContext
    from runner.control.decision import Decision
    from runner.planning.topology import Topology

@dataclass(frozen=True)
class NodePersist:
    """A node service a technique asks every node agent to run beside its workers (flash_ckpt's persister):
    where to write, how many files to keep, where to log, and how to start it."""

    job_id: str
    out_dir: Path
    keep: int
    events_path: Path
    start: str
    """``module:function`` that starts it from the agent's fork server, ``f(fork_server, spec, node)``, and returns
    once it serves: a ``NodeService``. The agent imports it by name, so it imports no technique."""


class NodeService(Protocol):
    """The agent's side of a running node service: stopped when the agent ends, killed with its node."""

    def stop(self, timeout_s: float = ...) -> None: ...

    def kill(self) -> None: ...


class SavedState(Protocol):
    """What a technique saved of each rank that outlives the rank's process (snapshots in host memory, files on disk):
    a restarted attempt of a torchrun job agrees on a step every rank holds (``held_steps``), and a resume takes a
    newer verified file than last.ckpt where one rank's file is the whole model (``newest_whole_model_file``)."""

    def held_steps(self, run_dir: Path, rank: int) -> list[int]: ...

    def newest_whole_model_file(self, ckpt_dir: Path, newer_than: int) -> Optional[Path]: ...


class HostMemory(Protocol):
    """What a technique keeps in a host's memory (flash_ckpt's snapshot segments), as the faults that take a node's or
    the host's memory away, or corrupt it, reach it (``runner.faults.injector``); the counts are what was lost."""

    def drop_node(self, ranks: list[int]) -> list[Path]: ...

    def drop_host(self) -> list[Path]: ...

    def corrupt_newest(self, rank: int) -> int: ...


LAUNCHER_OWNS = ("under torchrun/SLURM the launcher owns the processes, so the job ends here for the launcher "
                 "to restart it (torchrun --max-restarts); run without torchrun/srun for in-place restarts")


@dataclass(frozen=True)
class Situation:
    """What the decision knows when it asks whether an action can act: the fault's victims (logical
    ranks) and the resources left, as ``runner.control.decision.decide`` received them."""

    ft: list[str]
    cfg: Any  # DictConfig
    can_restart: bool
    victims: list[int]
    lost_nodes: list[int]
    restarts_left: int
    spares: int = 0
    full_restarts_left: int = 0
    nodes_up: Optional[int] = None
    no_snapshots: list[int] = field(default_factory=list)


class RecoveryAction:
    """One action of the policy table, as the controller carries it out.

    ``name`` is its name in the policy table and ``does`` the phrase a decision's reason quotes.
    ``obstacle`` is pure (the simulator and the config check call it through ``decide``); the other
    hooks run in the controller with the run's ``RunContext`` and do nothing unless a technique needs them.
    An instance holds the technique's own controller-side state for one run.
    """

    name: ClassVar[str]
    does: ClassVar[str]
    handles: ClassVar[tuple[str, ...]]  # the fault classes (runner/config/policy.py) a policy row may give it
    publishes_survivors: ClassVar[bool] = True  # False: no survivors-only generation (nobody holds state)

    def __init__(self, cfg, topo: Topology, run_dir: Path) -> None:
        self.cfg, self.topo, self.run_dir = cfg, topo, run_dir

    @staticmethod
    def obstacle(s: Situation) -> Optional[str]:
        """Why this action cannot act on the fault now; None when it can."""
        return None

    def act(self, ctx: RunContext, decision: Decision, lost_nodes: list[int]) -> None:
        """Carry the decision out: spawn, assign or restart; the controller publishes afterwards."""

    # -- hooks the controller calls on every action of the run ---------------------------------------
    def worker_preload(self) -> list[str]:
        """Modules the workers' fork server imports ahead (before any worker exists)."""
        return []

    def node_persister(self) -> Optional[NodePersist]:
        """A process each node agent runs beside its workers, if the action needs one."""
        return None

    def host_memory(self) -> Optional[HostMemory]:
        """What the technique keeps in host memory, for the faults that take it away or corrupt it; None: nothing."""
        return None

    def on_start(self, ctx: RunContext) -> None:
        """The initial workers are spawned; the first generation is not yet published."""

    def on_exit(self, ctx: RunContext, wid: int, code: int) -> bool:
        """A worker exited; True when it was the action's own (no symptom)."""
        return False

    def on_nodes_lost(self, ctx: RunContext, nodes: list[int]) -> None:
        """The decision is about to write ``nodes`` off."""

    def on_host_joined(self, ctx: RunContext, node: int) -> None:
        """A host started later joined the running job as node ``node`` (``launcher.join``): its agent registered,
        nothing runs on it yet."""

    def decide_inputs(self, ctx: RunContext, lost_nodes: list[int]) -> dict:
        """The ``decide`` keywords this action's resources set (budgets, spares...)."""
        return {}

    def poll(self, ctx: RunContext, now: float) -> None:
        """Once per controller round: work the action paces itself."""

    def busy(self) -> bool:
        """Work of this action is still under way (a fault injected now would mix with it)."""
        return False

    def on_every_rank_restarted(self) -> None:
        """Every rank was restarted: forget work in flight for ranks that no longer exist."""

    def on_end(self, ctx: RunContext) -> None:
        """Every worker is gone."""
