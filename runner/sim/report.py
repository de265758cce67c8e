"""Turn a sweep into numbers (the sim.json payload) and a readable table.

The text is rendered from the same summary dict that is written to JSON, so
the two cannot disagree. Published figures (anchors.py) are only compared with
the model's output; nothing in the model reads them.
"""
import statistics
from collections import defaultdict
from dataclasses import fields
from typing import Optional

from runner.recovery.registry import able
from runner.sim import anchors
from runner.sim.costs import PHASES
from runner.sim.failures import FaultClass
from runner.sim.pricing import RESTART, Pricing
from runner.sim.schema import source_kind
from runner.sim.sweep import Sweep, mix_label, policy_for

F = FaultClass
# The actions whose phases are tabled against N, after the whole-job requeue, with the fault each one is shown for.
TABLED_ACTIONS = (("restart_rank", F.process_crash), ("swap_spare", F.node_loss), ("takeover", F.node_loss),
                  ("restart_all", F.node_loss))
FAULT_WORDS = {F.process_crash: "crash", F.node_loss: "node loss"}


def paths() -> list[tuple[str, str, str, FaultClass]]:
    """(label, action, technique, fault) of each tabled recovery path: the requeue, then each tabled action
    carried out by the first registered technique able to."""
    out = [("restart (requeue, node loss)", "fail", RESTART, F.node_loss)]
    for action, fault in TABLED_ACTIONS:
        technique = able(action)[0]
        out.append((f"{technique} {action} ({FAULT_WORDS[fault]})", action, technique, fault))
    return out


def path_phases(sweep: Sweep, gpus: int) -> dict[str, dict]:
    """Phases of every recovery path at `gpus`, from the phase model (calibration included)."""
    pricing = Pricing(sweep.model, sweep.overrides, gpus)
    out = {}
    for label, action, technique, fault in paths():
        rec = pricing.requeue(fault) if action == "fail" else pricing.price(action, technique, fault)
        out[label] = {p: getattr(rec.phases, p) for p in PHASES} | {"total": rec.phases.total,
                                                                     "restart": rec.phases.restart}
    return out


def _point_summary(point) -> dict:
    runs, hours = point.runs, 3600.0
    per_technique = defaultdict(list)
    for run in runs:
        for ev in run.events:
            per_technique[ev.technique].append(ev)
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
            for key in ("rework", "downtime", "checkpoint", "degraded", "straggler")
        },
        "stragglers_per_run": statistics.fmean(r.stragglers for r in runs),
        "straggler_swaps_per_run": statistics.fmean(r.straggler_swaps for r in runs),
        "failures_per_run": len(events) / len(runs),
        "mean_rto_s": statistics.fmean(e.phases.total for e in events) if events else 0.0,
        "checkpoint_interval_min": point.plan.checkpoint_interval_s / 60.0,
        "strategies": {  # sim.json's key: what handled the failures (a technique, guard or restart)
            name: {
                "count": len(evs),
                "actions": sorted({e.action for e in evs}),
                "mean_rto_s": statistics.fmean(e.phases.total for e in evs),
                "mean_lost_work_s": statistics.fmean(e.lost_work_s for e in evs),
                "faults": sorted({e.fault for e in evs}),
            }
            for name, evs in sorted(per_technique.items())
        },
    }


def decisions(sweep: Sweep, cfg) -> dict[str, dict[str, dict]]:
    """Per mix and policy fault class, what the runner decides (full budgets, every spare ready)."""
    gpus = max(sweep.sizes)
    spare_ranks = cfg.cluster.spares_nodes * cfg.cluster.gpus_per_node
    return {
        mix_label(mix): {cls: {"action": d.action, "reason": d.reason}
                         for cls, d in policy_for(cfg, gpus, mix).table(spare_ranks).items()}
        for mix in sweep.mixes
    }


def constants(cfg, overrides) -> dict[str, dict]:
    """Every cost constant with its value and where it comes from."""
    out = {}
    for f in fields(cfg.costs):
        key = f"costs.{f.name}"
        value = getattr(cfg.costs, f.name)
        out[key] = {"value": getattr(value, "value", value), "source": cfg.sources[key]}
    for name in ("per_node_day", "slowdown"):
        key = f"stragglers.{name}"
        out[key] = {"value": getattr(cfg.stragglers, name), "source": cfg.sources[key]}
    for technique, phases in overrides.items():
        for phase, value in phases.items():
            key = f"phases.{technique}.{phase}_s"
            out[key] = {"value": value, "source": cfg.sources.get(key, "measured: calibration file")}
    return out


