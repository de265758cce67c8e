"""Events the flash-checkpoint parts report, so no skip or failure goes unnoticed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Event:
    """kind is one of: committed, persisted, persist_failed, skipped, backed_up, backup_failed."""

    kind: str
    step: int | None
    where: str
    detail: str = ""


EventSink = Optional[Callable[[Event], None]]


def emit(sink: EventSink, kind: str, step: int | None, where: str, detail: str = "") -> None:
    if sink is not None:
        sink(Event(kind, step, where, detail))
