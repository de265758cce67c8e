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

A ratio is taken within each round (candidate / its baseline, run one after the other) and the
median over rounds is reported: the host's speed drifts between minutes, which the pairing
cancels. Single rounds still spread by about +-5% here (also for ft=[flashrecovery], whose
fault-free work is the same as ft=[]'s), so the default is 200 steps and 5 rounds (~6 minutes).

    python bench/overhead.py [--ranks 4] [--steps 200] [--rounds 5]
"""

from __future__ import annotations

import statistics

from common import median_spread, run_cli, steady_steps_per_s, throughput_args

SKIP = 10  # start-up and warm-up steps left out


def layouts(ranks: int) -> dict[str, list[str]]:
    one_node = ["parallel.nodes=1", f"parallel.procs_per_node={ranks}"]
    two_nodes = ["parallel.nodes=2", f"parallel.procs_per_node={ranks // 2}", "parallel.zero=1"]
    return {
        "ft=[]": [*one_node, "ft=[]"],
        "ft=[flashrecovery]": [*one_node, "ft=[flashrecovery]"],
        "zero=1 ft=[]": [*two_nodes, "ft=[]"],
        "zero=1 ft=[deadpool]": [*two_nodes, "ft=[deadpool]", "parallel.spares=1"],
        "zero=1 ft=[] again": [*two_nodes, "ft=[]"],
    }


def steps_per_s(steps: int, overrides: list[str]) -> float:
    summary, metrics, _ = run_cli("+recipe=gpt_tiny", f"trainer.max_steps={steps}", *overrides)
    assert summary["status"] == "completed", summary.get("error")
    return steady_steps_per_s(metrics, SKIP)


def main() -> None:
    args = throughput_args(__doc__, steps=200, rounds=5)
    runs = layouts(args.ranks)
    results: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, overrides in runs.items():
            results[name].append(steps_per_s(args.steps, overrides))
    print(f"gpt_tiny, {args.ranks} ranks, steps {SKIP}..{args.steps}, interleaved rounds: {args.rounds}")
    for name, values in results.items():
        print(f"  {name:22s} steps/s {median_spread(values)}")
    for candidate, base, target in (("ft=[flashrecovery]", "ft=[]", "target >= 0.99"),
                                    ("zero=1 ft=[deadpool]", "zero=1 ft=[]", "target >= 0.99"),
                                    ("zero=1 ft=[] again", "zero=1 ft=[]", "control: the same work, ideally 1.000")):
        ratios = [c / b for c, b in zip(results[candidate], results[base])]
        print(f"  ratio {candidate} / {base}: {statistics.median(ratios):.3f} "
              f"(per round {', '.join(f'{r:.3f}' for r in ratios)})   {target}")


if __name__ == "__main__":
    main()
