"""The worker-side hooks a recovery technique plugs into a worker and its training step.

The strategy, the committed-step protocol and the worker name no technique: each technique's
package has a ``worker`` module whose ``TechniqueWorker`` builds the ``WorkerHooks`` it needs
(``runner.recovery.worker_registry`` maps ``ft`` names to them), and the training step calls the
interfaces below.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol

from lightning.pytorch import Callback, LightningModule
from omegaconf import DictConfig
from torch import Tensor

from runner.data import BatchSource
from runner.plumbing.events import EventLog
from runner.training.comm import Comm
from runner.training.status import WorkerStatus
from runner.training.zero import ZeroOne

if TYPE_CHECKING:
    from runner.planning.topology import Topology
    from runner.training.state import ReplicaState


ABANDON_AFTER_S = 1.0
"""How long a recovery waits for an exchange of the broken generation (a shard copy, a snapshot's replica) to end
before it abandons it: such an exchange fails within this once its peer is gone or the group is aborted."""


class ReplicaLost(RuntimeError):
    """A replica's holder cannot produce the requested generation of its partner's state."""


class RecoveryLoop(Protocol):
    """What a technique's worker side may use of the worker's recovery loop (``rejoin.ReplicaRecovery``)."""

    recovery_timeout_s: float
    on_groups_dropped: list[Callable[[], None]]  # work on the dropped generation's groups, ended before a regroup

    def abandon(self, state: ReplicaState, reason: str) -> None:
        """This generation cannot go on here (a restore failed midway): drop its groups and report the symptom, so
        that the controller starts the next one."""


class MicroBatchTakeover(Protocol):
    """Inside a step, a live rank also computes failed ranks' micro-batches (NDB)."""

    def reset(self) -> None:
        """A new step, or a recompute of this one: nothing is taken over yet."""

    def take_over(self, step: int, wanted: list[int], source: Optional[BatchSource], params: list[Tensor]) -> None:
        """Add the gradients of the micro-batches of logical ranks ``wanted`` (and only those) to ``params``."""

    def contributions(self) -> Iterable[tuple[float, list[int]]]:
        """(loss, [sample step, sample rank]) of each micro-batch taken over in this step."""

    def divisor(self, dp: int, takeovers: int) -> Optional[Callable[[Tensor], int]]:
        """How each summed gradient is averaged when ``takeovers`` ranks are covered; None: by ``dp``."""

    def record_step(self, seconds: float) -> None:
        """A committed step took ``seconds`` from its batch to its commit."""


class UpdateReplication(Protocol):
    """Each rank's updated optimizer shard is copied to another rank after every update (DeadPool, ZeRO-1)."""

    replicator: Any  # what recovery reads the replicas from

    def start(self, gen: int) -> None:
        """Copy this rank's shard as it is after ``gen`` updates."""

    def wait_previous(self) -> None:
        """The shard is about to change again: the copy in flight must be complete."""

    def record(self, gen: int) -> None:
        """Before the update producing ``gen``: keep what a replay of it needs."""

    def close(self) -> None:
        """The worker ends: no copy is left in flight."""


@dataclass
class WorkerContext:
    """What a technique's worker side may use to build its hooks."""

    cfg: DictConfig  # the resolved run config
    topology: Topology  # the process's one Topology of the run (runner.planning.topology)
    run_dir: str
    node: int
    logical_rank: int  # the rank this process starts as (a spare learns its own later)
    role: str  # initial | joiner | spare | restore
    first_gen: int  # the generation this process first joins
    comm: Comm
    events: EventLog
    status: WorkerStatus
    recovery: RecoveryLoop  # the worker's recovery loop, for hooks that regroup on their own


@dataclass
class WorkerHooks:
    """What one technique adds to a worker; ``runner.recovery.worker_registry.combine`` merges them."""

    takeover: Optional[MicroBatchTakeover] = None  # failed ranks' micro-batches inside the step
    shard_replication: Optional[Callable[[ZeroOne], UpdateReplication]] = None  # ZeRO-1: built once sharded
    side_group: bool = False  # the communicator builds a second (gloo) group per generation for it
    restore_snapshot: Optional[Callable[[ReplicaState], dict]] = None  # a restarted rank's state (role restore)
    callbacks: list[Callback] = field(default_factory=list)  # Lightning callbacks, before the worker's own
    final_record: Callable[[], dict] = field(default=dict)  # what it adds to the worker's final record


class TechniqueWorker(Protocol):
    """A technique's worker side: built (with a ``WorkerContext``) before the model, so that it can start
    work that overlaps the model's construction; asked for its hooks once the module exists."""

    def hooks(self, module: LightningModule) -> WorkerHooks: ...
