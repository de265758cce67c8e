"""report.md: the strategy x fault table, one row per recovery, the jobs' overrides, and the plots.

Every cell is filled: a value that does not apply is ``n/a`` with a numbered footnote giving the
reason.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from runner.report.collect import PHASES, Job
from runner.report.summary import throughput

NO_SUMMARY = "the run wrote no summary.json (configuration error, plan-only run, or killed)"
NO_RECOVERY = "no recovery in this job"
RECOVERY_UNFINISHED = "the run failed before this recovery committed a step"
NO_THROUGHPUT_REF = ("the sweep has no other completed fault-free job of the same recipe and world size (another "
                     "with this strategy, or one without fault tolerance, ft=[]) to compare it with")
FAULT_JOB_OVERHEAD = ("a fault job's tokens/s includes its recoveries, so it measures no fault-free overhead: compare "
                      "the fault-free job of the same strategy")
NO_CHECKSUM = "no param_checksum: the run failed or its replicas ended with different parameters"
NO_CHECKSUM_REF = "no fault-free run in sweep with the same recipe, world size, step count and seed"
IS_CHECKSUM_REF = ("this job is the fault-free run; the sweep has no other fault-free run of the same recipe, "
                   "world size, step count and seed to compare it with")


class Notes:
    """Numbered footnotes; the same reason always gets the same number."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def na(self, reason: str) -> str:
        if reason not in self.reasons:
            self.reasons.append(reason)
        return f"n/a[^{self.reasons.index(reason) + 1}]"

    def render(self) -> list[str]:
        return [f"[^{i}]: {reason}" for i, reason in enumerate(self.reasons, 1)]


def render(jobs: list[Job], root: Path, plots: list[str]) -> str:
    """The whole report.md for ``jobs`` found under ``root``; ``plots`` are PNG names beside it."""
    notes = Notes()
    done = [j for j in jobs if j.summary]
    failed = [j for j in done if j.failed]
    lines = [
        f"# Sweep report: `{root}`",
        "",
        f"{len(jobs)} jobs: {len(done) - len(failed)} completed, {len(failed)} failed, "
        f"{len(jobs) - len(done)} without summary.json.",
        "",
        "## Strategy x fault",
        "",
        "RTO, its phases and RPO are medians over the job's recoveries (each recovery is listed below). "
        "Fault-free overhead, given for fault-free jobs only, is how much lower the job's tokens/s is than "
        "that of the reference job named in brackets: another fault-free job with the same strategy, else the "
        "fault-free job without fault tolerance (positive = slower). The checksum column says whether the final "
        "parameters are "
        "bit-identical to a fault-free run of the same recipe, world size, step count and seed.",
        "",
        *_table(_MAIN_HEADER, [_main_row(j, jobs, notes) for j in jobs]),
        "",
        "## Recoveries",
        "",
    ]
    recoveries = [_recovery_row(j, r, notes) for j in done for r in j.recoveries]
    lines += _table(_RECOVERY_HEADER, recoveries) if recoveries else ["No job in this sweep had a recovery."]
    lines += ["", "## Jobs", "", *_table(["job", "overrides"], [_job_row(j) for j in jobs])]
    lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in plots]
    if notes.reasons:
        lines += ["", *notes.render()]
    return "\n".join(lines) + "\n"


_PHASE_HEADER = [f"{p[:-2]} (s)" for p in PHASES]
_MAIN_HEADER = ["job", "strategy", "fault", "status", "recoveries", "RTO (s)", *_PHASE_HEADER, "RPO (steps)",
                "steps/s", "tokens/s", "fault-free overhead", "ETTR", "checksum = fault-free",
                "samples lost / duplicated", "error"]
_RECOVERY_HEADER = ["job", "recovery", "fault", "victims", "at step", "action", "RTO (s)", *_PHASE_HEADER,
                    "RPO (steps)", "reason"]


