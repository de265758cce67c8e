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
--world 4,8,16 (instead of the above): for each N, one FlashRecovery kill in a job of N ranks of a smaller
gpt_tiny, printing the RTO phases and, since a 2-core host cannot run 16 busy ranks fairly, the counts that do
not depend on the CPU: store operations and new connections of every process (``runner.store_counts``), per
phase of the recovery and per fault-free step.

    python bench/recovery.py [--kills 5] [--emit-calibration FILE] [--loggers-only] [--world 4,8,16]

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

sys.path.insert(0, str(ROOT))  # this checkout's runner, also when another one is installed
from runner import store_counts  # noqa: E402


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


WORLD_STEPS = 8  # steps of a --world job: the kill at step 5, the fault-free steps before it counted per step


def world_scaling(n: int) -> tuple[dict, dict[str, dict[str, int]], dict[str, float]]:
    """One job of ``n`` ranks on 2 nodes (gpt_tiny at width 32, one layer, one sample per rank) with one
    SIGKILL at step 5, counted: its recovery entry, the counts per phase, and the fault-free counts per step."""
    counts_dir = tempfile.mkdtemp(prefix="rr-counts-")
    os.environ[store_counts.ENV] = counts_dir  # the job's processes inherit it
    try:
        summary, metrics, _ = run_cli("+recipe=gpt_tiny", "parallel.nodes=2", f"parallel.procs_per_node={n // 2}",
                                      "model.d_model=32", "model.n_layer=1", f"trainer.global_batch_size={n}",
                                      "ft=[flashrecovery]", f"trainer.max_steps={WORLD_STEPS}", "fault=kill_rank",
                                      f"fault.rank={n - 1}", "fault.step=5", "launcher.start_timeout_s=600")
    finally:
        del os.environ[store_counts.ENV]
    assert summary["status"] == "completed", summary.get("error")
    (rec,) = summary["recoveries"]
    records = store_counts.load(counts_dir)
    commits = {m["step"]: m["t"] for m in metrics if m["gen"] == 0}
    first, last = 2, 4  # steady steps before the kill: commit of step 2 -> commit of step 4
    steady = store_counts.tally(records, commits[first], commits[last])
    span = commits[last] - commits[first]
    per_step = {k: v / (last - first) for k, v in steady.items()}
    per_step["ops_per_s"] = steady["store_ops"] / span
    return rec, store_counts.by_phase(records, rec), per_step


def print_world(sizes: list[int]) -> None:
    phases = [name for name, _, _ in store_counts.PHASES]
    print("FlashRecovery kill against world size (gpt_tiny d_model=32, 1 layer, 2 nodes, one kill at step 5)")
    for n in sizes:
        rec, counts, steady = world_scaling(n)
        whole = counts["recovery"]
        print(f"N={n}: RTO {rec['rto_s']:.3f} s = " + " + ".join(f"{p} {rec[p + '_s']:.3f}" for p in phases)
              + f" ({rec['decide_reason']})")
        members = 2 * n - 1  # the survivors-only group and the complete one
        print(f"  store ops in the recovery: {whole['store_ops']}: group rebuild {whole['group_ops']} "
              f"({whole['arrival_ops']} arrivals + {whole['gloo_ops']} gloo = {whole['group_ops'] / members:.1f} per "
              f"member of the {members} members of the two groups; {whole['group_keys']} keys), the rest "
              f"{whole['other_ops']}; by phase: "
              + ", ".join(f"{p} {counts[p]['store_ops']}/{counts[p]['group_ops']}" for p in phases)
              + " (all/group)")
        print(f"  new connections in the recovery: {whole['connections']} ({whole['store_clients']} store clients, "
              f"{whole['group_sockets']} group sockets = {whole['group_sockets'] / members:.1f} per member)")
        print(f"  fault-free, per step: {steady['store_ops']:.1f} store ops ({steady['group_ops']:.1f} group), "
              f"{steady['connections']:.1f} new connections; {steady['ops_per_s']:.0f} store ops/s (heartbeats, "
              "polls: they follow the clock, not the steps)")


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
    ap.add_argument("--world", metavar="N,N,...", help="only the recovery cost against world size, e.g. 4,8,16")
    args = ap.parse_args()
    if args.world:
        print_world([int(n) for n in args.world.split(",")])
        return
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
