"""The report's PNGs: progress over wall time, RTO phases per recovery, smoothed tokens/s, and loss per step.

Read at a glance: each recovery is a shaded span in the progress plot (from its summary.json entry: fault to the
first commit of the full world), so a flat stretch that is not shaded is a slow host, not a recovery; a gap (not a
bridging line) in the throughput plot; a failed job is marked with an x where it stopped and "(failed)" in its
label. Every RTO phase is written beside its bar, so a phase of a few milliseconds is read, not guessed.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from runner.report.collect import PHASES, Job  # noqa: E402

DPI = 120
LEGEND_INSIDE_MAX = 4  # more series than this and the legend moves outside the axes
MARKERS = {"fault_injected": ("-", "fault injected"), "fault_detected": (":", "fault detected")}
SMOOTH_STEPS = 9  # throughput: median over this many consecutive committed steps (odd: centred)
WALL_TIME = "wall time since the first step started (s)"
GAP_FACTOR = 5.0  # a pause between commits longer than this many median step times breaks the line


def draw_all(jobs: list[Job], out_dir: Path) -> list[str]:
    """Write the plots into ``out_dir``; returns their file names."""
    jobs = [j for j in jobs if j.summary]
    names = []
    for name, draw in (("progress.png", progress), ("rto_phases.png", rto_phases), ("throughput.png", throughput),
                       ("loss.png", loss)):
        fig = draw(jobs)
        fig.savefig(out_dir / name, dpi=DPI, bbox_inches="tight")
        plt.close(fig)
        names.append(name)
    return names


def rto_phases(jobs: list[Job]):
    """Stacked horizontal bars: one bar per recovery, one segment per RTO phase."""
    bars = [(f"{j.label} #{r['id']}" if len(j.recoveries) > 1 else j.label, r) for j in jobs for r in j.recoveries]
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.7 * max(len(bars), 1)))
    ax.set_title("Recovery time (RTO) by phase")
    ax.set_xlabel("time since fault (s)")
    if not bars:
        ax.text(0.5, 0.5, "no recovery in this sweep", ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])
        return fig
    labels = [label for label, _ in bars]
    left = [0.0] * len(bars)
    for phase in PHASES:
        widths = [r.get(phase) or 0.0 for _, r in bars]
        ax.barh(labels, widths, left=left, height=0.45, label=phase[:-2])
        left = [a + b for a, b in zip(left, widths)]
    for y, (_, r) in enumerate(bars):  # under each bar, so that a phase of a few ms is read, not guessed
        ax.text(0, y + 0.3, phase_text(r), va="top", fontsize=8)
    ax.set_ylim(len(bars) - 0.35, -0.5)  # first job on top, room for the last bar's phases
    ax.legend(title="phase", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def phase_text(recovery: dict) -> str:
    """``detect 20 ms, decide 3 ms, ...``: every phase of one recovery, as its summary.json entry has it."""
    return ", ".join(f"{p[:-2]} {recovery[p] * 1000:.0f} ms" if recovery.get(p) is not None else f"{p[:-2]} n/a"
                     for p in PHASES)


def recovery_spans(job: Job, t0: float) -> list[tuple[float, float]]:
    """Each recovery of ``job`` as (start, end) in seconds since ``t0``: its fault to its full world's first
    commit (``rto_s``); a recovery that never got there (the run failed) runs to the job's last commit."""
    last = job.metrics[-1]["t"] - t0 if job.metrics else 0.0
    return [(r["t_fault"] - t0, r["t_fault"] - t0 + r["rto_s"] if r.get("rto_s") is not None else last)
            for r in job.recoveries if r.get("t_fault") is not None]


