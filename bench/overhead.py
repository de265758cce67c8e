"""Fault-free cost of fault tolerance: steps/s with and without it, interleaved, in one invocation.

Two comparisons, each against a baseline measured in the same rounds:
- ft=[flashrecovery] against ft=[] (replicated optimizer state, one node): heartbeats and the
  controller run in both (they are how a run without fault tolerance still fails fast instead of
  hanging); what ft adds is the recovery machinery, which must cost nothing while no fault happens.
- ft=[deadpool] against ft=[], both with parallel.zero=1 on 2 nodes: DeadPool adds the per-step
  replication of every optimizer shard to a neighbour, which must hide under the next step's compute
  (the one idle hot spare it needs is started too).
Targets: both ratios >= 0.99.
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

A ratio is taken within each round (candidate / its baseline, run one after the other) and the
median over rounds is reported: the host's speed drifts between minutes, which the pairing
cancels. Single rounds still spread by about +-5% here (also for ft=[flashrecovery], whose
fault-free work is the same as ft=[]'s), so the default is 200 steps (gpt_tiny), 30 (realistic)
and 5 rounds (~30 minutes on the shared 2-core host: a realistic step takes 1-3 s there).

    python bench/overhead.py [--ranks 4] [--steps 200] [--realistic-steps 30] [--rounds 5]
"""

from __future__ import annotations

import statistics

from common import median_spread, run_cli, steady_steps_per_s, throughput_args

SKIP = 10  # start-up and warm-up steps left out
REALISTIC = ["model.d_model=256", "model.n_head=4", "model.n_layer=2", "model.seq_len=512"]
REALISTIC_SAMPLES_PER_RANK = 4  # x seq 512 = 2048 tokens per rank and step


def layouts(ranks: int) -> dict[str, list[str]]:
    one_node = ["parallel.nodes=1", f"parallel.procs_per_node={ranks}"]
    two_nodes = ["parallel.nodes=2", f"parallel.procs_per_node={ranks // 2}", "parallel.zero=1"]
    realistic = [*two_nodes, *REALISTIC, f"trainer.global_batch_size={REALISTIC_SAMPLES_PER_RANK * ranks}"]
    return {
        "ft=[]": [*one_node, "ft=[]"],
        "ft=[flashrecovery]": [*one_node, "ft=[flashrecovery]"],
        "zero=1 ft=[]": [*two_nodes, "ft=[]"],
        "zero=1 ft=[deadpool]": [*two_nodes, "ft=[deadpool]", "parallel.spares=1"],
        "zero=1 ft=[] again": [*two_nodes, "ft=[]"],
        "realistic zero=1 ft=[]": [*realistic, "ft=[]"],
        "realistic zero=1 ft=[deadpool]": [*realistic, "ft=[deadpool]", "parallel.spares=1"],
        "realistic zero=1 ft=[] again": [*realistic, "ft=[]"],
    }


COMPARISONS = (
    ("ft=[flashrecovery]", "ft=[]", "target >= 0.99"),
    ("zero=1 ft=[deadpool]", "zero=1 ft=[]", "target >= 0.99"),
    ("zero=1 ft=[] again", "zero=1 ft=[]", "control: the same work, ideally 1.000"),
    ("realistic zero=1 ft=[deadpool]", "realistic zero=1 ft=[]", "target >= 0.99"),
    ("realistic zero=1 ft=[] again", "realistic zero=1 ft=[]", "control: the same work, ideally 1.000"),
)


def measure(steps: int, overrides: list[str]) -> tuple[float, dict]:
    """Steady steps/s of one run, and its summary."""
    summary, metrics, _ = run_cli("+recipe=gpt_tiny", f"trainer.max_steps={steps}", *overrides)
    assert summary["status"] == "completed", summary.get("error")
    return steady_steps_per_s(metrics, SKIP), summary


def main() -> None:
    args = throughput_args(__doc__, steps=200, rounds=5, realistic_steps=30)
    runs = layouts(args.ranks)
    results: dict[str, list[float]] = {name: [] for name in runs}
    shard_mb: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, overrides in runs.items():
            steps = args.realistic_steps if name.startswith("realistic") else args.steps
            rate, summary = measure(steps, overrides)
            results[name].append(rate)
            if "deadpool" in name:
                shard_mb[name] = summary.get("replication_bytes_per_step", 0) / summary["world_size"] / 2**20
    print(f"{args.ranks} ranks, steps {SKIP}..{args.steps} (gpt_tiny, ~128 tokens per rank and step) and "
          f"{SKIP}..{args.realistic_steps} (realistic: {' '.join(REALISTIC)}, "
          f"{REALISTIC_SAMPLES_PER_RANK * 512} tokens per rank and step), interleaved rounds: {args.rounds}")
    for name, values in results.items():
        shard = f"   shard replicated {shard_mb[name]:.2f} MiB per rank and step" if name in shard_mb else ""
        print(f"  {name:32s} steps/s {median_spread(values)}{shard}")
    for candidate, base, target in COMPARISONS:
        ratios = [c / b for c, b in zip(results[candidate], results[base])]
        print(f"  ratio {candidate} / {base}: {statistics.median(ratios):.3f} "
              f"(per round {', '.join(f'{r:.3f}' for r in ratios)})   {target}")


if __name__ == "__main__":
    main()
