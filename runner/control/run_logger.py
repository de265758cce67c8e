"""The job's experiment logger, owned by the controller: one W&B run (or CSV files) per job, complete and live.

Workers write every committed step to ``metrics.jsonl`` (``callbacks/metrics.py``) and their events, as the
controller does its own, to ``events.jsonl``. A thread of the controller follows both files from where they ended
when the controller was built, in time order, and turns them into rows of the backend (``runner.report.loggers``):
``train/loss``, ``train/samples_per_s``, ``train/tokens_per_s`` (token batches), ``train/step_time_s``,
``train/lr`` and every value the module logged (``self.log``) every ``trainer.log_every_n_steps`` committed steps
(epoch-end values at the epoch's last step, a validation's values at its step, and the evaluations after fit at the
step after the last, whatever the cadence); an ``event/*`` row for each fault, detection, decision and the other
events of a recovery when it happens; and a ``recovery/*`` row with the RTO, its phases and the RPO as soon as the
recovered world commits its first step (computed as summary.json computes them), with an alert. Every row carries
the ``global_step`` and ``wall_time`` axes. At the end the run's summary (RTO phases, RPO,
ETTR, sample accounting) goes into the backend's summary and the backend is finished: ``finish`` sits in the
controller's outermost ``finally``, so every ending (completed, failed, Ctrl-C, SIGTERM, a crash) finishes it.

No worker logs, so which rank dies changes nothing; and opening the backend (a W&B run takes a second or
more) happens on this thread, so neither a rank's start nor a recovery waits for it.
"""

from __future__ import annotations

import json
import sys
import threading
import traceback
from collections import deque
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from runner.control.records import Recovery, RunRecord
from runner.launch.objective import TRAIN_ROW
from runner.plumbing.events import METRICS_FIELDS
from runner.report.loggers import STEP_AXIS, TIME_AXIS, ExperimentLogger, open_logger
from runner.report.summary import recovery_entry

POLL_S = 0.5  # how often the files are read; every row carries its own step and time
# what a reader of the run follows: faults, their detection, decisions and what the actions did
EVENT_ROWS = frozenset({
    "fault_injected", "chaos_drawn", "fault_not_carried_out", "chaos_fault_unseen", "sdc_detected",
    "fault_detected", "worker_killed", "recovery_decided", "recovery_not_needed",
    "replacement_ready", "spare_assigned", "spare_lost", "takeover_assigned", "replica_stopped", "repair_started",
    "rejoined", "snapshot_restored", "restart_from_start", "run_failed", "straggler_detected", "hang_diagnosed",
})
# the controller's record gives the times of decisions and replacements; these events give the rest
PHASE_EVENTS = frozenset({"fault_injected", "fault_detected", "group_formed"})
RECENT_COMMITS = 256  # more than a recovery's survivors-only generation commits before its complete one
RECOVERY_KEYS = ("rto_s", "detect_s", "decide_s", "replace_s", "rebuild_s", "restore_s", "survivors_ready_s",
                 "rpo_steps")


