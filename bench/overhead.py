"""Fault-free cost of fault tolerance: steps/s with ft=[flashrecovery] against ft=[], interleaved.

Heartbeats and the controller run in both (they are how a run without fault tolerance still
fails fast instead of hanging); what ft adds is the recovery machinery, which must cost nothing
while no fault happens. Target ratio >= 0.99.

    python bench/overhead.py [--ranks 4] [--steps 80] [--rounds 3]
"""

from __future__ import annotations

import statistics

from common import median_spread, throughput_args
from throughput import ours_steps_per_s

MIXES = {"ft=[]": "ft=[]", "ft=[flashrecovery]": "ft=[flashrecovery]"}


def main() -> None:
    args = throughput_args(__doc__)
    skip = 10
    results: dict[str, list[float]] = {name: [] for name in MIXES}
    for _ in range(args.rounds):
        for name, override in MIXES.items():
            results[name].append(ours_steps_per_s(args.ranks, args.steps, skip, override))
    base = statistics.median(results["ft=[]"])
    print(f"gpt_tiny, {args.ranks} ranks, steps {skip}..{args.steps}, interleaved rounds: {args.rounds}")
    for name, values in results.items():
        print(f"  {name:20s} steps/s {median_spread(values)}   ratio vs ft=[] {statistics.median(values) / base:.3f}")
    print("  target: ft=[flashrecovery] / ft=[] >= 0.99")


if __name__ == "__main__":
    main()
