"""Checkpoint blocking and restore times: flash (overlap on/off) against a memcpy floor,
torch.save and torch.distributed.checkpoint.async_save, on a GPT + AdamW state.

    .venv/bin/python bench/ckpt.py            # ~200 MB state (well under 2 minutes here)
    .venv/bin/python bench/ckpt.py --large    # adds a ~1 GB state
    .venv/bin/python bench/ckpt.py --partner  # only: a step's stall with the partner copy, local vs exchanged

"Blocking" is what the training loop waits for: for flash, the save call plus the wait right
before the next optimizer step, with a real forward/backward of the model in between (the
background copy competes with it for the same cores, so the forward/backward time is shown
too). The floor is one copy_ of the same number of bytes from one private tensor into a warm,
pre-faulted /dev/shm mapping, with every core's intra-op thread: the best copy of this host.
Everything else runs as a rank of the runner does where ranks share the host's cores (its
worker sets torch to cores / ranks threads, one here): torch's idle OpenMP workers spin for ~10 ms
after each parallel region, which would halve any copy started by other threads right after a
two-thread optimizer step, a contention that a rank with one intra-op thread does not have. Each
of --repeats rounds runs every method once, so load from other processes hits them alike;
"x floor" is the median over rounds of time / that round's floor. The first flash save (which
creates and pre-faults the segment) is reported on its own.

Each restore runs right after its kind of save (flash restores after the flash saves, before
torch.save and DCP write files). Restores from memory, the two the runner does first (with
targets), then what they would cost without their preparation:
- into the live tensors of the process that wrote the snapshot (an in-process restart; it reads
  through the writer's mapping);
- in another process, as the runner's restarted ranks do it: the model weights into the
  module's parameters, the rest (optimizer state) into new tensors, with the Prefetch that such a
  rank starts at process start done beforehand and not timed (it maps the slots and faults in
  memory for the new tensors while the process imports and builds its model);
- the same process without a Prefetch, into tensors of its own through a mapping made afresh;
- into new tensors without a Prefetch (page-faulting fresh private memory: compare with "copy
  into new memory").

--partner measures instead what the partner copy costs a training step (save, forward/backward,
the wait before the optimizer step, the step), in two ways: a copy on this host in a background
thread (``backup_to_partner``), awaited before the next optimizer step; and the exchange the
runner's workers do (``exchange_with_partners`` over a gloo group with a second process, the
holder, which sends its own snapshot back), never awaited in a step. Both processes share this
host's cores, as the partner's host would not.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import zlib
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from pathlib import Path
from time import perf_counter

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runner.model import GPT, GPTConfig  # noqa: E402
from runner.recovery.flash_ckpt.checksum import digest  # noqa: E402
from runner.recovery.flash_ckpt.chunks import Plan  # noqa: E402
from runner.recovery.flash_ckpt.codec import flatten  # noqa: E402
from runner.recovery.flash_ckpt.hygiene import cleanup  # noqa: E402
from runner.recovery.flash_ckpt.prefetch import Prefetch  # noqa: E402
from runner.recovery.flash_ckpt.replica import backup_to_partner, exchange_with_partners  # noqa: E402
from runner.recovery.flash_ckpt.restore import load_newest  # noqa: E402
from runner.recovery.flash_ckpt.shm import SHM_DIR  # noqa: E402
from runner.recovery.flash_ckpt.snapshotter import Snapshotter  # noqa: E402

SIZES = {
    "200MB": GPTConfig(vocab_size=8192, seq_len=64, n_layer=4, n_head=8, d_model=512),
    "1GB": GPTConfig(vocab_size=16384, seq_len=64, n_layer=10, n_head=12, d_model=768),
}
KERNEL = "copy + checksum kernel alone (same bytes)"
LIVE = "restore flash -> live tensors"
RESTARTED = "restore flash -> restarted rank (prefetched)"
COLD = "  same, unprepared: fresh mapping"
NEW = "restore flash -> new tensors, unprepared"
TARGETS = {"flash save, overlap on": 0.25, "flash save, overlap off": 1.2, LIVE: 1.2, RESTARTED: 1.2}


class Trainer:
    """A GPT with AdamW state and a small batch, so a step is a real forward/backward."""

    def __init__(self, cfg: GPTConfig) -> None:
        torch.manual_seed(0)
        self.model = GPT(cfg)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.idx = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
        self.forward_backward()
        self.opt.step()

    def forward_backward(self) -> float:
        t0 = perf_counter()
        self.opt.zero_grad(set_to_none=False)
        self.model.loss(self.idx, self.idx).backward()
        return perf_counter() - t0

    def checkpoint(self, step: int) -> dict:
        """What Lightning's dump_checkpoint returns, minus the loop bookkeeping: live references."""
        return {"global_step": step, "state_dict": self.model.state_dict(), "optimizer_states": [self.opt.state_dict()]}


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in flatten(state).tensors)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def warm_shm(total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-faulted /dev/shm mapping of `total` bytes and a private source of the same size."""
    fd, name = tempfile.mkstemp(dir=SHM_DIR, prefix="rrflash-bench-floor")
    try:
        os.posix_fallocate(fd, 0, total)
        dst = torch.frombuffer(mmap.mmap(fd, total), dtype=torch.uint8)
    finally:
        os.close(fd)
        os.unlink(name)
    src = torch.randint(0, 255, (total,), dtype=torch.uint8)
    dst.copy_(src)
    return dst, src


def timed(fn) -> float:
    t0 = perf_counter()
    fn()
    return perf_counter() - t0


@contextmanager
def all_cores():
    """torch with one intra-op thread per core for the floor copies, one thread otherwise."""
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(1)


def fresh_copy(src: torch.Tensor) -> None:
    """What any restore into new memory pays at least: allocate, then one copy (page faults included)."""
    torch.empty_like(src).copy_(src)


def _restorer(job: str, conn) -> None:
    """Child process: restore `job`'s newest snapshot on request, as a restarted rank does.
    "cold": into tensors of its own through a mapping made afresh. "prepared": as the runner's
    restarted ranks do, with a Prefetch made beforehand (untimed: a rank makes it while it
    starts), the model weights into live tensors and the rest into the prepared memory."""
    torch.set_num_threads(1)  # a rank, as in the parent
    live = load_newest(job, 0).state
    conn.send("ready")
    while mode := conn.recv():
        prefetch = Prefetch(job, 0) if mode == "prepared" else None
        if prefetch is not None and not prefetch.ready(60):
            raise RuntimeError("the prefetch did not finish within 60 s")
        t0 = perf_counter()
        if prefetch is None:
            load_newest(job, 0, into=live)
        else:
            load_newest(job, 0, into={"state_dict": live["state_dict"]}, prefetch=prefetch)
        conn.send(perf_counter() - t0)
        if prefetch is not None:
            prefetch.close()


def flash_step(tr: Trainer, snap: Snapshotter, step: int, overlap: bool) -> tuple[float, float]:
    """One training step with a snapshot of the previous one: (seconds blocked, fwd/bwd seconds)."""
    save = snap.save_async if overlap else snap.save
    blocked = save(tr.checkpoint(step), step)
    fwd = tr.forward_backward()
    blocked += snap.wait()  # where the callback waits: right before the optimizer step
    tr.opt.step()
    return blocked, fwd


def run_size(label: str, cfg: GPTConfig, repeats: int) -> dict:
    """Every method once per round, rounds interleaved, so load from other processes hits all alike."""
    tr = Trainer(cfg)
    total = nbytes(tr.checkpoint(0))
    floor_dst, floor_src = warm_shm(total)
    model_sd, optim_sd = get_state_dict(tr.model, tr.opt)
    dcp_state = {"model": model_sd, "optim": optim_sd}
    job = f"bench{os.getpid()}"
    snap = Snapshotter(job, 0)
    res: dict[str, list[float]] = defaultdict(list)
    step = 0
    child = None
    whole = Plan.of([{"path": "all bytes", "offset": 0, "nbytes": total - total % 8}], total - total % 8)
    helper = ThreadPoolExecutor(1, thread_name_prefix="bench-kernel")
    try:
        res["flash first save (creates + pre-faults)"].append(timed(lambda: snap.save(tr.checkpoint(0), 0)))
        snap.save(tr.checkpoint(0), 0)  # the second slot is created at the second save
        snap.wait()
        conn, child_conn = mp.get_context("spawn").Pipe()
        child = mp.get_context("spawn").Process(target=_restorer, args=(job, child_conn), daemon=True)
        child.start()
        if not conn.poll(300) or conn.recv() != "ready":
            raise RuntimeError("the restoring child process did not start within 300 s")
        with tempfile.TemporaryDirectory(prefix="rr-bench-ckpt") as d:
            path = Path(d) / "torch_save.ckpt"
            for r in range(repeats):
                with all_cores():
                    res["memcpy floor"].append(timed(lambda: floor_dst.copy_(floor_src)))
                    res["copy into new memory"].append(timed(lambda: fresh_copy(floor_src)))
                res["checksum digest (all bytes)"].append(timed(lambda: digest(floor_src.numpy())))
                res["zlib.crc32 (all bytes, for comparison)"].append(timed(lambda: zlib.crc32(floor_src.numpy())))
                res[KERNEL].append(timed(lambda: whole.fill(floor_dst.numpy(), [floor_src.data_ptr()], helper)))
                res["fwd/bwd alone"].append(tr.forward_backward())
                for overlap in (False, True):
                    step += 1
                    blocked, fwd = flash_step(tr, snap, step, overlap)
                    res[f"flash save, overlap {'on' if overlap else 'off'}"].append(blocked)
                    res[f"fwd/bwd beside flash save, overlap {'on' if overlap else 'off'}"].append(fwd)
                state = tr.checkpoint(step)
                # each restore runs right after its own kind of save: torch.save and DCP leave
                # page-cache writeback running, which would slow whatever is measured next
                res[LIVE].append(timed(partial(load_newest, job, 0, into=state)))
                for mode, row in (("prepared", RESTARTED), ("cold", COLD)):
                    conn.send(mode)
                    if not conn.poll(60):
                        raise RuntimeError("the restoring child process did not answer within 60 s")
                    res[row].append(conn.recv())
                res[NEW].append(timed(lambda: load_newest(job, 0)))
                with open(path, "wb") as f:
                    res["torch.save to file (page cache)"].append(timed(partial(torch.save, state, f)))
                    res["fsync after torch.save"].append(timed(lambda: (f.flush(), os.fsync(f.fileno()))))
                dcp_dir = Path(d) / f"dcp{r}"
                t0 = perf_counter()
                fut = dcp.async_save(dcp_state, checkpoint_id=dcp_dir)
                res["DCP async_save (blocking part)"].append(perf_counter() - t0)
                fut.result()
                res["restore torch.load(weights_only=True)"].append(timed(partial(torch.load, path, weights_only=True)))
                res["restore dcp.load (in place)"].append(timed(partial(dcp.load, dcp_state, checkpoint_id=dcp_dir)))
        conn.send("")
        child.join(60)
    finally:
        helper.shutdown()
        if child is not None and child.is_alive():
            child.kill()
        snap.close(unlink=True)
        cleanup(job)
    floor = res["memcpy floor"]
    print(f"\n== {label}: {total / 1e6:.1f} MB in tensors, floor median {median(floor) * 1e3:.1f} ms "
          f"({total / median(floor) / 1e9:.1f} GB/s)")
    print(f"{'':44s} {'median ms':>10s} {'min ms':>8s} {'x floor':>8s}  target")
    for name, xs in res.items():
        # the ratio pairs each sample with the floor of its own round (the first save has no round)
        ratio = median([x / f for x, f in zip(xs, floor)]) if len(xs) == len(floor) else median(xs) / median(floor)
        target = TARGETS.get(name)
        verdict = "" if target is None else f"<= {target}x {'met' if ratio <= target else 'MISSED'}"
        print(f"{name:44s} {median(xs) * 1e3:10.1f} {min(xs) * 1e3:8.1f} {ratio:8.2f}  {verdict}")
    return {"bytes": total, "seconds": dict(res)}


def _holder(job: str, store: str, cfg: GPTConfig, conn) -> None:
    """Child process: rank 1 on the partner host, with a snapshot of its own; takes part in the exchange
    of each step the parent names, as a rank's background thread does."""
    torch.set_num_threads(1)
    snap = Snapshotter(job, 1)
    snap.save(Trainer(cfg).checkpoint(0), 0)
    snap.wait()
    pg = dist.ProcessGroupGloo(dist.FileStore(store, 2), 1, 2, timedelta(seconds=60))
    conn.send("ready")
    while (step := conn.recv()) is not None:
        exchange_with_partners(pg, job, 1, (0, 0), [(0, 0)], step, timedelta(seconds=60))
    snap.close(unlink=True)


def partner_copy_stall(label: str, cfg: GPTConfig, repeats: int, steps: int = 5) -> dict:
    """Steps with overlapped snapshots, each followed by a partner copy, local or exchanged; rounds interleaved."""
    tr = Trainer(cfg)
    job = f"benchp{os.getpid()}"
    store_dir = tempfile.mkdtemp(prefix="rr-bench-partner")
    store = str(Path(store_dir) / "store")
    snap = Snapshotter(job, 0)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_holder, args=(job, store, cfg, child_conn), daemon=True)
    child.start()
    pg = dist.ProcessGroupGloo(dist.FileStore(store, 2), 0, 2, timedelta(seconds=60))
    pool = ThreadPoolExecutor(1, thread_name_prefix="bench-partner")
    res: dict[str, list[float]] = defaultdict(list)
    step = 0
    try:
        if not conn.poll(300) or conn.recv() != "ready":
            raise RuntimeError("the holder process did not start within 300 s")
        snap.save(tr.checkpoint(0), 0)  # both slots exist before anything is timed
        snap.wait()
        for _ in range(repeats):
            for mode in ("local copy", "exchange"):
                copy = None
                for _ in range(steps):
                    step += 1
                    t0 = perf_counter()
                    blocked = snap.save_async(tr.checkpoint(step), step)
                    tr.forward_backward()
                    t1 = perf_counter()
                    snap.wait()
                    if copy is not None and mode == "local copy":
                        copy.result()  # the callback waits for a copy on this host before the optimizer step
                    blocked += perf_counter() - t1
                    if copy is None or copy.done():  # an exchange still in flight: this snapshot is not copied
                        if mode == "local copy":
                            copy = pool.submit(backup_to_partner, job, 0, 1)
                        else:
                            conn.send(step)
                            copy = pool.submit(exchange_with_partners, pg, job, 0, (1, 1), [(1, 1)], step,
                                               timedelta(seconds=60))
                    tr.opt.step()
                    res[f"{mode}: blocked"].append(blocked)
                    res[f"{mode}: step"].append(perf_counter() - t0)
                assert copy is not None
                copy.result()
        conn.send(None)
        child.join(60)
    finally:
        pool.shutdown()
        if child.is_alive():
            child.kill()
        snap.close(unlink=True)
        cleanup(job)
        shutil.rmtree(store_dir, ignore_errors=True)
    print(f"\n== {label}, partner copy: {steps} steps x {repeats} rounds per way")
    for name, xs in res.items():
        print(f"{name:44s} {median(xs) * 1e3:10.1f} ms median {min(xs) * 1e3:8.1f} ms min")
    ratio = median(res["exchange: step"]) / median(res["local copy: step"])
    print(f"{'step time, exchange / local copy':44s} {ratio:10.2f}")
    return {"seconds": dict(res), "step_ratio": ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--large", action="store_true", help="also run the ~1 GB state")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, help="write the raw timings here")
    ap.add_argument("--partner", action="store_true", help="only the partner copy's step stall, local vs exchanged")
    args = ap.parse_args()
    store = Path(tempfile.mkdtemp(prefix="rr-bench-store")) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)  # DCP wants a group
    try:
        torch.set_num_threads(1)  # as a rank sharing the cores; the floor copies use all (all_cores)
        print(f"torch {torch.__version__}, 1 intra-op thread ({os.cpu_count()} for the floor copies), "
              f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, files in {tempfile.gettempdir()}")
        run = partner_copy_stall if args.partner else run_size
        results = {label: run(label, cfg, args.repeats) for label, cfg in SIZES.items() if args.large or label != "1GB"}
    finally:
        dist.destroy_process_group()
        store.parent.rmdir()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