def summarize(sweep: Sweep, cfg) -> dict:
    """Everything sim.json holds, computed once."""
    f, m = sweep.failures, sweep.model
    young = []
    for g in sweep.sizes:
        mtbf = f.job_mtbf_s(g)
        young.append({
            "gpus": g,
            "job_mtbf_h": mtbf / 3600.0,
            "disk_save_s": m.storage_write(g),
            "disk_interval_min": m.young_interval_s(m.storage_write(g), mtbf) / 60.0,
            "snapshot_interval_min": m.young_interval_s(cfg.costs.snapshot_block_s, mtbf) / 60.0,
        })
    pooled: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))  # technique -> gpus -> RTOs
    for (g, _), point in sweep.points.items():
        for run in point.runs:
            for ev in run.events:
                pooled[ev.technique][g].append(ev.phases.total)
    consts = constants(cfg, sweep.overrides)
    return {
        "profile": {"name": cfg.profile_name, "about": cfg.profile_about},
        "failures": {
            "per_gpu_hour": f.rate_per_gpu_s * 3600.0,
            "class_shares": {k.value: v for k, v in f.class_shares().items()},
        },
        "state_gb_per_gpu": m.state_gb_per_gpu,
        "points": [_point_summary(p) for p in sweep.points.values()],
        "decisions": decisions(sweep, cfg),
        "simulated_mean_rto_s": {
            s: {str(g): {"mean": statistics.fmean(v), "count": len(v)} for g, v in by_g.items()}
            for s, by_g in pooled.items()
        },
        "young_daly": young,
        "rto_phases": {str(g): path_phases(sweep, g) for g in sweep.sizes},
        "anchors": [a.as_dict() for a in anchors.anchors(cfg)],
        "constants": consts,
        "guesses": sorted(k for k, v in consts.items() if source_kind(v["source"]) == "guess"),
    }


def _dur(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _value(a: dict) -> str:
    return f"{a['simulated']:.3f}" if a["unit"] == "ratio" else f"{a['simulated']:,.0f} s"


def format_text(summary: dict, cfg) -> str:
    sizes = [y["gpus"] for y in summary["young_daly"]]
    points = {(p["gpus"], p["label"]): p for p in summary["points"]}
    labels = list(dict.fromkeys(p["label"] for p in summary["points"]))
    width = max(len(lbl) for lbl in labels + ["mix"]) + 2
    f = summary["failures"]
    lines: list[str] = [
        f"runner.sim, profile {summary['profile']['name']}: {summary['profile']['about']}",
        f"{cfg.job.days:g} days, {cfg.runs} runs per point, seed {cfg.seed}; "
        f"{f['per_gpu_hour']:.3g} failures per GPU-hour; fault classes "
        + ", ".join(f"{k} {v:.0%}" for k, v in f["class_shares"].items()),
        "",
        "ETTR per mix (mean of runs) and GPU-hours lost per run (downtime + rework + "
        "checkpoint stalls + degraded speed + straggler pace)",
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

    classes = list(next(iter(summary["decisions"].values())))
    short = [c.replace("node_loss_", "node_").replace("process_", "").replace("silent_", "") for c in classes]
    lines += ["", "What the runner decides per fault class (runner.control.decision, full budgets; "
              "fail = requeue the job)",
              "mix".ljust(width) + "".join(f"{c:>17}" for c in short)]
    for label, row in summary["decisions"].items():
        lines.append(label.ljust(width) + "".join(f"{row[c]['action']:>17}" for c in classes))

    lines += ["", "Mean RTO of what handled each simulated failure, all mixes pooled (count)"]
    sim = summary["simulated_mean_rto_s"]
    for name in sorted(sim):
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

    largest = str(max(sizes))
    lines += ["", f"RTO phases at {int(largest):,} GPUs (phase model)",
              "  path" + " " * 34 + "".join(f"{p:>10}" for p in (*PHASES, "total"))]
    for label, ph in summary["rto_phases"][largest].items():
        lines.append(f"  {label:<38}" + "".join(f"{_dur(ph[p]):>10}" for p in (*PHASES, "total")))

    if summary["anchors"]:
        lines += ["", f"Published anchors of profile {summary['profile']['name']}"]
        for a in summary["anchors"]:
            band = "ok" if a["ok"] else "OUT OF BAND"
            lines.append(f"  {a['anchor']:<52} published {a['published']:<32} simulated {_value(a):>9}  {band}"
                         f"  ({a['source']})")
    lines += ["", "Guessed constants (no published or measured source): " + (", ".join(summary["guesses"]) or "none")]
    return "\n".join(lines)


def _interval(cfg) -> str:
    minutes = cfg.job.checkpoint_interval_min
    return "Young/Daly at each N" if minutes is None else f"every {minutes:g} min"
