"""What the runner knows about one recovery technique (an ``ft`` entry), in one object.

Each technique's package defines one ``Technique`` in its ``technique.py`` and ``runner/recovery/registry.py``
lists them. Config, policy, the plan, the Topology and the controller ask the descriptor what a technique does
(starts spares, replicates shards, restarts ranks from snapshots, ...) instead of comparing names, so a fifth
technique is a package and one registry line. A descriptor imports neither torch nor Lightning: its worker side is
named by its module path and imported only in a worker.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runner.recovery.actions import RecoveryAction, SavedState


def _no_problems(cfg: Any, for_training: bool) -> list[str]:
    return []


@dataclass(frozen=True)
class Technique:
    """One ``ft`` entry: its options, the controller's actions it brings, its worker side and what it provides."""

    name: str
    """The ``ft`` name (``conf/ft/<name>.yaml``, ``ft.<name>.*`` options)."""
    title: str
    """Its name in prose (messages, docs): "DeadPool", "the flash checkpoint"."""
    options: type
    """The dataclass of its ``ft.<name>`` options: the Hydra schema, the docs and the config check read it."""
    actions: tuple[type[RecoveryAction], ...]
    """The controller-side policy actions it carries out, in the order it prefers them."""
    worker: str
    """``module:attribute`` of its worker side (a ``TechniqueWorker`` factory), imported only in a worker."""
    uses_spares: bool = False
    """It starts warm spares (``parallel.spares``) and hands a lost rank's or host's place to one."""
    replicates_shards: bool = False
    """With ZeRO-1 it keeps a copy of every rank's optimizer shard on another node, every step."""
    covers_ranks: bool = False
    """A live neighbour computes a failed rank's micro-batches too (no spare): the memory plan counts the shard it
    carries, and it cannot drive a user's module (its approximations are the built-in GPT's)."""
    restarts_from_snapshots: bool = False
    """Every rank restarts from its own snapshot (replica-independent): snapshots are named by the rank at set-up, and
    a torchrun/SLURM restart resumes from them."""
    restarts_rank_alone: bool = False
    """It restarts a failed rank by itself, its state from a live replica (a ZeRO-1 shard needs a replica group)."""
    owns_restart_budget: bool = False
    """Its ``max_restarts`` bounds in-place restarts (the first such technique in ``ft`` does)."""
    standby_option: str = ""
    """The boolean option with which it keeps a warm replacement parked on every host's node agent (none if empty)."""
    switched_by: Mapping[str, str] = field(default_factory=dict)
    """action -> the boolean option (default true) without which it does not carry that action out (FlashRecovery's
    retry needs ``retry_transient``)."""
    rank_loss_first: Callable[[Mapping[str, Any]], tuple[str, ...]] = lambda options: ()
    """Actions its options put first in the seeds' process-crash and hang rows (DeadPool's ``crash_action=swap``)."""
    saved_state: str = ""
    """The module (a ``SavedState``, ``runner.recovery.actions``) that reads what it saved of each rank outside a
    running job, in host memory or on disk: what a restarted attempt and a resume look for (none if empty)."""
    checks: str = ""
    """``module:function`` of its own config checks, ``f(cfg, for_training) -> list[str]`` of problems (each one
    paragraph that says what to change), imported when validating
    (they use the validation helpers, which import the registry)."""
    action_names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "action_names", tuple(a.name for a in self.actions))

    def carries_out(self, action: str, options: Mapping[str, Any]) -> bool:
        """Whether this technique, with ``options`` (its ``ft.<name>`` node), carries ``action`` out."""
        switch = self.switched_by.get(action)
        return action in self.action_names and (switch is None or bool(options.get(switch, True)))

    def worker_side(self) -> Callable[..., Any]:
        """The factory of its worker side (imports the worker module: torch and Lightning)."""
        module, attribute = self.worker.split(":")
        return getattr(importlib.import_module(module), attribute)

    def saved_state_reader(self) -> SavedState | None:
        """Its ``saved_state`` module (imported now), or None."""
        return importlib.import_module(self.saved_state) if self.saved_state else None

    def config_problems(self) -> Callable[[Any, bool], list[str]]:
        """Its own config checks (none if it has no ``checks``)."""
        if not self.checks:
            return _no_problems
        module, attribute = self.checks.split(":")
        return getattr(importlib.import_module(module), attribute)
