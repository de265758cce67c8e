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
The FlashRecovery job runs three times: with ``logger=none`` and with ``logger=wandb`` (offline), whose run the
controller owns, so that the logger is shown to stay off the recovery path; and with ``heartbeat.decide_at_once=false``
(every decision waits for the decide window), the baseline of deciding at once on a conclusive exit.
Prints medians, spreads and the ratios. Targets (2-core host, gpt_tiny): detected <= 0.05 s,
survivors ready <= 0.3 s, full world back <= 3 s, >= 5x faster than the baseline, RTO with
logger=wandb <= 1.1x RTO with logger=none.
--world 4,8,16 (instead of the above): for each N, one FlashRecovery kill in a job of N ranks of a smaller
gpt_tiny, printing the RTO phases and, since a 2-core host cannot run 16 busy ranks fairly, the counts that do
not depend on the CPU: store operations and new connections of every process (``runner.plumbing.store_counts``), per
phase of the recovery and per fault-free step.

--decide-only: only the FlashRecovery job with decide-at-once on and off, and the ratios.
--standby-only: only the FlashRecovery job with ``ft.flashrecovery.standby`` off and on (two jobs each, alternately),
printing every RTO phase.
--launcher local,per_host (instead of the above): the same faults under ``launcher=local`` and under three torchrun
trees on this machine as three hosts (``launcher.mode=per_host``; 2 training hosts of 2 ranks, 1 spare host, ft
flashrecovery and deadpool): a worker killed (restarted in place) and host 1 lost (every process of its tree
SIGKILLed; the spare host takes over; under launcher=local ``fault=kill_node``), ``--runs`` jobs each (the
launchers alternately), printing kill -> loss decided and kill -> full world commits per launcher and the ratio
per_host / local.

    python bench/recovery.py [--kills 5] [--emit-calibration FILE] [--loggers-only] [--decide-only]
                             [--standby-only]
                             [--world 4,8,16] [--launcher local,per_host --runs 3]

--emit-calibration FILE writes what was measured here as the simulator's calibration file
(runner/sim/calibration.py; python -m runner.sim calibration=FILE), labelled with the host and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, median_spread, run_cli

sys.path.insert(0, str(ROOT))  # this checkout's runner, also when another one is installed
from runner.plumbing import store_counts  # noqa: E402
from tests import local_hosts


