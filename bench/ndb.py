"""What taking over a failed rank's micro-batch costs the NDB neighbour, on CPU (one run, < 2 min).

Usage: ``.venv/bin/python bench/ndb.py`` from the repository root.

Each scenario is one training step of the neighbour (zero grads, then forward and backward):

* fault-free: its own micro-batch only;
* takeover: own micro-batch exact + the failed rank's with every approximation, then with each
  approximation off in turn, then with none (``exact_reference``); both graphs are alive together
  (one backward of the summed losses), as in a step that must finish both micro-batches;
* naive double: both micro-batches concatenated into one batch;
* one after the other: own forward+backward, then the extra's (gradient accumulation), exact or
  with all approximations: the memory-frugal order when nothing forces both graphs to coexist.

Time: fastest of interleaved repetitions after one warm-up (on a shared 2-core VM the noise is
additive and about +-15% per step, so the minimum is the steadiest estimate; the median is shown
too). "extra x full" is ``(t - t_fault_free) / t_fault_free``: the extra micro-batch's cost in
units of a full one.

Memory, two measures (tracemalloc cannot see torch's allocator, and torch has no CPU peak counter):

* activations: bytes of the distinct storages autograd saves for backward, collected with
  ``torch.autograd.graph.saved_tensors_hooks`` over a forward, parameters excluded. All of them
  are alive when its backward starts, so this is the activation memory the step holds (the
  largest over its forward/backward phases). It misses the short-lived recomputed FFN
  activations of one block during backward.
* peak alloc: the highest "Total Allocated" of torch.profiler's CPU memory events during the step,
  minus its value before the step's first allocation (so: bytes allocated in the step and alive
  together at the peak). Adds parameter gradients, temporaries and recomputation buffers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runner.model import GPT, GPTConfig  # noqa: E402
from runner.recovery.ndb.config import NDBConfig  # noqa: E402
from runner.recovery.ndb.lowrank import SVDCache, lowrank_rank  # noqa: E402
from runner.recovery.ndb.takeover import TakeoverForward  # noqa: E402

MODEL = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=8, d_model=384, dropout=0.0)
BATCH = 8
REPEATS = 8
ALL_ON = NDBConfig(warmup_steps=0)
STEP = ALL_ON.warmup_steps  # low-rank Wgrads are active from here on

Phase = Callable[[], torch.Tensor]
"""A forward returning the loss; a step runs its phases in turn, each followed by its backward."""


def scenarios(model: GPT, own: tuple, extra: tuple) -> dict[str, list[Phase]]:
    def takeover(cfg: NDBConfig, one_after_the_other: bool = False) -> list[Phase]:
        forward = TakeoverForward(model, cfg)
        if one_after_the_other:
            return [lambda: model.loss(*own), lambda: forward(*extra, step=STEP)]
        # extra forward first: autograd runs the later-recorded own graph's backward first, so
        # the parameter gradients get allocated while the own activations are being freed
        return [lambda: forward(*extra, step=STEP) + model.loss(*own)]

    both = tuple(torch.cat(pair) for pair in zip(own, extra))
    return {
        "fault-free (own only)": [lambda: model.loss(*own)],
        "takeover, all approx": takeover(ALL_ON),
        "  - skip_attention off": takeover(dataclasses.replace(ALL_ON, skip_attention=False)),
        "  - recompute_ffn off": takeover(dataclasses.replace(ALL_ON, recompute_ffn=False)),
        "  - lowrank_ffn off": takeover(dataclasses.replace(ALL_ON, lowrank_ffn=False)),
        "takeover, exact_reference": takeover(dataclasses.replace(ALL_ON, exact_reference=True)),
        "naive double (concat)": [lambda: model.loss(*both)],
        "exact, one after the other": [lambda: model.loss(*own), lambda: model.loss(*extra)],
        "all approx, one after other": takeover(ALL_ON, one_after_the_other=True),
    }


def run_phases(phases: list[Phase]) -> None:
    for phase in phases:
        phase().backward()


def timed_step(model: GPT, phases: list[Phase]) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    run_phases(phases)
    return time.perf_counter() - start


def saved_activation_bytes(model: GPT, phases: list[Phase]) -> int:
    """Largest set of saved activations alive together: per phase, since backward frees them."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    model.zero_grad(set_to_none=True)
    held = []
    for phase in phases:
        storages: dict[int, int] = {}

        # the hook runs only inside this iteration (phase() below), so it binds this phase's dict
        def pack(t: torch.Tensor, storages: dict[int, int] = storages) -> torch.Tensor:
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                storages[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = phase()
        loss.backward()
        held.append(sum(storages.values()))
    return max(held)


def peak_alloc_bytes(model: GPT, phases: list[Phase]) -> int:
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_phases(phases)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    memory = [e["args"] for e in events if e.get("name") == "[memory]"]
    # the profiler's running total carries bytes that earlier profiles allocated and freed after
    # they stopped, so measure from the total just before this step's first allocation
    start = memory[0]["Total Allocated"] - memory[0]["Bytes"]
    return max(m["Total Allocated"] for m in memory) - start


def svd_refresh_seconds(model: GPT, repeats: int = 3) -> float:
    """Fastest of a few full refreshes, one SVD per FFN linear (MKL's SVD timing is erratic)."""
    best = float("inf")
    for _ in range(repeats):
        cache = SVDCache(ALL_ON.svd_every)
        start = time.perf_counter()
        for i, block in enumerate(model.blocks):
            for name, layer in (("fc", block.ffn.fc), ("out", block.ffn.out)):
                rank = lowrank_rank(*layer.weight.shape, ALL_ON, STEP)
                cache.basis(f"blocks.{i}.ffn.{name}", layer.weight, rank, STEP)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    model = GPT(MODEL).train()
    g = torch.Generator().manual_seed(0)
    own, extra = (
        tuple(torch.randint(0, MODEL.vocab_size, (BATCH, MODEL.seq_len), generator=g) for _ in "xy")
        for _ in ("own", "extra")
    )
    steps = scenarios(model, own, extra)
    rank = lowrank_rank(4 * MODEL.d_model, MODEL.d_model, ALL_ON, STEP)
    print(
        f"GPT d_model={MODEL.d_model} layers={MODEL.n_layer} heads={MODEL.n_head} "
        f"seq={MODEL.seq_len} batch={BATCH} vocab={MODEL.vocab_size}; "
        f"threads={torch.get_num_threads()}; rank_ratio={ALL_ON.rank_ratio} -> r={rank}"
    )

    times: dict[str, list[float]] = {name: [] for name in steps}
    for rep in range(REPEATS + 1):
        for name, phases in steps.items():
            t = timed_step(model, phases)
            if rep:
                times[name].append(t)
    activations = {name: saved_activation_bytes(model, phases) for name, phases in steps.items()}
    peaks = {name: peak_alloc_bytes(model, phases) for name, phases in steps.items()}

    base = "fault-free (own only)"
    t0 = min(times[base])
    print(f"{'scenario':28s} {'min ms':>6s} {'med ms':>6s} {'x ff':>5s} {'extra x full':>12s} "
          f"{'act MiB':>8s} {'x ff':>5s} {'peak MiB':>8s} {'x ff':>5s}")
    for name in steps:
        t = min(times[name])
        extra_cost = "" if name == base else f"{(t - t0) / t0:.2f}"
        print(
            f"{name:28s} {t * 1e3:6.0f} {statistics.median(times[name]) * 1e3:6.0f} {t / t0:5.2f} "
            f"{extra_cost:>12s} {activations[name] / 2**20:8.1f} "
            f"{activations[name] / activations[base]:5.2f} {peaks[name] / 2**20:8.1f} "
            f"{peaks[name] / peaks[base]:5.2f}"
        )
    svd = svd_refresh_seconds(model)
    print(
        f"SVD refresh of all {2 * MODEL.n_layer} FFN bases: {svd * 1e3:.0f} ms, every "
        f"{ALL_ON.svd_every} steps = {svd / ALL_ON.svd_every / t0:.3f} fault-free steps amortised"
    )


if __name__ == "__main__":
    main()
