"""PNG plots beside sim.json: ETTR against GPU count per mix, and RTO phases per recovery path.

Drawn from the summary dict (the sim.json payload), with matplotlib's Agg
backend so no display is needed.
"""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from runner.sim.costs import PHASES  # noqa: E402


def ettr_vs_gpus(summary: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    labels = list(dict.fromkeys(p["label"] for p in summary["points"]))
    for label in labels:
        pts = sorted((p["gpus"], p["ettr_mean"]) for p in summary["points"] if p["label"] == label)
        ax.plot([g for g, _ in pts], [e for _, e in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    sizes = sorted({p["gpus"] for p in summary["points"]})
    ax.set_xticks(sizes, [f"{g:,}" for g in sizes])
    ax.minorticks_off()
    ax.set_xlabel("GPUs")
    ax.set_ylabel("ETTR (useful progress / wall time)")
    ax.set_title(f"ETTR against GPU count, profile {summary['profile']['name']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rto_phases(summary: dict, path: Path) -> None:
    """Stacked phases of each recovery path at the largest simulated size (log scale: minutes to hours)."""
    largest = max(summary["rto_phases"], key=int)
    paths = summary["rto_phases"][largest]
    fig, ax = plt.subplots(figsize=(9, 5))
    names = list(paths)
    left = [0.0] * len(names)
    for phase in PHASES:
        widths = [paths[n][phase] for n in names]
        ax.barh(names, widths, left=left, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("seconds")
    ax.set_title(f"RTO phases at {int(largest):,} GPUs, profile {summary['profile']['name']}")
    ax.legend(fontsize=8)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(summary: dict, out_dir: Path) -> list[Path]:
    paths = [out_dir / "ettr_vs_gpus.png", out_dir / "rto_phases.png"]
    ettr_vs_gpus(summary, paths[0])
    rto_phases(summary, paths[1])
    return paths