def flashrecovery(kills: int, ranks: int, *overrides: str, logger: str = "none") -> dict[str, list[float]]:
    steps = [10 + 12 * i for i in range(kills)]
    extra = ",".join(f"{{kind: kill_rank, rank: {(i + 1) % ranks}, step: {s}}}" for i, s in enumerate(steps[1:]))
    summary, _, _ = run_cli("+recipe=gpt_tiny", "parallel.nodes=2", f"parallel.procs_per_node={ranks // 2}",
                            "ft=[flashrecovery]", f"trainer.max_steps={steps[-1] + 10}", "fault=kill_rank",
                            "fault.rank=0", f"fault.step={steps[0]}", f"+fault.extra=[{extra}]", *overrides,
                            logger=logger)
    assert summary["status"] == "completed", summary.get("error")
    recs = summary["recoveries"]
    assert len(recs) == kills, recs
    return {
        "detected": [r["detect_s"] for r in recs],
        "decided (decide phase)": [r["decide_s"] for r in recs],
        "survivors ready": [r["survivors_ready_s"] for r in recs],
        "full world commits": [r["rto_s"] for r in recs],
        "replacement start-up": [r["replace_s"] for r in recs],
        "complete group rebuild": [r["rebuild_s"] for r in recs],
        "restore to first commit": [r["restore_s"] for r in recs],
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
    shutil.rmtree(counts_dir)
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
        with tempfile.TemporaryDirectory(prefix="rr-restart-") as tmp:
            work = Path(tmp)
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


def print_decide_cost(at_once: dict[str, list[float]], window: dict[str, list[float]]) -> None:
    """The same FlashRecovery job deciding at once on a conclusive exit and always waiting for the window."""
    print(f"flashrecovery, decide-at-once on / off (heartbeat.decide_at_once=false: the decide window always waited), "
          f"{len(at_once['detected'])} kills each")
    for key in ("decided (decide phase)", "survivors ready", "full world commits"):
        on, off = statistics.median(at_once[key]), statistics.median(window[key])
        print(f"  {key:22s} off {median_spread(window[key])} s")
        print(f"  {'':22s} on  {median_spread(at_once[key])} s   off / on: {off / on:.2f}x")


STANDBY = ("ft.flashrecovery.standby=true", "runner.device=cpu")


def print_standby_cost(kills: int, ranks: int) -> None:
    """The same FlashRecovery job with and without a warm standby per host, run alternately (a shared host's load
    then weighs on both alike), the RTO and each of its phases."""
    off: dict[str, list[float]] = {}
    on: dict[str, list[float]] = {}
    for _ in range(2):
        for out, overrides in ((off, ()), (on, STANDBY)):
            for key, values in flashrecovery(kills, ranks, *overrides).items():
                out.setdefault(key, []).extend(values)
    print(f"flashrecovery, standby off / on (ft.flashrecovery.standby), 2 jobs of {kills} kills each")
    for key in ("detected", "replacement start-up", "complete group rebuild", "restore to first commit",
                "full world commits"):
        print(f"  {key:24s} off {median_spread(off[key])} s")
        print(f"  {'':24s} on  {median_spread(on[key])} s")
    full_off, full_on = statistics.median(off["full world commits"]), statistics.median(on["full world commits"])
    print(f"  full world back, off / on: {full_off / full_on:.2f}x")
    print("  target (one host): full world back <= 0.1 s")


PER_HOST_LAYOUT = ["parallel.nodes=2", "parallel.procs_per_node=2", "parallel.spares=2", "ft=[flashrecovery,deadpool]",
                   "trainer.max_steps=20"]
QUIET_EVENTS = "runner.console_events=false"  # local_hosts.BASE has the rest of common.QUIET
FAULT_STEP = 8  # the worker kill; a host is lost once step LOSE_AFTER is committed
LOSE_AFTER = 5


def launch_local(fault: str) -> dict:
    """One launcher=local job with the fault; its recovery, the times from the injection."""
    kill = {"crash": ["fault=kill_rank", "fault.rank=3"], "host": ["fault=kill_node", "fault.node=1"]}[fault]
    summary, _, _ = run_cli("+recipe=gpt_tiny", *PER_HOST_LAYOUT, *kill, f"fault.step={FAULT_STEP}")
    assert summary["status"] == "completed", summary.get("error")
    (rec,) = summary["recoveries"]
    return {"decided": rec["t_decide"] - rec["t_fault"], "full world commits": rec["rto_s"]}


def launch_per_host(fault: str) -> dict:
    """One job of three torchrun trees (hosts) with the fault: a worker killed by the controller, or host 1's tree
    powered off from here; the times from the kill."""
    job_dir = Path(tempfile.mkdtemp(prefix="rr-bench-"))
    job = local_hosts.Job(job_dir / "run")
    env = {"RESILIENT_RUNNER_SECRET": secrets.token_hex(16)}
    try:
        if fault == "crash":
            rdzv = local_hosts.c10d_rendezvous()
            for _ in range(3):
                job.torchrun(3, 1, rdzv, 0, "launcher.mode=per_host", *PER_HOST_LAYOUT, QUIET_EVENTS, "fault=kill_rank",
                             "fault.rank=3", f"fault.step={FAULT_STEP}", extra_env=env)
            assert job.wait(timeout_s=600) == [0, 0, 0], job.output()
            t_kill = None
        else:
            trees = job.hosts_behind_the_rendezvous_store(3, *PER_HOST_LAYOUT, QUIET_EVENTS, extra_env=env)
            local_hosts.wait_for("training", lambda: local_hosts.max_step(job.run_dir) >= LOSE_AFTER, procs=trees,
                                 timeout_s=600)
            t_kill = time.time()
            rest = job.lose_host(trees, 1)
            summary_path = job.run_dir / "summary.json"
            local_hosts.wait_for("the summary", summary_path.exists, procs=rest, timeout_s=600)
            # node 0 arrives in torchrun's exit barrier for the lost host: the survivors' torchruns end too
            local_hosts.wait_for("every process of the job to end", lambda: not local_hosts.processes_of(job.token),
                                 timeout_s=120)
        summary = json.loads((job.run_dir / "summary.json").read_text())
    finally:
        job.close()
    assert summary["status"] == "completed", summary.get("error")
    shutil.rmtree(job_dir)  # read; a job that failed keeps its dir for a look
    (rec,) = summary["recoveries"]
    t0 = rec["t_fault"] if t_kill is None else t_kill
    return {"decided": rec["t_decide"] - t0, "full world commits": rec["t_first_commit"] - t0}


def print_launchers(launchers: list[str], runs: int) -> None:
    """RTO phases of the same faults under each launcher, and the ratios against the first one."""
    faults = {"crash": "worker killed (restarted in place)", "host": "host 1 lost (spare host takes over)"}
    measured: dict[str, dict[str, dict[str, list[float]]]] = {}
    start = {"local": launch_local, "per_host": launch_per_host}
    for fault in faults:
        got: dict[str, list[dict]] = {launcher: [] for launcher in launchers}
        for _ in range(runs):  # the launchers alternately: a shared host's load then weighs on each alike
            for launcher in launchers:
                got[launcher].append(start[launcher](fault))
        measured[fault] = {launcher: {k: [g[k] for g in jobs] for k in jobs[0]} for launcher, jobs in got.items()}
    print("launchers: 2 training hosts of 2 ranks + 1 spare host, gpt_tiny, ft=[flashrecovery,deadpool], "
          f"default heartbeat (100 ms x 10), {runs} job(s) per fault and launcher")
    key, first = "full world commits", launchers[0]
    for fault, title in faults.items():
        print(f"  {title}")
        for launcher in launchers:
            m = measured[fault][launcher]
            print(f"    {launcher:9s} kill -> loss decided       {median_spread(m['decided'])} s")
            print(f"    {launcher:9s} kill -> full world commits {median_spread(m[key])} s")
        for launcher in launchers[1:]:
            ratio = statistics.median(measured[fault][launcher][key]) / statistics.median(measured[fault][first][key])
            print(f"    ratio {launcher} / {first} (full world back): {ratio:.2f}x   target <= 1.2x")
    print("  targets: worker crash -> full world back <= 0.5 s; host loss -> full world back <= 1.5 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--swaps", type=int, default=3, help="DeadPool hot-swap jobs (one node loss each)")
    ap.add_argument("--emit-calibration", metavar="FILE", help="write the simulator's calibration JSON here")
    ap.add_argument("--loggers-only", action="store_true",
                    help="only the FlashRecovery RTO with logger=none beside logger=wandb")
    ap.add_argument("--decide-only", action="store_true",
                    help="only the FlashRecovery RTO phases with decide-at-once on beside off")
    ap.add_argument("--standby-only", action="store_true",
                    help="only the FlashRecovery RTO phases with a warm standby per host off beside on")
    ap.add_argument("--world", metavar="N,N,...", help="only the recovery cost against world size, e.g. 4,8,16")
    ap.add_argument("--launcher", metavar="L,L,...", help="only the same faults under these launchers: local,per_host")
    ap.add_argument("--runs", type=int, default=3, help="jobs per fault and launcher (--launcher)")
    args = ap.parse_args()
    if args.world:
        print_world([int(n) for n in args.world.split(",")])
        return
    if args.launcher:
        print_launchers(args.launcher.split(","), args.runs)
        return
    if args.standby_only:
        print_standby_cost(args.kills, args.ranks)
        return
    ours = flashrecovery(args.kills, args.ranks)
    if not args.loggers_only:
        print_decide_cost(ours, flashrecovery(args.kills, args.ranks, "heartbeat.decide_at_once=false"))
    if not args.decide_only:
        print_logger_cost(ours, flashrecovery(args.kills, args.ranks, logger="wandb"))
    if args.loggers_only or args.decide_only:
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
