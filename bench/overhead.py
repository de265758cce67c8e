"""Fault-free cost of fault tolerance: steps/s with and without it, interleaved, in one invocation.

Three comparisons, each against a baseline measured in the same rounds:
- ft=[flashrecovery] against ft=[] (replicated optimizer state, one node): heartbeats and the
  controller run in both (they are how a run without fault tolerance still fails fast instead of
  hanging); what ft adds is the recovery machinery, which must cost nothing while no fault happens.
- ft=[deadpool] against ft=[], both with parallel.zero=1 on 2 nodes, once per replication mode
  (ft.deadpool.replication): replay (the default), where each holder applies its partner's update to
  its replica itself and no shard bytes go over the network per step, and copy, where every rank
  sends its whole shard to its holder after every update. Either must hide under the next step's
  compute (the one idle hot spare DeadPool needs is started too). Each mode's bytes sent per rank and
  step are printed beside it: once seeded, and averaged over the run (the seeds and digests included).
- the replica check (trainer.replica_check_every_n_steps) every step and every 10 steps (the default)
  against the check off (``--replica-check-only`` runs these alone, one node, ft=[]): a fingerprint of
  the parameters on a check step, slots in the last bucket of the all-reduce every step.
Targets: the ratios of ft=[flashrecovery], DeadPool's replay and the replica check >= 0.99.
A third ratio is the control: ``zero=1 ft=[]`` run again after the others in each round, over
its first run. Its work is identical, so how far it lands from 1.000 is the resolution of this
run's ratios on this host.

Two workloads. gpt_tiny carries ~128 tokens per rank and step (a step of a few ms of compute), so
any fixed per-step CPU work shows. The realistic one (d_model 256, 4 heads, 2 layers, seq 512, 4
samples per rank: 2048 tokens per rank and step) has DeadPool's replicated shard about as large
relative to the step as on a GPU cluster: there, gpt13b's plan (tp=8, dp=8, ZeRO-1) replicates
12 bytes x 1.84 B parameters / 8 = 2.8 GB per rank and step, ~55 ms at 50 GB/s against a step of
2.7 PFLOP per rank, ~7 s at 400 TFLOP/s: ~1%. Here ~5 MB per rank and step go over loopback gloo
(a few ms) against a step of ~26 GFLOP per rank (about a second on a shared core). The realistic
workload compares the ZeRO-1 layouts only (steps: --realistic-steps).

Beside steps/s each run reports the CPU seconds per step of all its processes (controller, fork servers, node
agents, ranks, the spare and its agent; bench/tree_cpu.py) over the same steps, and each comparison its ratio
base / candidate per pair of rounds. It leaves out the time other jobs take from the run, not the caches and
preemption they bring; with more ranks than cores, as here, the cores never idle and it is about the steps/s
ratio a quiet host would give (docs/recovery.md breaks DeadPool's down by process and thread).

Rounds come in pairs: the runs of a round go in the listed order, those of the next round in the
reverse order, so a drift of the host's speed within a round (which a fixed order turns into a
bias: the same work ran 3% slower third than first in one run) favours a run in one round of the
pair as much as it hurts it in the other. A ratio is taken per pair of rounds (the geometric mean of
its two rounds' candidate / baseline) and the median over pairs is reported. Single rounds spread by
about +-5% here (also for ft=[flashrecovery], whose fault-free work is the same as ft=[]'s), so the
default is 200 steps (gpt_tiny), 30 (realistic) and 6 rounds (~40 minutes on the shared 2-core
host: a realistic step takes 1-3 s there); --realistic-only skips the gpt_tiny runs.

    python bench/overhead.py [--ranks 4] [--steps 200] [--realistic-steps 30] [--rounds 6] [--realistic-only]
                             [--replica-check-only]
"""

from __future__ import annotations

import math
import statistics
import time

import torch
from common import median_spread, run_cli, steady_steps_per_s, throughput_args
from tree_cpu import TreeCPU

