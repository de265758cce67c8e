"""Recovery time of FlashRecovery against a restart-all baseline, measured in one run.

FlashRecovery: one 4-rank job with --kills SIGKILLs of different ranks at different steps; for
each kill: kill -> detected, kill -> survivors regrouped and ready, kill -> the full world commits
a step again (RTO), from the job's summary and events.
Baseline (what torchrun --max-restarts gives): every rank restarts as a new process and reloads
the last Lightning checkpoint; measured as kill -> first committed step of a fresh plain-DDP job
resuming from a checkpoint taken at the kill step (so it loses no work: the baseline's best case).
DeadPool: jobs that each lose a node whose ranks warm spares take over, with the default
heartbeat (10 misses of 100 ms) and with 3 misses, with ZeRO-1 shards restored from the
neighbours' replicas, and a crashed rank swapped for a spare (``SWAPS``).
The FlashRecovery job runs twice: with ``logger=none`` and with ``logger=wandb`` (offline), whose run the
controller owns, so that the logger is shown to stay off the recovery path.
Prints medians, spreads and the ratios. Targets (2-core host, gpt_tiny): detected <= 0.05 s,
survivors ready <= 0.3 s, full world back <= 3 s, >= 5x faster than the baseline, RTO with
logger=wandb <= 1.1x RTO with logger=none.

    python bench/recovery.py [--kills 5] [--emit-calibration FILE] [--loggers-only]

--emit-calibration FILE writes what was measured here as the simulator's calibration file
(runner/sim/calibration.py; python -m runner.sim calibration=FILE), labelled with the host and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, median_spread, run_cli


def flashrecovery(kills: int, ranks: int, logger: str = "none") -> dict[str, list[float]]:
    steps = [10 + 12 * i for i in range(kills)]
    extra = ",".join(f"{{kind: kill_rank, rank: {(i + 1) % ranks}, step: {s}}}" for i, s in enumerate(steps[1:]))
    summary, _, _ = run_cli("+recipe=gpt_tiny", "parallel.nodes=2", f"parallel.procs_per_node={ranks // 2}",
                            "ft=[flashrecovery]", f"trainer.max_steps={steps[-1] + 10}", "fault=kill_rank",
                            "fault.rank=0", f"fault.step={steps[0]}", f"+fault.extra=[{extra}]", logger=logger)
    assert summary["status"] == "completed", summary.get("error")
    recs = summary["recoveries"]
    assert len(recs) == kills, recs
    return {
        "detected": [r["detect_s"] for r in recs],
        "survivors ready": [r["survivors_ready_s"] for r in recs],
        "full world commits": [r["rto_s"] for r in recs],
        "replacement start-up": [r["replace_s"] for r in recs],
    }


SWAPS = {  # DeadPool hot-swap cases: a lost node (its loss is seen once its heartbeats stop), or a crashed rank
    "node loss, heartbeat.misses=10": ["fault=kill_node", "fault.node=1"],
    "node loss, heartbeat.misses=3": ["fault=kill_node", "fault.node=1", "heartbeat.misses=3"],
    "node loss, misses=3, zero=1": ["fault=kill_node", "fault.node=1", "heartbeat.misses=3", "parallel.zero=1"],
    "kill -9 -> spare, zero=1": ["fault=kill_rank", "fault.rank=2", "ft.deadpool.crash_action=swap", "parallel.zero=1"],
}


def hot_swap(runs: int, overrides: list[str]) -> dict[str, list[float]]:
    """DeadPool: 6 ranks on 3 nodes, 2 warm spares on a fourth; one loss per job, ``runs`` jobs."""
    out: dict[str, list[float]] = {"detected": [], "full world commits": []}
    for i in range(runs):
        summary, _, _ = run_cli("+recipe=gpt_tiny", "parallel.nodes=3", "parallel.procs_per_node=2",
                                "parallel.spares=2", "ft=[deadpool]", "trainer.global_batch_size=12",
                                "trainer.max_steps=30", f"fault.step={10 + i}", *overrides)
        assert summary["status"] == "completed", summary.get("error")
        (rec,) = summary["recoveries"]
        out["detected"].append(rec["t_decide"] - rec["t_fault"])  # a loss is known once it is decided
        out["full world commits"].append(rec["rto_s"])
    return out


def restart_all(kills: int, ranks: int) -> list[float]:
    """Kill -> first step of a fresh DDP job resumed from a checkpoint, ``kills`` times."""
    out = []
    for _ in range(kills):
        work = Path(tempfile.mkdtemp(prefix="rr-restart-"))
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        base = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                str(ROOT / "bench" / "ddp_reference.py")]
        subprocess.run(base + ["--steps", "10", "--ckpt-every", "10", "--ckpt-dir", str(work), "--out",
                               str(work / "a.json")], cwd=ROOT, env=env, check=True, capture_output=True)
        t_kill = time.time()  # the crash: every rank restarts from here
        subprocess.run(base + ["--steps", "11", "--resume", str(work / "last.ckpt"), "--out", str(work / "b.json")],
                       cwd=ROOT, env=env, check=True, capture_output=True)
        first_commit = json.loads((work / "b.json").read_text())["t_commit"][0]
        out.append(first_commit - t_kill)
    return out


def calibration(ours: dict[str, list[float]], swaps: dict[str, dict[str, list[float]]]) -> dict:
    """The phases measured here that do not grow with the job size, for the simulator: a crashed rank's
    detection (its exit) and the start of its replacement (FlashRecovery), and a lost node's detection by
    its silent heartbeats (DeadPool, the default heartbeat; the decision is included in it)."""
    med = statistics.median
    node_loss = swaps["node loss, heartbeat.misses=10"]["detected"]
    return {
        "measured": {"host": socket.gethostname(),
                     "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "by": "bench/recovery.py (gpt_tiny, medians)"},
        "costs": {"process_start_s": med(ours["replacement start-up"])},
        "phases": {"flashrecovery": {"detect_s": med(ours["detected"])},
                   "deadpool": {"detect_s": med(node_loss), "decide_s": 0.0}},
    }


def print_logger_cost(none: dict[str, list[float]], wandb: dict[str, list[float]]) -> None:
    """RTO (kill -> full world commits) of the same job without an experiment logger and with W&B."""
    key = "full world commits"
    print(f"flashrecovery kill -> {key}, by experiment logger ({len(none[key])} kills each)")
    print(f"  logger=none   {median_spread(none[key])} s")
    print(f"  logger=wandb  {median_spread(wandb[key])} s")
    ratio = statistics.median(wandb[key]) / statistics.median(none[key])
    print(f"  ratio wandb / none: {ratio:.2f}x   target <= 1.1x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--swaps", type=int, default=3, help="DeadPool hot-swap jobs (one node loss each)")
    ap.add_argument("--emit-calibration", metavar="FILE", help="write the simulator's calibration JSON here")
    ap.add_argument("--loggers-only", action="store_true",
                    help="only the FlashRecovery RTO with logger=none beside logger=wandb")
    args = ap.parse_args()
    ours = flashrecovery(args.kills, args.ranks)
    with_wandb = flashrecovery(args.kills, args.ranks, logger="wandb")
    print_logger_cost(ours, with_wandb)
    if args.loggers_only:
        return
    swaps = {name: hot_swap(args.swaps, overrides) for name, overrides in SWAPS.items()}
    baseline = restart_all(args.kills, args.ranks)
    print(f"gpt_tiny, {args.ranks} ranks on 2 simulated nodes, {args.kills} SIGKILLs")
    for name, values in ours.items():
        print(f"  flashrecovery kill -> {name:22s} {median_spread(values)} s")
    print(f"  restart-all   kill -> full world commits     {median_spread(baseline)} s")
    ratio = statistics.median(baseline) / statistics.median(ours["full world commits"])
    print(f"  ratio restart-all / flashrecovery (full world back): {ratio:.1f}x   target >= 5x")
    print("  targets: detected <= 0.05 s, survivors ready <= 0.3 s, full world back <= 3 s")
    print("DeadPool hot swap: 6 ranks on 3 nodes + 1 node of 2 warm spares")
    for name, values in swaps.items():
        print(f"  {name:32s} kill -> loss decided       {median_spread(values['detected'])} s")
        print(f"  {name:32s} kill -> full world commits {median_spread(values['full world commits'])} s")
    print("  target: full world back <= 0.5 s (a node loss is only seen when its heartbeats stop: "
          "interval_s x misses; a crashed process at once)")
    if args.emit_calibration:
        Path(args.emit_calibration).write_text(json.dumps(calibration(ours, swaps), indent=1) + "\n")
        print(f"wrote {args.emit_calibration} (python -m runner.sim calibration={args.emit_calibration})")


if __name__ == "__main__":
    main()
