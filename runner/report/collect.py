"""Find the jobs under a sweep (or any parent) directory and read their output files."""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from runner.plumbing.events import committed_steps, read_jsonl

PHASES = ("detect_s", "decide_s", "replace_s", "rebuild_s", "restore_s")


@dataclass
class Job:
    """One run directory: its summary (None if the run wrote none), events, metrics and overrides."""

    name: str
    summary: Optional[dict[str, Any]]
    events: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)
    seed: Any = None

    @property
    def fields(self) -> dict[str, Any]:
        """The summary's fields; empty when the run wrote no summary."""
        return self.summary or {}

    @property
    def strategy(self) -> str:
        ft = self.fields.get("ft") or []
        return "+".join(ft) or "none"

    @property
    def fault(self) -> str:
        return self.fields.get("fault", "n/a")

    @property
    def fault_free(self) -> bool:
        return self.fault == "none"

    @property
    def failed(self) -> bool:
        """The run wrote a summary that says it did not complete."""
        return bool(self.summary) and self.fields.get("status") != "completed"

    @property
    def label(self) -> str:
        return f"{self.name}: {self.strategy} / {self.fault}"

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        return self.fields.get("recoveries") or []

    def median(self, key: str) -> Optional[float]:
        """Median of a recovery field over this job's recoveries, skipping nulls; None if none has it."""
        values = [r[key] for r in self.recoveries if r.get(key) is not None]
        return statistics.median(values) if values else None

    def run_key(self) -> tuple:
        """What must match for two runs to be expected to end with the same parameters."""
        s = self.fields
        return s.get("recipe"), s.get("world_size"), s.get("global_step"), self.seed

    def first_step_start(self) -> Optional[float]:
        """Wall clock at which the first committed step began (its commit time minus its step time)."""
        if not self.metrics:
            return None
        return self.metrics[0]["t"] - self.metrics[0].get("step_time_s", 0.0)


def find_jobs(root: Path) -> list[Job]:
    """Every directory under ``root`` (itself included) with a summary.json or a Hydra overrides.yaml."""
    root = Path(root)
    dirs = {p.parent for p in root.rglob("summary.json")}
    dirs |= {p.parent.parent for p in root.rglob(".hydra/overrides.yaml")}
    return [read_job(d, root) for d in sorted(dirs, key=lambda d: _natural(d.relative_to(root)))]


def read_job(path: Path, root: Path) -> Job:
    """Read one run directory; its name is its path relative to ``root``."""
    summary_path = path / "summary.json"
    name = str(path.relative_to(root)) if path != root else path.name
    return Job(
        name=name,
        summary=json.loads(summary_path.read_text()) if summary_path.exists() else None,
        events=read_jsonl(path / "events.jsonl"),
        metrics=committed_steps(read_jsonl(path / "metrics.jsonl")),
        overrides=_yaml(path / ".hydra" / "overrides.yaml") or [],
        seed=(_yaml(path / ".hydra" / "config.yaml") or {}).get("seed"),
    )


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text()) if path.exists() else None


def _natural(rel: Path) -> list:
    """Sort key that puts job 2 before job 10."""
    return [int(tok) if tok.isdigit() else tok for tok in re.split(r"(\d+)", str(rel))]