def progress(jobs: list[Job]):
    """Committed global step against wall time: the run's slope is its speed; each recovery shaded, from its
    fault to its full world's first commit, so that a flat stretch left unshaded is a slow host, not a fault."""
    fig, ax = _figure("Progress (shaded: recoveries, fault to first full-world commit; x: a failed job stopped "
                      "there)", WALL_TIME, "committed global step")
    shaded = False
    for job in jobs:
        t0 = job.first_step_start()
        if t0 is None:
            continue
        times, steps = [m["t"] - t0 for m in job.metrics], [m["step"] + 1 for m in job.metrics]
        line, = ax.plot([0.0, *times], [0, *steps], drawstyle="steps-post", linewidth=1.5, label=_label(job))
        if job.failed:
            ax.plot(times[-1:], steps[-1:], marker="x", markersize=10, color=line.get_color())
        for start, end in recovery_spans(job, t0):
            ax.axvspan(start, end, color=line.get_color(), alpha=0.2, linewidth=0)
            shaded = True
    if shaded:
        ax.fill_between([], [], color="grey", alpha=0.2, label="recovery")
    _legend(ax, len(jobs) + shaded)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    return fig


def throughput(jobs: list[Job]):
    """tokens/s (samples/s where a module's batches are not tokens), a centred running median over ``SMOOTH_STEPS``
    committed steps, against wall time; the line breaks where commits paused (a recovery) instead of bridging it;
    fault markers as vertical lines."""
    tokens = all(m.get("tokens_per_s") is not None for job in jobs for m in job.metrics)
    field, unit = ("tokens_per_s", "tokens/s") if tokens else ("samples_per_s", "samples/s")
    fig, ax = _figure(f"Throughput over wall time, median of {SMOOTH_STEPS} steps (vertical lines: faults)",
                      WALL_TIME, unit)
    for job in jobs:
        t0 = job.first_step_start()
        if t0 is None:
            continue
        times, rates = _with_gaps([m["t"] - t0 for m in job.metrics], smoothed(
            [m[field] for m in job.metrics], SMOOTH_STEPS))
        line, = ax.plot(times, rates, linewidth=1.5, label=_label(job))
        if job.failed:
            ax.plot(times[-1:], rates[-1:], marker="x", markersize=10, color=line.get_color())
        for e in job.events:
            if e.get("kind") in MARKERS:
                style, _ = MARKERS[e["kind"]]
                ax.axvline(e.get("t_fault", e["t"]) - t0, color=line.get_color(), linestyle=style, linewidth=1)
    for style, what in MARKERS.values():
        ax.plot([], [], color="grey", linestyle=style, label=what)
    _legend(ax, len(jobs) + len(MARKERS))
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.08)  # headroom: a flat line does not hide under the frame
    fig.tight_layout()
    return fig


def smoothed(values: list[float], window: int) -> list[float]:
    """Centred running median (shorter at both ends): one slow step does not draw a spike."""
    half = window // 2
    return [statistics.median(values[max(0, i - half):i + half + 1]) for i in range(len(values))]


def _with_gaps(times: list[float], values: list[float]) -> tuple[list[float], list[float]]:
    """Insert a NaN point where two commits are more than ``GAP_FACTOR`` median intervals apart, so that
    matplotlib leaves the pause blank."""
    if len(times) < 3:
        return times, values
    limit = GAP_FACTOR * statistics.median(b - a for a, b in zip(times, times[1:]))
    out_t, out_v = [times[0]], [values[0]]
    for (a, b), v in zip(zip(times, times[1:]), values[1:]):
        if b - a > limit:
            out_t.append((a + b) / 2)
            out_v.append(math.nan)
        out_t.append(b)
        out_v.append(v)
    return out_t, out_v


def loss(jobs: list[Job]):
    """Training loss per committed step; fault-free runs dashed."""
    fig, ax = _figure("Training loss (fault-free runs dashed)", "step", "loss (mean over micro-batches)")
    for job in jobs:
        dashed = job.fault_free  # drawn thinner and on top, so an identical faulted curve stays visible
        ax.plot([m["step"] for m in job.metrics], [m["loss"] for m in job.metrics], label=_label(job),
                linestyle="--" if dashed else "-", linewidth=1.5 if dashed else 3, zorder=3 if dashed else 2)
    _legend(ax, len(jobs))
    fig.tight_layout()
    return fig


def _figure(title: str, xlabel: str, ylabel: str):
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return fig, ax


def _label(job: Job) -> str:
    return f"{job.label} (failed)" if job.failed else job.label


def _legend(ax, series: int) -> None:
    if series > LEGEND_INSIDE_MAX:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    else:
        ax.legend(loc="best", fontsize="small")
