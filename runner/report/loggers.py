"""The job's experiment logger backends: a W&B run (offline by default) or CSV files, and the run's name.

The controller owns the one logger of a job (``runner.control.run_logger``); workers never log to it.
A backend takes rows (dicts of scalars against the ``global_step`` and ``wall_time`` axes), alerts, the
run's summary at the end, and is finished exactly once. The backends know nothing of the runner's
files: what goes into the rows is the run logger's business.
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path
from typing import Any, Optional, Protocol

from omegaconf import DictConfig, OmegaConf

from runner.planning.module_facts import subject_name

STEP_AXIS = "global_step"  # every row has it: the training step the row belongs to
TIME_AXIS = "wall_time"  # and seconds since the controller started
# every metric family the runner logs is drawn against the step axis (the time axis is in the same rows);
# event/* (what happened, as text) stays out of the summary, which gets the run's summary.json at the end
METRIC_FAMILIES: dict[str, Optional[str]] = {"train/*": None, "recovery/*": None, "event/*": "none"}


def run_name(cfg: DictConfig) -> str:
    ft = "+".join(cfg.ft.keys()) if cfg.ft else "noft"
    return f"{subject_name(cfg)}-{ft}-{cfg.fault.kind}-w{cfg.parallel.nodes}x{cfg.parallel.procs_per_node}"


class ExperimentLogger(Protocol):
    """What the run logger needs of a backend."""

    def log(self, row: dict[str, Any]) -> None: ...

    def alert(self, title: str, text: str, level: str) -> None: ...

    def finish(self, summary: dict[str, Any], exit_code: int) -> None: ...


def open_logger(cfg: DictConfig, run_dir: Path) -> Optional[ExperimentLogger]:
    """The backend ``logger.kind`` names, started with the full resolved config; None for ``logger=none``.
    Opening a W&B run takes a second or more: the caller does it off the training and recovery paths."""
    config = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(config, dict)  # a DictConfig converts to a dict
    if cfg.logger.kind == "wandb":
        return WandbRun(cfg, run_dir, config)
    if cfg.logger.kind == "csv":
        return CsvRun(Path(run_dir) / "csv", config)
    return None


class WandbRun:
    """One W&B run per job: named ``run_name``, grouped by sweep, with the step and wall-time axes defined."""

    def __init__(self, cfg: DictConfig, run_dir: Path, config: dict) -> None:
        import wandb  # only a job that logs to W&B pays for the import

        # console="off": the terminal carries rank 0's progress bar and the controller's lines, not W&B's
        # capture; the id is the run directory's, so a torchrun/SLURM restart attempt continues the same run
        self.run = wandb.init(project=cfg.logger.project, dir=str(run_dir), mode=cfg.logger.mode, name=run_name(cfg),
                              group=_wandb_group(cfg, run_dir), id=_wandb_id(run_dir), resume="allow", config=config,
                              settings=wandb.Settings(console="off", quiet=True))
        self.run.define_metric(STEP_AXIS)
        self.run.define_metric(TIME_AXIS)
        for family, summary in METRIC_FAMILIES.items():
            self.run.define_metric(family, step_metric=STEP_AXIS, summary=summary)

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(row)

    def alert(self, title: str, text: str, level: str) -> None:
        self.run.alert(title=title[:63], text=text, level=level)  # W&B takes titles under 64 characters

    def finish(self, summary: dict[str, Any], exit_code: int) -> None:
        self.run.summary.update(summary)
        self.run.finish(exit_code=exit_code)


class CsvRun:
    """``csv/``: ``hparams.yaml`` (the resolved config), ``metrics.csv`` (the rows, flushed as they come, with a
    column per key ever logged), ``alerts.csv`` and, at the end, ``summary.csv`` (one row, nested keys joined
    by ``/``)."""

    def __init__(self, root: Path, config: dict) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(config), self.root / "hparams.yaml")
        self.metrics = _GrowingCsv(self.root / "metrics.csv", [STEP_AXIS, TIME_AXIS])
        self.alerts = _GrowingCsv(self.root / "alerts.csv", ["title", "text", "level"])

    def log(self, row: dict[str, Any]) -> None:
        self.metrics.write(row)

    def alert(self, title: str, text: str, level: str) -> None:
        self.alerts.write({"title": title, "text": text, "level": level})

    def finish(self, summary: dict[str, Any], exit_code: int) -> None:
        flat = flatten(summary)
        with open(self.root / "summary.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(flat))
            writer.writeheader()
            writer.writerow(flat)
        self.metrics.close()
        self.alerts.close()


class _GrowingCsv:
    """A CSV file appended row by row; a row with a new key rewrites the file once with the wider header."""

    def __init__(self, path: Path, columns: list[str]) -> None:
        self.path, self.columns = path, list(columns)
        self.file = open(path, "w", newline="")
        self._writer().writeheader()

    def _writer(self) -> csv.DictWriter:
        return csv.DictWriter(self.file, fieldnames=self.columns)

    def write(self, row: dict[str, Any]) -> None:
        new = [key for key in row if key not in self.columns]
        if new:
            self.file.close()
            with open(self.path, newline="") as f:
                old = list(csv.DictReader(f))
            self.columns += new
            self.file = open(self.path, "w", newline="")
            self._writer().writeheader()
            self._writer().writerows(old)
        self._writer().writerow(row)
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts and lists as one level of ``a/b/0/c`` keys (an empty one stays as its JSON, ``[]``)."""
    if isinstance(value, (dict, list)) and not value and prefix:
        return {prefix: json.dumps(value)}
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in items:
        out.update(flatten(item, f"{prefix}/{key}" if prefix else str(key)))
    return out


def _wandb_group(cfg: DictConfig, run_dir: Path) -> str:
    """Runs of one sweep share a group: the sweep directory, relative to the working directory (or its last
    three parts, e.g. multirun/<date>/<time>, when it lies elsewhere), so that a group name does not carry one
    machine's absolute paths."""
    if cfg.logger.group:
        return cfg.logger.group
    run_dir = Path(run_dir).resolve()
    group = run_dir.parent if run_dir.name.isdigit() else run_dir
    try:
        return str(group.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(Path(*group.parts[-3:]))


def _wandb_id(run_dir: Path) -> str:
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
