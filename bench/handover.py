"""Cost of handing state between replicas: the packed format (``runner.training.packed``) against
``torch.save`` / ``torch.load(weights_only=True)``, which the hand-over used before, in one process.

The state is what a joiner receives: gpt_tiny's (the schema's default GPT) parameters and AdamW
state after one step, in nested dicts as Lightning's checkpoint holds them. The two formats are timed
alternately, ``--repeats`` times each, so a drift of the host's speed touches both; the medians and
their ratios are printed, for the source (object -> bytes) and the joiner (bytes -> object).

    python bench/handover.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time

import torch
from common import ROOT

sys.path.insert(0, str(ROOT))  # this checkout's runner, also when another one is installed
from runner.config.schema import GPTConfig  # noqa: E402
from runner.model import GPT  # noqa: E402
from runner.training.packed import from_bytes, to_bytes  # noqa: E402


def joiner_state() -> dict:
    """gpt_tiny's parameters and AdamW state after one step, as a checkpoint nests them."""
    model = GPT(GPTConfig())
    opt = torch.optim.AdamW(model.parameters())
    idx = torch.randint(0, GPTConfig().vocab_size, (2, GPTConfig().seq_len))
    model(idx).float().mean().backward()
    opt.step()
    return {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": 1}


def save(obj: dict) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)


def load(data: torch.Tensor) -> dict:
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


def timed(fn, arg) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(arg)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    state = joiner_state()
    times: dict[str, list[float]] = {k: [] for k in ("save", "load", "pack", "unpack")}
    for _ in range(args.repeats):
        t, saved = timed(save, state)
        times["save"].append(t)
        times["load"].append(timed(load, saved)[0])
        t, packed = timed(to_bytes, state)
        times["pack"].append(t)
        times["unpack"].append(timed(from_bytes, packed)[0])
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"gpt_tiny parameters + AdamW state, {args.repeats} alternating repeats, medians:")
    print(f"  source: torch.save {med['save']:.1f} ms, packed {med['pack']:.1f} ms   ratio "
          f"{med['pack'] / med['save']:.2f}")
    print(f"  joiner: torch.load {med['load']:.1f} ms, packed {med['unpack']:.1f} ms   ratio "
          f"{med['unpack'] / med['load']:.2f}")


if __name__ == "__main__":
    main()
