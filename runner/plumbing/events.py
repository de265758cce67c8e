"""Append-only JSON-lines logs shared by the controller and every worker.

Each record is written with one ``os.write`` on an ``O_APPEND`` descriptor, so lines from
different processes never interleave.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

METRICS_FIELDS = frozenset({"step", "t", "loss", "step_time_s", "reduce_s", "samples_per_s", "tokens_per_s",
                            "counts", "misplaced", "gen", "val/loss", "epoch_metrics", "val_metrics", "evaluation"})
"""The fields of a metrics.jsonl record that the runner computes (``runner.callbacks.metrics``); every other field is a
value the module logged (``self.log``) or the learning rate (``train/lr``), logged under its own name."""


class JsonLines:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        os.write(self.fd, (json.dumps(record, default=_jsonable) + "\n").encode())

    def close(self) -> None:
        os.close(self.fd)


class EventLog(JsonLines):
    """events.jsonl: one object per line with t, step, rank, kind and details."""

    def __init__(self, path: Path, rank: Callable[[], Any], step: Callable[[], int],
                 echo: Optional[Callable[[dict], None]] = None) -> None:
        super().__init__(path)
        self.rank, self.step, self.echo = rank, step, echo

    def emit(self, kind: str, **details: Any) -> dict[str, Any]:
        record = {"t": time.time(), "step": self.step(), "rank": self.rank(), "kind": kind, **details}
        self.write(record)
        if self.echo is not None:
            self.echo(record)
        return record


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a JSON-lines file, also one a running job is still appending to: what follows the
    last newline is a record half written (read mid-write, or cut by a process killed while writing), not yet one."""
    if not Path(path).exists():
        return []
    *complete, _ = Path(path).read_text().split("\n")
    return [json.loads(line) for line in complete if line.strip()]


def committed_steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """metrics.jsonl's records of committed steps: without the one of the evaluations after fit (``evaluation``)."""
    return [m for m in records if "evaluation" not in m]


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
