"""Steps/s of the runner's Strategy against plain Lightning DDP, same model, data and ranks.

Runs are interleaved (ours, DDP, ours, DDP, ...) in one invocation so that machine noise hits
both alike; prints the median of each and their ratio (target >= 0.98). In both, every rank runs
in a session of its own (torchrun's and the runner's workers alike), so on a busy host whose
kernel schedules by session (autogroup) both get the same share of the CPUs. Two more rows run the
same ranks with tensor parallelism (parallel.tp=2) and with pipeline parallelism (parallel.pp=2, two
micro-batches per step), each with half as many replicas and the same global batch, against the
runner's pure DP; there is no target for them on CPU.

    python bench/throughput.py [--ranks 4] [--steps 80] [--rounds 3]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, median_spread, run_cli, steady_steps_per_s, throughput_args


def ddp_steps_per_s(ranks: int, steps: int, skip: int) -> float:
    with tempfile.TemporaryDirectory(prefix="rr-bench-ddp-") as tmp:
        out = Path(tmp) / "ddp.json"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                        str(ROOT / "bench" / "ddp_reference.py"), "--steps", str(steps), "--out", str(out)],
                       cwd=ROOT, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        t = json.loads(out.read_text())["t_commit"][skip:]
    return (len(t) - 1) / (t[-1] - t[0])


def ours_steps_per_s(ranks: int, steps: int, skip: int, *extra: str) -> float:
    summary, metrics, _ = run_cli("+recipe=gpt_tiny", "parallel.nodes=1", f"parallel.procs_per_node={ranks}",
                                  f"trainer.max_steps={steps}", *extra)
    assert summary["status"] == "completed", summary.get("error")
    return steady_steps_per_s(metrics, skip)


def main() -> None:
    args = throughput_args(__doc__)
    skip = 10
    ours, ddp = [], []
    split: dict[str, list[float]] = {"tp=2": [], "pp=2": []}
    for _ in range(args.rounds):
        ours.append(ours_steps_per_s(args.ranks, args.steps, skip))
        ddp.append(ddp_steps_per_s(args.ranks, args.steps, skip))
        if args.ranks % 2 == 0:
            for layout in split:
                split[layout].append(ours_steps_per_s(args.ranks, args.steps, skip, f"parallel.{layout}"))
    print(f"gpt_tiny, {args.ranks} ranks, gloo on CPU, steps {skip}..{args.steps} of each run")
    print(f"  runner strategy  steps/s {median_spread(ours)}")
    print(f"  Lightning DDP    steps/s {median_spread(ddp)}")
    print(f"  ratio (ours / DDP) {statistics.median(ours) / statistics.median(ddp):.3f}   target >= 0.98")
    for layout, rates in split.items():
        if rates:
            ratio = statistics.median(rates) / statistics.median(ours)
            replicas = f"{args.ranks // 2} replicas, same global batch"
            print(f"  runner {layout}      steps/s {median_spread(rates)}  ({replicas})")
            print(f"  ratio ({layout} / pure DP) {ratio:.3f}   no target on CPU")


if __name__ == "__main__":
    main()