from runner.training.replica_check import fingerprint

SKIP = 10  # start-up and warm-up steps left out
REALISTIC = ["model.d_model=256", "model.n_head=4", "model.n_layer=2", "model.seq_len=512"]
REALISTIC_SAMPLES_PER_RANK = 4  # x seq 512 = 2048 tokens per rank and step


def layouts(ranks: int) -> dict[str, list[str]]:
    one_node = ["parallel.nodes=1", f"parallel.procs_per_node={ranks}"]
    two_nodes = ["parallel.nodes=2", f"parallel.procs_per_node={ranks // 2}", "parallel.zero=1"]
    realistic = [*two_nodes, *REALISTIC, f"trainer.global_batch_size={REALISTIC_SAMPLES_PER_RANK * ranks}"]
    deadpool = ["ft=[deadpool]", "parallel.spares=1"]
    return {
        "ft=[]": [*one_node, "ft=[]"],
        "ft=[flashrecovery]": [*one_node, "ft=[flashrecovery]"],
        "zero=1 ft=[]": [*two_nodes, "ft=[]"],
        "zero=1 ft=[deadpool] replay": [*two_nodes, *deadpool, "ft.deadpool.replication=replay"],
        "zero=1 ft=[deadpool] copy": [*two_nodes, *deadpool, "ft.deadpool.replication=copy"],
        "zero=1 ft=[] again": [*two_nodes, "ft=[]"],
        "check off": [*one_node, "ft=[]", "trainer.replica_check_every_n_steps=0"],
        "check every step": [*one_node, "ft=[]", "trainer.replica_check_every_n_steps=1"],
        "check every 10 steps": [*one_node, "ft=[]", "trainer.replica_check_every_n_steps=10"],
        "check off again": [*one_node, "ft=[]", "trainer.replica_check_every_n_steps=0"],
        "realistic zero=1 ft=[]": [*realistic, "ft=[]"],
        "realistic zero=1 ft=[deadpool] replay": [*realistic, *deadpool, "ft.deadpool.replication=replay"],
        "realistic zero=1 ft=[deadpool] copy": [*realistic, *deadpool, "ft.deadpool.replication=copy"],
        "realistic zero=1 ft=[] again": [*realistic, "ft=[]"],
    }


COMPARISONS = (
    ("ft=[flashrecovery]", "ft=[]", "target >= 0.99"),
    ("zero=1 ft=[deadpool] replay", "zero=1 ft=[]", "target >= 0.99"),
    ("zero=1 ft=[deadpool] copy", "zero=1 ft=[]", "the per-step copy, for comparison"),
    ("zero=1 ft=[] again", "zero=1 ft=[]", "control: the same work, ideally 1.000"),
    ("check every step", "check off", "target >= 0.99"),
    ("check every 10 steps", "check off", "target >= 0.99"),
    ("check off again", "check off", "control: the same work, ideally 1.000"),
    ("realistic zero=1 ft=[deadpool] replay", "realistic zero=1 ft=[]", "target >= 0.99"),
    ("realistic zero=1 ft=[deadpool] copy", "realistic zero=1 ft=[]", "the per-step copy, for comparison"),
    ("realistic zero=1 ft=[] again", "realistic zero=1 ft=[]", "control: the same work, ideally 1.000"),
)


def measure(steps: int, overrides: list[str]) -> tuple[float, float, dict]:
    """Steady steps/s of one run, the CPU seconds per step of all its processes over the same steps, its summary."""
    cpu = TreeCPU()
    summary, metrics, _ = run_cli("+recipe=gpt_tiny", f"trainer.max_steps={steps}", *overrides, cpu=cpu)
    assert summary["status"] == "completed", summary.get("error")
    steady = [m for m in metrics if m["step"] >= SKIP]
    cpu_per_step = cpu.seconds_between(steady[0]["t"], steady[-1]["t"]) / (len(steady) - 1)
    return steady_steps_per_s(metrics, SKIP), cpu_per_step, summary


