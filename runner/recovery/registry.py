"""The registry: every recovery technique's descriptor, and what a mix of them (``ft``) provides.

Adding a technique is adding its package with a ``technique.py`` (its ``Technique``) and one line in
``TECHNIQUES``. An action two techniques provide (an in-place restart: FlashRecovery's, which DeadPool uses for
crashes too) is one class in both descriptors. Config, policy, the plan, the Topology and the controller ask the
functions below; none of them names a technique.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.recovery.deadpool.technique import TECHNIQUE as DEADPOOL
from runner.recovery.flash_ckpt.technique import TECHNIQUE as FLASH_CKPT
from runner.recovery.flashrecovery.technique import TECHNIQUE as FLASHRECOVERY
from runner.recovery.ndb.technique import TECHNIQUE as NDB
from runner.recovery.technique import Technique

if TYPE_CHECKING:
    from runner.planning.topology import Topology
    from runner.recovery.actions import RecoveryAction, SavedState

TECHNIQUES: dict[str, Technique] = {t.name: t for t in (FLASHRECOVERY, DEADPOOL, NDB, FLASH_CKPT)}


@contextmanager
def registered(technique: Technique) -> Iterator[Technique]:
    """``technique`` in the registry for the duration (a test's toy technique)."""
    if technique.name in TECHNIQUES:
        raise ValueError(f"a technique named {technique.name!r} is registered already")
    TECHNIQUES[technique.name] = technique
    try:
        yield technique
    finally:
        del TECHNIQUES[technique.name]


def options_schemas() -> dict[str, type]:
    """Each technique's ``ft.<name>`` options dataclass, by name: the Hydra schema and the config check's."""
    return {name: t.options for name, t in TECHNIQUES.items()}


def action_class(name: str) -> type[RecoveryAction]:
    """The controller action of policy name ``name`` (``recompute`` and ``report`` are none: the workers' guard
    and the controller's straggler report)."""
    return next(cls for t in TECHNIQUES.values() for cls in t.actions if cls.name == name)


def action_names() -> list[str]:
    """Every policy action some registered technique carries out, once each, in registry order."""
    return list(dict.fromkeys(cls.name for t in TECHNIQUES.values() for cls in t.actions))


def build_actions(ft: list[str], cfg, topo: Topology, run_dir: Path) -> dict[str, RecoveryAction]:
    """One instance of every action the mix brings, by policy name, in ``ft`` order."""
    out: dict[str, RecoveryAction] = {}
    for technique in ft:
        for cls in TECHNIQUES[technique].actions:
            if cls.name not in out:
                out[cls.name] = cls(cfg, topo, run_dir)
    return out


def providers(action: str, ft: list[str], options: Mapping[str, Any]) -> list[str]:
    """The techniques in ``ft`` that carry ``action`` out with their options (``options``: the ``ft`` node)."""
    return [n for n in ft if TECHNIQUES[n].carries_out(action, options.get(n) or {})]


def able(action: str) -> list[str]:
    """Every registered technique that can carry ``action`` out, with some options."""
    return [n for n, t in TECHNIQUES.items() if action in t.action_names]


def with_(ft, capability: str) -> list[str]:
    """The techniques in ``ft`` whose descriptor has ``capability`` (a boolean field of ``Technique``)."""
    return [n for n in ft if getattr(TECHNIQUES[n], capability)]


def offering(capability: str) -> list[str]:
    """Every registered technique with ``capability``: what a message tells a user to add to ``ft``."""
    return [n for n, t in TECHNIQUES.items() if getattr(t, capability)]


def saved_states(ft=None) -> list[SavedState]:
    """The readers of what the techniques in ``ft`` (every registered one: None) saved of each rank outside a job."""
    names = list(TECHNIQUES) if ft is None else ft
    return [s for n in names if (s := TECHNIQUES[n].saved_state_reader()) is not None]


def titles(names: list[str]) -> str:
    """The techniques ``names`` in prose, joined by "or"."""
    return " or ".join(TECHNIQUES[n].title for n in names)


def replicates_shards(ft: list[str]) -> bool:
    """Some technique in ``ft`` keeps a copy of every ZeRO-1 optimizer shard on another node."""
    return bool(with_(ft, "replicates_shards"))


def restart_owner(ft: list[str]) -> str | None:
    """The technique whose ``max_restarts`` bounds in-place restarts: of those in ``ft`` that own such a budget,
    the first in registry order (FlashRecovery's bound, where it is in the mix, also covers DeadPool's restarts)."""
    return next(iter(with_(sorted(ft, key=list(TECHNIQUES).index), "owns_restart_budget")), None)


def standby_options(ft, options: Mapping[str, Any]) -> list[str]:
    """The options (``ft.<name>.<option>``) with which techniques in ``ft`` keep a warm replacement parked on every
    host's node agent; empty: none does."""
    return [f"ft.{n}.{t.standby_option}" for n in ft if (t := TECHNIQUES[n]).standby_option
            and (options.get(n) or {}).get(t.standby_option)]


def rank_loss_first(ft: list[str], options: Mapping[str, Any]) -> list[str]:
    """Actions the mix's options put first in the seeds' process-crash and hang rows."""
    return list(dict.fromkeys(a for n in ft for a in TECHNIQUES[n].rank_loss_first(options.get(n) or {})))