def _main_row(job: Job, jobs: list[Job], notes: Notes) -> list[str]:
    s = job.summary
    if not s:
        na = notes.na(NO_SUMMARY)
        return [job.name, na, na, "no summary", *[na] * (len(_MAIN_HEADER) - 4)]
    recovery = [_median(job, key, notes) for key in ("rto_s", *PHASES)]
    return [
        job.name, job.strategy, job.fault, s.get("status", "n/a"), str(len(job.recoveries)), *recovery,
        _median(job, "rpo_steps", notes, _fmt_steps),
        f"{s['steps_per_s']:.2f}", _rate(s),
        _overhead(job, jobs, notes), f"{s['effective_training_time_ratio']:.3f}", _checksum(job, jobs, notes),
        f"{s.get('samples_lost', 0)} / {s.get('samples_duplicated', 0)}",
        s.get("error") or "none",
    ]


def _recovery_row(job: Job, r: dict[str, Any], notes: Notes) -> list[str]:
    def value(key: str, fmt: Callable[[float], str] = _fmt_s) -> str:
        return fmt(r[key]) if r.get(key) is not None else notes.na(RECOVERY_UNFINISHED)

    return [job.name, str(r["id"]), r["fault"], ", ".join(map(str, r["victims"])), str(r["step"]), r["action"],
            value("rto_s"), *[value(p) for p in PHASES], value("rpo_steps", _fmt_steps), r["reason"]]


def _rate(s: dict[str, Any]) -> str:
    value, unit = throughput(s)
    return f"{value:,.0f}" if unit == "tokens/s" else f"{value:,.1f} samples/s"


def _job_row(job: Job) -> list[str]:
    return [job.name, " ".join(f"`{o}`" for o in job.overrides) or "none"]


def _median(job: Job, key: str, notes: Notes, fmt: Optional[Callable[[float], str]] = None) -> str:
    if not job.recoveries:
        return notes.na(NO_RECOVERY)
    value = job.median(key)
    return (fmt or _fmt_s)(value) if value is not None else notes.na(RECOVERY_UNFINISHED)


def _overhead(job: Job, jobs: list[Job], notes: Notes) -> str:
    """Fault-free jobs only: their tokens/s against ft=[] of the same recipe and world size (or, for ft=[]
    itself, n/a)."""
    if not job.fault_free:
        return notes.na(FAULT_JOB_OVERHEAD)
    s = job.fields
    same_size = [j for j in _fault_free(jobs, job)
                 if (j.fields["recipe"], j.fields["world_size"]) == (s["recipe"], s["world_size"])]
    ref = _first(same_size, job.strategy) or _first(same_size, "none")
    if ref is None or not throughput(ref.fields)[0]:
        return notes.na(NO_THROUGHPUT_REF)
    drop = 100.0 * (1.0 - throughput(s)[0] / throughput(ref.fields)[0])
    return f"{drop:+.1f}% (vs {ref.name})"


def _checksum(job: Job, jobs: list[Job], notes: Notes) -> str:
    if not job.fields.get("param_checksum"):
        return notes.na(NO_CHECKSUM)
    refs = [j for j in _fault_free(jobs, job) if j.run_key() == job.run_key() and j.fields.get("param_checksum")]
    ref = _first(refs, job.strategy) or (refs[0] if refs else None)
    if ref is None:
        return notes.na(IS_CHECKSUM_REF if job.fault_free else NO_CHECKSUM_REF)
    return "yes" if ref.fields["param_checksum"] == job.fields["param_checksum"] else "no"


def _fault_free(jobs: list[Job], other_than: Job) -> list[Job]:
    return [j for j in jobs if j is not other_than and j.summary and j.fault_free
            and not j.failed]


def _first(jobs: list[Job], strategy: str) -> Optional[Job]:
    return next((j for j in jobs if j.strategy == strategy), None)


def _fmt_s(value: float) -> str:
    return f"{value:.3f}"


def _fmt_steps(value: float) -> str:
    return f"{value:g}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [_line(header), _line(["---"] * len(header)), *(_line(r) for r in rows)]


def _line(cells: list[str]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"
