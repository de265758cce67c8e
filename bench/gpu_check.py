"""GPU/NCCL check of the recovery path, for a host with 2 or more GPUs (CI has none).

Runs gpt_tiny on every GPU (one rank each, NCCL), fault-free and then with a rank SIGKILLed and
a transient error, and checks that both faulty runs complete with the fault-free run's
parameter checksum. Prints the RTO of each recovery. Exit status 0 only if everything matched.

    python bench/gpu_check.py [--steps 40]
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import run_cli


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"needs 2 or more GPUs for an NCCL group; this host has {gpus}", file=sys.stderr)
        return 2
    base = ["+recipe=gpt_tiny", "runner.device=cuda", "parallel.backend=nccl", "parallel.nodes=1",
            f"parallel.procs_per_node={gpus}", f"trainer.global_batch_size={2 * gpus}",
            f"trainer.max_steps={args.steps}", "ft=[flashrecovery]"]
    clean, _, _ = run_cli(*base)
    print(f"fault-free: {clean['status']}, checksum {clean['param_checksum']}")
    ok = clean["status"] == "completed"
    for fault in (["fault=kill_rank", "fault.rank=1", f"fault.step={args.steps // 2}"],
                  ["fault=transient", "fault.rank=0", f"fault.step={args.steps // 3}"]):
        summary, _, _ = run_cli(*base, *fault)
        same = summary["param_checksum"] == clean["param_checksum"]
        rto = [round(r["rto_s"] or -1, 3) for r in summary["recoveries"]]
        print(f"{fault[0]}: {summary['status']}, RTO {rto} s, checksum equal to fault-free: {same}"
              + (f", error: {summary.get('error')}" if summary["status"] != "completed" else ""))
        ok = ok and summary["status"] == "completed" and same
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
