"""The worker sides of the techniques in ``ft`` (each descriptor names its package's ``worker`` module), and their
hooks combined into one ``WorkerHooks``: imported by a worker only (torch and Lightning)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning.pytorch import LightningModule

from runner.recovery.common.hooks import TechniqueWorker, WorkerContext, WorkerHooks
from runner.recovery.registry import TECHNIQUES


def technique_workers(ft: Iterable[str], ctx: WorkerContext) -> list[TechniqueWorker]:
    """The worker side of every technique in ``ft``, in its order."""
    return [TECHNIQUES[name].worker_side()(ctx) for name in ft]


def combine(workers: list[TechniqueWorker], module: LightningModule) -> WorkerHooks:
    """Every technique's hooks in one; a hook that only one technique may fill is refused from two."""
    parts = [worker.hooks(module) for worker in workers]

    def only(name: str) -> Any:
        given = [getattr(p, name) for p in parts if getattr(p, name) is not None]
        if len(given) > 1:
            raise ValueError(f"two techniques in ft both provide the worker hook {name!r}")
        return given[0] if given else None

    return WorkerHooks(
        takeover=only("takeover"),
        shard_replication=only("shard_replication"),
        side_group=any(p.side_group for p in parts),
        restore_snapshot=only("restore_snapshot"),
        callbacks=[c for p in parts for c in p.callbacks],
        final_record=lambda: {k: v for p in parts for k, v in p.final_record().items()},
    )
