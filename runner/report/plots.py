"""The report's PNGs: RTO phases per recovery, tokens/s over wall time, and loss per step."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from runner.report.collect import PHASES, Job  # noqa: E402

DPI = 120
LEGEND_INSIDE_MAX = 4  # more series than this and the legend moves outside the axes
MARKERS = {"fault_injected": ("-", "fault injected"), "fault_detected": (":", "fault detected")}


def draw_all(jobs: list[Job], out_dir: Path) -> list[str]:
    """Write the three plots into ``out_dir``; returns their file names."""
    jobs = [j for j in jobs if j.summary]
    names = []
    for name, draw in (("rto_phases.png", rto_phases), ("throughput.png", throughput), ("loss.png", loss)):
        fig = draw(jobs)
        fig.savefig(out_dir / name, dpi=DPI, bbox_inches="tight")
        plt.close(fig)
        names.append(name)
    return names


def rto_phases(jobs: list[Job]):
    """Stacked horizontal bars: one bar per recovery, one segment per RTO phase."""
    bars = [(f"{j.label} #{r['id']}" if len(j.recoveries) > 1 else j.label, r) for j in jobs for r in j.recoveries]
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.45 * max(len(bars), 1)))
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
        ax.barh(labels, widths, left=left, label=phase[:-2])
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()  # first job on top
    ax.legend(title="phase", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def throughput(jobs: list[Job]):
    """tokens/s of every committed step against seconds since the run started, with fault markers."""
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.set_title("Throughput over wall time (vertical lines: faults injected / detected)")
    ax.set_xlabel("wall time since the first step started (s)")
    ax.set_ylabel("tokens/s")
    for job in jobs:
        t0 = job.first_step_start()
        if t0 is None:
            continue
        line, = ax.plot([m["t"] - t0 for m in job.metrics], [m["tokens_per_s"] for m in job.metrics],
                        marker=".", linewidth=1, label=job.label)
        for e in job.events:
            if e.get("kind") in MARKERS:
                style, _ = MARKERS[e["kind"]]
                ax.axvline(e.get("t_fault", e["t"]) - t0, color=line.get_color(), linestyle=style, linewidth=1)
    for style, what in MARKERS.values():
        ax.plot([], [], color="grey", linestyle=style, label=what)
    _legend(ax, len(jobs) + len(MARKERS))
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    return fig


def loss(jobs: list[Job]):
    """Training loss per committed step; fault-free runs dashed."""
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.set_title("Training loss (fault-free runs dashed)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over micro-batches)")
    for job in jobs:
        dashed = job.fault_free  # drawn thinner and on top, so an identical faulted curve stays visible
        ax.plot([m["step"] for m in job.metrics], [m["loss"] for m in job.metrics], label=job.label,
                linestyle="--" if dashed else "-", linewidth=1.5 if dashed else 3, zorder=3 if dashed else 2)
    _legend(ax, len(jobs))
    fig.tight_layout()
    return fig


def _legend(ax, series: int) -> None:
    if series > LEGEND_INSIDE_MAX:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    else:
        ax.legend(loc="best", fontsize="small")
