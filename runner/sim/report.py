"""Turn a sweep into numbers (the sim.json payload) and a readable table.

The text is rendered from the same summary dict that is written to JSON, so
the two cannot disagree. The published FlashRecovery figures below are only
printed next to the model's output; nothing in the model reads them.
"""
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

from runner.sim.costs import PHASES
from runner.sim.failures import FaultClass
from runner.sim.strategies import RESTART, STRATEGY_NAMES, build
from runner.sim.sweep import Sweep, mix_label

# FlashRecovery (arXiv 2509.03047) restart table, as quoted in seeds/004:
# full restart 8 min @512, 72 min @4096, timeout (>2 h) @10240; theirs 23/28/31 s.
PUBLISHED_RESTART_S = {512: 8 * 60.0, 4096: 72 * 60.0}
PUBLISHED_RESTART_AT_LEAST_S = {10240: 2 * 3600.0}
PUBLISHED_FLASHRECOVERY_S = {512: 23.0, 4096: 28.0, 10240: 31.0}
RTO_FAULT = FaultClass.node_loss  # the fault every strategy can take


@dataclass
class FreshJob:
    """A job with all spares in place and no takeover running: the state the
    model-only RTO-vs-N table assumes."""

    gpus: int
    spares: int
    dp_degree: int

    def neighbour(self, node: int) -> Optional[int]:
        return node + 1 if self.dp_degree >= 2 else None


