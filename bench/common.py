"""Shared by the bench scripts: run the real CLI, read its outputs, summarise timings robustly."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from tree_cpu import TreeCPU

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["trainer.progress_bar=false", "runner.console_events=false"]


def run_cli(*overrides: str, timeout: float = 900, logger: str = "none",
            cpu: Optional[TreeCPU] = None) -> tuple[dict, list[dict], list[dict]]:
    """One ``python -m runner`` job with experiment logger ``logger`` (none unless a bench measures one);
    returns (summary, metrics, events). ``cpu`` follows the CPU time of the job's processes."""
    run_dir = Path(tempfile.mkdtemp(prefix="rr-bench-")) / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with subprocess.Popen([sys.executable, "-m", "runner", *overrides, f"logger={logger}", *QUIET,
                           f"hydra.run.dir={run_dir}"],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        if cpu is not None:
            cpu.follow(proc.pid)
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()  # as subprocess.run does
            raise
        finally:
            if cpu is not None:
                cpu.stop()
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise RuntimeError(f"run failed before writing a summary:\n{stderr[-3000:]}")

    def read(name: str) -> list[dict]:
        return [json.loads(x) for x in (run_dir / name).read_text().splitlines() if x.strip()]

    outputs = json.loads(summary_path.read_text()), read("metrics.jsonl"), read("events.jsonl")
    shutil.rmtree(run_dir.parent)  # read; a run that failed before its summary keeps its dir for a look
    return outputs


def steady_steps_per_s(metrics: list[dict], skip: int) -> float:
    """Committed steps per second after the first ``skip`` steps (start-up and warm-up excluded)."""
    steady = [m for m in metrics if m["step"] >= skip]
    span = steady[-1]["t"] - steady[0]["t"]
    return (len(steady) - 1) / span


def median_spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f}, n={len(values)})"


def throughput_args(doc: str, steps: int = 80, rounds: int = 3, realistic_steps: int = 0,
                    only: Sequence[tuple[str, str]] = ()) -> argparse.Namespace:
    """--ranks, --steps and --rounds of the interleaved steps/s comparisons (and --realistic-steps when a
    bench has a second, heavier workload; ``only``: (flag, help) of switches that run one comparison alone)."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--rounds", type=int, default=rounds)
    if realistic_steps:
        ap.add_argument("--realistic-steps", type=int, default=realistic_steps)
        ap.add_argument("--realistic-only", action="store_true", help="skip the light workload's runs")
    for flag, text in only:
        ap.add_argument(flag, action="store_true", help=text)
    return ap.parse_args()