def pair_ratios(candidate: list[float], base: list[float]) -> list[float]:
    """candidate / base per pair of rounds (one in each order): the geometric mean of the pair's two ratios."""
    per_round = [c / b for c, b in zip(candidate, base)]
    return [math.sqrt(per_round[i] * per_round[i + 1]) for i in range(0, len(per_round) - 1, 2)]


def main() -> None:
    args = throughput_args(__doc__, steps=200, rounds=6, realistic_steps=30,
                           only=[("--replica-check-only", "run only the replica check's comparison")])
    if args.rounds % 2:
        raise SystemExit(f"--rounds {args.rounds}: give an even number (rounds run in pairs, one in each order)")
    runs = {name: overrides for name, overrides in layouts(args.ranks).items()
            if (name.startswith("check") if args.replica_check_only else
                name.startswith("realistic") or not args.realistic_only)}
    comparisons = [c for c in COMPARISONS if c[0] in runs]
    results: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    sent: dict[str, tuple[float, float]] = {}  # bytes per rank and step: once seeded, and over the run
    for round_index in range(args.rounds):
        ordered = list(runs.items())
        for name, overrides in ordered if round_index % 2 == 0 else reversed(ordered):
            steps = args.realistic_steps if name.startswith("realistic") else args.steps
            rate, cpu_per_step, summary = measure(steps, overrides)
            results[name].append(rate)
            cpu[name].append(cpu_per_step)
            if "deadpool" in name:
                ranks_steps = summary["world_size"] * steps
                sent[name] = (summary["replication_bytes_per_step"] / summary["world_size"],
                              summary["replication_bytes_sent"] / ranks_steps)
    if args.replica_check_only:
        print(fingerprint_cost())
    tiny = "" if args.realistic_only else f"steps {SKIP}..{args.steps} (gpt_tiny, ~128 tokens per rank and step)"
    realistic = "" if args.replica_check_only else (
        f"{' and ' if tiny else ''}steps {SKIP}..{args.realistic_steps} (realistic: {' '.join(REALISTIC)}, "
        f"{REALISTIC_SAMPLES_PER_RANK * 512} tokens per rank and step)")
    print(f"{args.ranks} ranks, {tiny}{realistic}, rounds: {args.rounds}, every other one in reverse order")
    for name, values in results.items():
        print(f"  {name:38s} steps/s {median_spread(values)}")
        print(f"  {'':38s} CPU s per step, all processes of the run, {median_spread(cpu[name])}")
        if name in sent:
            steady, average = sent[name]
            print(f"  {'':38s} replication bytes sent per rank and step: {steady:,.0f} once seeded, "
                  f"{average:,.0f} over the run (seeds and digests included)")
    for candidate, base, target in comparisons:
        ratios = pair_ratios(results[candidate], results[base])
        print(f"  ratio {candidate} / {base}: {statistics.median(ratios):.3f} "
              f"(per pair of rounds {', '.join(f'{r:.3f}' for r in ratios)})   {target}")
        cpu_ratios = pair_ratios(cpu[base], cpu[candidate])
        print(f"    CPU per step {base} / {candidate}: {statistics.median(cpu_ratios):.3f} "
              f"(per pair of rounds {', '.join(f'{r:.3f}' for r in cpu_ratios)})")


def fingerprint_cost() -> str:
    """What one check step adds on a rank, in this process: the fingerprint of gpt_tiny's and of a 25 M-parameter
    model's float32 parameters (median of 5)."""
    out = []
    for name, numel in (("gpt_tiny", 120_000), ("25M parameters", 25_000_000)):
        params = [torch.randn(numel // 10) for _ in range(10)]
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fingerprint(params)
            times.append(time.perf_counter() - t0)
        out.append(f"{name} {statistics.median(times) * 1e3:.2f} ms")
    return "fingerprint of the parameters (one rank, one check step): " + ", ".join(out)


if __name__ == "__main__":
    main()