def model_rto(sweep: Sweep, cfg, gpus: int) -> dict[str, dict]:
    """RTO of a node loss for every strategy at `gpus`, from the phase model."""
    nodes = gpus // cfg.cluster.gpus_per_node
    job = FreshJob(gpus, cfg.cluster.spares_nodes, nodes // cfg.cluster.model_parallel_nodes)
    out = {}
    for strategy in build(STRATEGY_NAMES, sweep.model, sweep.overrides):
        if strategy.handles(RTO_FAULT, 0, job):
            phases = strategy.recover(RTO_FAULT, 0, job).phases
            out[strategy.name] = {p: getattr(phases, p) for p in PHASES} | {
                "total": phases.total,
                "restart": phases.restart,
            }
    return out


def _point_summary(point) -> dict:
    runs, hours = point.runs, 3600.0
    per_strategy = defaultdict(list)
    for run in runs:
        for ev in run.events:
            per_strategy[ev.strategy].append(ev)
    events = [ev for run in runs for ev in run.events]
    return {
        "gpus": point.gpus,
        "mix": list(point.mix),
        "label": mix_label(point.mix),
        "ettr_mean": statistics.fmean(r.ettr for r in runs),
        "ettr_min": min(r.ettr for r in runs),
        "ettr_max": max(r.ettr for r in runs),
        "lost_gpu_hours": statistics.fmean(
            point.gpus * (r.wall_s - r.progress_s) / hours for r in runs
        ),
        "hours_per_run": {
            key: statistics.fmean(getattr(r, f"{key}_s") for r in runs) / hours
            for key in ("rework", "downtime", "checkpoint", "degraded")
        },
        "failures_per_run": len(events) / len(runs),
        "mean_rto_s": statistics.fmean(e.phases.total for e in events) if events else 0.0,
        "checkpoint_interval_min": point.plan.checkpoint_interval_s / 60.0,
        "strategies": {
            name: {
                "count": len(evs),
                "mean_rto_s": statistics.fmean(e.phases.total for e in evs),
                "mean_lost_work_s": statistics.fmean(e.lost_work_s for e in evs),
                "faults": sorted({e.fault for e in evs}),
            }
            for name, evs in sorted(per_strategy.items())
        },
    }


def summarize(sweep: Sweep, cfg) -> dict:
    """Everything sim.json holds, computed once."""
    f, m = sweep.failures, sweep.model
    young = []
    for g in sweep.sizes:
        mtbf = f.job_mtbf_s(g)
        young.append({
            "gpus": g,
            "job_mtbf_h": mtbf / 3600.0,
            "disk_save_s": m.storage_io(g),
            "disk_interval_min": m.young_interval_s(m.storage_io(g), mtbf) / 60.0,
            "snapshot_interval_min": m.young_interval_s(cfg.costs.snapshot_block_s, mtbf) / 60.0,
        })
    rto_sizes = sorted(set(sweep.sizes) | set(PUBLISHED_FLASHRECOVERY_S))
    rto = {g: model_rto(sweep, cfg, g) for g in rto_sizes}
    pooled = defaultdict(lambda: defaultdict(list))  # strategy -> gpus -> RTOs
    for (g, _), point in sweep.points.items():
        for run in point.runs:
            for ev in run.events:
                pooled[ev.strategy][g].append(ev.phases.total)
    return {
        "failures": {
            "per_gpu_hour": f.rate_per_gpu_s * 3600.0,
            "class_shares": {k.value: v for k, v in f.class_shares().items()},
        },
        "state_gb_per_gpu": m.state_gb_per_gpu,
        "points": [_point_summary(p) for p in sweep.points.values()],
        "simulated_mean_rto_s": {
            s: {str(g): {"mean": statistics.fmean(v), "count": len(v)} for g, v in by_g.items()}
            for s, by_g in pooled.items()
        },
        "young_daly": young,
        "rto_vs_n": {"fault": RTO_FAULT.value, "by_gpus": {str(g): rto[g] for g in rto_sizes}},
        "paper_check": [
            {
                "gpus": g,
                "restart_all_restart_s": rto[g][RESTART]["restart"],
                "published_restart_s": PUBLISHED_RESTART_S.get(g),
                "published_restart_at_least_s": PUBLISHED_RESTART_AT_LEAST_S.get(g),
                "flashrecovery_rto_s": rto[g].get("flashrecovery", {}).get("total"),
                "published_flashrecovery_s": PUBLISHED_FLASHRECOVERY_S[g],
            }
            for g in sorted(PUBLISHED_FLASHRECOVERY_S)
        ],
    }


def _dur(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def format_text(summary: dict, cfg) -> str:
    sizes = [y["gpus"] for y in summary["young_daly"]]
    points = {(p["gpus"], p["label"]): p for p in summary["points"]}
    labels = list(dict.fromkeys(p["label"] for p in summary["points"]))
    width = max(len(lbl) for lbl in labels + ["mix"]) + 2
    f = summary["failures"]
    lines: list[str] = [
        f"runner.sim: {cfg.job.days:g} days, {cfg.runs} runs per point, seed {cfg.seed}; "
        f"{f['per_gpu_hour']:.3g} failures per GPU-hour; fault classes "
        + ", ".join(f"{k} {v:.0%}" for k, v in f["class_shares"].items()),
        "",
        "ETTR per mix (mean of runs) and GPU-hours lost per run (downtime + rework + "
        "checkpoint stalls + degraded speed)",
        "mix".ljust(width) + "".join(f"{g:>11,} GPUs".rjust(24) for g in sizes),
        "".ljust(width) + "".join(f"{'ETTR':>10}{'lost GPU-h':>14}" for _ in sizes),
    ]
    for label in labels:
        cells = "".join(
            f"{points[(g, label)]['ettr_mean']:>10.3f}"
            f"{points[(g, label)]['lost_gpu_hours']:>14,.0f}"
            for g in sizes
        )
        lines.append(label.ljust(width) + cells)

    lines += ["", "Mean RTO of the strategy that handled each simulated failure, "
              "all mixes pooled (count)"]
    sim = summary["simulated_mean_rto_s"]
    names = [n for n in (*STRATEGY_NAMES, RESTART) if n in sim]
    for name in names:
        cells = "".join(
            f"{_dur(sim[name][str(g)]['mean'])} ({sim[name][str(g)]['count']})".rjust(20)
            if str(g) in sim[name] else "-".rjust(20)
            for g in sizes
        )
        lines.append(f"  {name:<14}" + cells)

    lines += ["", "Young/Daly checkpoint interval sqrt(2*C*MTBF) "
              f"(configured: {_interval(cfg)})"]
    for y in summary["young_daly"]:
        lines.append(
            f"  {y['gpus']:>7,} GPUs: job MTBF {y['job_mtbf_h']:.2f} h; disk save "
            f"{_dur(y['disk_save_s'])} -> every {y['disk_interval_min']:.0f} min; "
            f"memory snapshot {cfg.costs.snapshot_block_s:g} s -> every "
            f"{y['snapshot_interval_min']:.1f} min"
        )

    rto = summary["rto_vs_n"]["by_gpus"]
    rto_sizes = list(rto)
    lines += ["", f"RTO against N for a {summary['rto_vs_n']['fault']} (phase model, "
              "spares available)",
              "  strategy      " + "".join(f"{int(g):>10,}" for g in rto_sizes)]
    for name in (*STRATEGY_NAMES, RESTART):
        lines.append(f"  {name:<14}" + "".join(
            f"{_dur(rto[g][name]['total']) if name in rto[g] else '-':>10}" for g in rto_sizes
        ))

    lines += ["", "Against FlashRecovery's published table (restart = replace+rebuild+restore)"]
    for row in summary["paper_check"]:
        published = (
            _dur(row["published_restart_s"]) if row["published_restart_s"]
            else f"> {_dur(row['published_restart_at_least_s'])}"
        )
        lines.append(
            f"  {row['gpus']:>6,} GPUs: restart-all {_dur(row['restart_all_restart_s']):>9} "
            f"(paper {published}); flashrecovery {_dur(row['flashrecovery_rto_s'])} "
            f"(paper {_dur(row['published_flashrecovery_s'])})"
        )
    return "\n".join(lines)


def _interval(cfg) -> str:
    minutes = cfg.job.checkpoint_interval_min
    return "Young/Daly at each N" if minutes is None else f"every {minutes:g} min"
