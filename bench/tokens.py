"""Cost of drawing a synthetic batch (``runner.data.SyntheticTokens``): the chain walked in numpy, as the runner
does, against the same walk as torch indexing (how it was written before), in one process.

Both walk gpt_tiny's chain (the schema's vocabulary and context) from the same draws and must give the same
tokens; they are timed alternately, ``--repeats`` times each, so a drift of the host's speed touches both, and the
medians and their ratio are printed per micro-batch size.

    python bench/tokens.py [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from common import ROOT

sys.path.insert(0, str(ROOT))  # this checkout's runner, also when another one is installed
from runner.config.schema import GPTConfig  # noqa: E402
from runner.data import SyntheticTokens  # noqa: E402


def torch_walk(source: SyntheticTokens, seed: int) -> torch.Tensor:
    """The baseline: the same draws, the walk as one torch indexing per position."""
    g = torch.Generator().manual_seed(seed)
    n, t = source.micro_batch, source.seq_len + 1
    choice = torch.randint(0, source.successors.shape[1], (n, t), generator=g)
    seq = torch.empty(n, t, dtype=torch.long)
    seq[:, 0] = torch.randint(0, source.vocab, (n,), generator=g)
    for i in range(1, t):
        seq[:, i] = source.successors[seq[:, i - 1], choice[:, i]]
    return seq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    repeats = parser.parse_args().repeats
    shape = GPTConfig()
    print(f"a synthetic batch, vocabulary {shape.vocab_size}, context {shape.seq_len}, medians of {repeats}:")
    for micro_batch in (2, 4, 16):
        source = SyntheticTokens(0, shape.vocab_size, shape.seq_len, micro_batch)
        times: dict[str, list[float]] = {"numpy": [], "torch": []}
        for seed in range(repeats):
            t0 = time.perf_counter()
            ours = source._sequences(seed)
            t1 = time.perf_counter()
            theirs = torch_walk(source, seed)
            t2 = time.perf_counter()
            assert torch.equal(ours, theirs), f"seed {seed}: the walks differ"
            times["numpy"].append(t1 - t0)
            times["torch"].append(t2 - t1)
        numpy_ms, torch_ms = (statistics.median(times[k]) * 1e3 for k in ("numpy", "torch"))
        print(f"  micro-batch {micro_batch:2d}: numpy walk {numpy_ms:.3f} ms, torch walk {torch_ms:.3f} ms, "
              f"ratio {numpy_ms / torch_ms:.2f}")


if __name__ == "__main__":
    main()
