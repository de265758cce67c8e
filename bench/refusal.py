"""How long a refused config takes to answer: ``python -m runner`` with a wrong key, against the same refusal in a
process that imports torch first (what validation paid while its imports reached torch).

The two are run alternately, ``--repeats`` times each, so a drift of the host's speed touches both; each must exit 2.
The medians and their ratio are printed.

    python bench/refusal.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import ROOT

REFUSED = ["+recipe=gpt_tiny", "+foo=1"]  # a key the schema does not have: composed, validated, refused


def refusal_s(torch_first: bool, run_dir: str) -> float:
    """Wall time of one refused run (exit 2 checked)."""
    args = [*REFUSED, f"hydra.run.dir={run_dir}"]
    code = ("import sys, runpy" + (", torch" if torch_first else "")
            + f"; sys.argv = ['runner', *{args!r}]; runpy.run_module('runner', run_name='__main__', alter_sys=True)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    assert done.returncode == 2, done.stderr[-2000:]
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="rr-refusal-") as run_dir:
        for _ in range(repeats):
            for torch_first in (True, False):
                times[torch_first].append(refusal_s(torch_first, run_dir))
    now, before = statistics.median(times[False]), statistics.median(times[True])
    print(f"refused config ({' '.join(REFUSED)}), medians of {repeats}:")
    print(f"  as it runs                {now:.2f} s (min {min(times[False]):.2f})")
    print(f"  with torch imported first {before:.2f} s (min {min(times[True]):.2f})")
    print(f"  ratio {now / before:.2f}")


if __name__ == "__main__":
    main()