class RunLogger:
    """``start`` opens the backend and follows the run's files on a thread; ``finish(summary)`` logs what is
    left, the summary, and finishes the backend. ``record`` is the controller's: a recovery's row is written
    once the record has its complete generation and that generation has committed a step."""

    def __init__(self, cfg: DictConfig, run_dir: Path, record: RunRecord) -> None:
        self.cfg, self.run_dir, self.record = cfg, Path(run_dir), record
        self.log_every = max(1, cfg.trainer.log_every_n_steps)
        # from where they end now: a torchrun/SLURM restart attempt of the job appends to the same files
        self.metrics, self.events = _Tail(self.run_dir / "metrics.jsonl"), _Tail(self.run_dir / "events.jsonl")
        self.backend: Optional[ExperimentLogger] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._summary: Optional[dict] = None
        self._last_step = -1  # the newest committed step seen
        self._phase_events: list[dict] = []
        self._first_commit: dict[int, dict] = {}  # generation -> its first committed step's record, in time order
        self._recent: deque[dict] = deque(maxlen=RECENT_COMMITS)  # the newest commits: a fault's last one before it
        self._recoveries_logged: set[int] = set()

    def start(self) -> None:
        if self.cfg.logger.kind == "none":
            return
        self._thread = threading.Thread(target=self._run, name="run-logger", daemon=True)
        self._thread.start()

    def finish(self, summary: Optional[dict]) -> None:
        """Log the rest and the summary (None: the controller ended before writing one), finish the backend."""
        if self._thread is None:
            return
        self._summary = summary
        self._stop.set()
        self._thread.join()

    # -- the thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.backend = open_logger(self.cfg, self.run_dir)
        except Exception as err:  # a logger that cannot start never stops the training
            print(f"[runner] logger={self.cfg.logger.kind} is off for this run: {type(err).__name__}: {err}",
                  file=sys.stderr, flush=True)
            return
        try:
            while not self._stop.wait(POLL_S):
                self.follow()
            self.follow()
        except Exception:  # a bug here must not leave the run unfinished
            traceback.print_exc()
        finally:
            summary = self._summary or {"status": "failed",
                                        "error": self.record.error or "the controller ended without a summary"}
            assert self.backend is not None
            self.backend.finish(summary, exit_code=0 if summary["status"] == "completed" else 1)

    def follow(self) -> None:
        """Rows for everything appended to the two files since the last call, in time order."""
        new = [(r["t"], 0, r) for r in self.metrics.read()] + [(r["t"], 1, r) for r in self.events.read()]
        for _, source, record in sorted(new, key=lambda item: item[0]):
            if source == 0:
                self._on_commit(record)
            else:
                self._on_event(record)
        self._log_recoveries()  # one whose record got its complete generation after the commit was read

    def _on_commit(self, m: dict) -> None:
        if "evaluation" in m:  # the evaluations after fit: their values, at the step after the last
            self._log(m["step"], m["t"], {k: v for k, v in m.items() if k not in METRICS_FIELDS or k == "val/loss"})
            return
        self._last_step = m["step"]
        self._first_commit.setdefault(m["gen"], m)
        self._recent.append(m)
        validation = set(m.get("val_metrics", ()))
        # the module's self.log values of training_step, train/lr
        logged = {k: v for k, v in m.items() if k not in METRICS_FIELDS and k not in validation}
        if m["step"] % self.log_every == 0:  # what the module logs itself replaces the runner's train/loss
            self._log(m["step"], m["t"], {**{name: m[field] for name, field in TRAIN_ROW.items()
                                             if m.get(field) is not None}, **logged})
        elif m.get("epoch_metrics"):  # an epoch's values are logged whatever log_every_n_steps says
            self._log(m["step"], m["t"], {k: logged[k] for k in m["epoch_metrics"]})
        if validation:  # a validation step's values are logged whatever log_every_n_steps says
            self._log(m["step"], m["t"], {k: m[k] for k in sorted(validation)})
        self._log_recoveries()  # a recovery closed by this commit is logged in its place among the rows

    def _on_event(self, e: dict) -> None:
        kind = e["kind"]
        if kind in PHASE_EVENTS:
            self._phase_events.append(e)
        if kind not in EVENT_ROWS:
            return
        # a worker's event is at the step it works on; the controller's (step -1) at the step after the newest
        # commit, an injected fault at the step it struck
        step = e.get("at_step", e["step"] if e["step"] >= 0 else self._last_step + 1)
        details = {k: v for k, v in e.items() if k not in ("t", "step", "kind")}
        row: dict[str, Any] = {"event/kind": kind, "event/text": json.dumps(details, default=str)}
        if "recovery" in e:
            row["event/recovery"] = e["recovery"]
        self._log(step, e["t"], row)
        if kind == "run_failed":
            self._alert("run failed", e.get("error", ""), "ERROR")

    def _log_recoveries(self) -> None:
        """A row and an alert per recovery whose complete generation has committed its first step."""
        for rec in list(self.record.recoveries):  # the controller's thread appends to it
            if rec.id in self._recoveries_logged or rec.full_gen is None:
                continue
            first = next((m for gen, m in self._first_commit.items() if gen >= rec.full_gen), None)
            if first is None:
                continue
            self._recoveries_logged.add(rec.id)
            entry = recovery_entry(rec, self._phase_events, [m for m in self._recent if m["t"] < first["t"]] + [first])
            self._log(first["step"], first["t"], recovery_row(entry))
            self._alert(f"recovery {entry['id']}: {entry['action']}", recovery_text(entry), "WARN")
            self._forget_before(rec)

    def _forget_before(self, logged: Recovery) -> None:
        """Drop what no recovery still to be logged can need, now that ``logged`` is: a long run with many
        recoveries keeps a bounded history. A later recovery reads the injected faults after the newest other
        detection before its own (``recovery_entry``), the groups of its own generations, which are never older
        than the complete generation of a recovery logged before it, and commits from its complete generation on."""
        pending = [r for r in list(self.record.recoveries) if r.id not in self._recoveries_logged]
        before = min((r.t_detect for r in pending), default=float("inf"))
        claims = [e["t"] for e in self._phase_events
                  if e["kind"] == "fault_detected" and e.get("recovery") in self._recoveries_logged and e["t"] < before]
        claimed = max(claims, default=float("-inf"))
        known = [g for r in pending for g in (r.survivors_gen, r.full_gen) if g is not None]
        assert logged.full_gen is not None  # logged once its complete generation committed
        oldest_gen = min([logged.full_gen, *known])
        self._phase_events = [e for e in self._phase_events
                              if (e.get("gen", oldest_gen) >= oldest_gen if e["kind"] == "group_formed"
                                  else e["t"] >= claimed)]
        self._first_commit = {gen: m for gen, m in self._first_commit.items() if gen >= oldest_gen}

    def _log(self, step: int, t: float, row: dict[str, Any]) -> None:
        assert self.backend is not None
        self.backend.log({STEP_AXIS: step, TIME_AXIS: t - self.record.t_start, **row})

    def _alert(self, title: str, text: str, level: str) -> None:
        assert self.backend is not None
        self.backend.alert(title, text, level)


def recovery_row(entry: dict) -> dict[str, Any]:
    """A recovery's numbers (summary.json's ``recoveries[]`` entry) as ``recovery/*`` metrics."""
    return {"recovery/id": entry["id"],
            **{f"recovery/{k}": entry[k] for k in RECOVERY_KEYS if entry.get(k) is not None}}


def recovery_text(entry: dict) -> str:
    rpo = "n/a" if entry["rpo_steps"] is None else f"{entry['rpo_steps']} steps"
    return (f"{entry['fault']} of ranks {entry['victims']} at step {entry['step']} -> {entry['action']}: "
            f"RTO {entry['rto_s']:.3f} s, RPO {rpo}. {entry['reason']}")


class _Tail:
    """The complete lines appended to a JSON-lines file (written by other processes) since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        self.offset += complete
        return [json.loads(line) for line in data[:complete].splitlines() if line.strip()]
