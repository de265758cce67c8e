"""One-GPU check of the CUDA path, for the day a GPU machine is lent (CI has none; under 8 minutes on one H200).

1. Training: one CUDA rank trains gpt_small in bf16 through the runner (``python -m runner``), then a plain
   Lightning Trainer fits the same LightningModule on the same data and GPU in this process; tokens/s and MFU
   of both, steady state (the first steps left out). MFU: the model's FLOPs per token
   (``runner.planning.model_cost``) over the device's dense bf16 peak, from a table of GPU names (unknown
   elsewhere).
2. Flash checkpoint: the real ``Snapshotter`` snapshots a multi-GB GPT + AdamW state on the GPU while the
   next forward/backward runs (``save_async``, then ``wait`` before the optimizer step, as the callback
   does). The stall is the step time with the snapshot minus the step time without, paired per round, set
   against the floor: one device-to-host copy of the same bytes into pinned memory. The last snapshot is
   restored into zeroed tensors on the device (``load_newest``) and must equal the live state bit for bit.
3. Two ranks on the one GPU: NCCL if a probe shows it accepts two ranks on one device (it normally refuses a
   duplicate GPU in a communicator), else gloo on CUDA tensors; the output says which and why. gpt_tiny with
   ``ft=[flashrecovery]`` and ``runner.deterministic=true``, fault-free and then with rank 1 SIGKILLed
   (``fault=kill_rank``): the recovered run must end with the fault-free run's parameter checksum.

Exit status 0 only if every check passed; one summary table at the end. ``--device cpu`` runs the same code
paths on CPU with tiny sizes (gloo, fp32, gpt_tiny), which is how tests/test_gpu_check.py runs it.

    python bench/gpu_check.py                 # on a host with a GPU
    python bench/gpu_check.py --device cpu    # dry run on CPU
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import run_cli, steady_steps_per_s  # noqa: E402

from runner.config.schema import GPTConfig  # noqa: E402
from runner.planning.model_cost import count_params, flops_per_token  # noqa: E402

# dense bf16 peak FLOP/s by a substring of torch.cuda.get_device_name; the first match wins
PEAK_BF16 = (("H100 PCIe", 756e12), ("H200", 989e12), ("H100", 989e12), ("A100", 312e12))
ADAMW_BYTES = 12  # per parameter in the snapshotted state: fp32 weight and AdamW's two fp32 moments


@dataclass(frozen=True)
class Profile:
    """Sizes of one device kind: the GPU's, or the dry run's on CPU."""

    device: str
    recipe: str  # trained in part 1
    precision: str  # trainer.precision in parts 1 and 3
    steps: int  # part 1's runs, of which the first `skip` are left out of tokens/s
    skip: int
    global_batch: int
    state: GPTConfig  # the model whose parameters and AdamW state part 2 snapshots
    state_batch: int  # samples of part 2's forward/backward
    rounds: int  # part 2's paired rounds
    pair_steps: int  # part 3's runs (gpt_tiny, two ranks)
    pair_batch: int


PROFILES = {
    "cuda": Profile("cuda", "gpt_small", "bf16-mixed", steps=60, skip=20, global_batch=16,
                    state=GPTConfig(vocab_size=50304, seq_len=1024, n_layer=16, n_head=16, d_model=1280),  # 4.6 GB
                    state_batch=8, rounds=5, pair_steps=40, pair_batch=8),
    "cpu": Profile("cpu", "gpt_tiny", "32-true", steps=12, skip=4, global_batch=2, state=GPTConfig(),
                   state_batch=2, rounds=3, pair_steps=12, pair_batch=4),
}


@dataclass
class Row:
    """A line of the summary: ``ok`` None for a measurement without a pass/fail condition."""

    check: str
    result: str
    ok: Optional[bool] = None


# -- 1. one rank: the runner and plain Lightning ----------------------------------------------------------------
def train_overrides(p: Profile, gpu_memory_gib: Optional[float] = None) -> list[str]:
    """Part 1's job: one rank of the profile's recipe and precision (the recipe's layout is two nodes), planned
    against the GPU's memory."""
    over = [f"+recipe={p.recipe}", f"runner.device={p.device}", "parallel.nodes=1", "parallel.procs_per_node=1",
            f"trainer.precision={p.precision}", f"trainer.global_batch_size={p.global_batch}",
            f"trainer.max_steps={p.steps}"]
    return over + ([f"runner.gpu_memory_gib={gpu_memory_gib:g}"] if gpu_memory_gib else [])


def pair_overrides(p: Profile, backend: str) -> list[str]:
    """Part 3's fault-free job: two ranks on one device (``logical_rank % device_count`` puts both on GPU 0)."""
    return ["+recipe=gpt_tiny", f"runner.device={p.device}", f"parallel.backend={backend}", "parallel.nodes=1",
            "parallel.procs_per_node=2", f"trainer.precision={p.precision}",
            f"trainer.global_batch_size={p.pair_batch}", f"trainer.max_steps={p.pair_steps}", "ft=[flashrecovery]",
            "runner.deterministic=true"]


def kill_overrides(p: Profile) -> list[str]:
    return ["fault=kill_rank", "fault.rank=1", f"fault.step={p.pair_steps // 2}"]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from runner.config import register_all
    from runner.config.registry import CONF_DIR

    register_all()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def peak_of(device_name: str) -> Optional[float]:
    """Dense bf16 peak FLOP/s of a GPU by its name, None where the table does not know it."""
    return next((flops for key, flops in PEAK_BF16 if key in device_name), None)


def mfu_text(tokens_per_s: float, cfg, peak: Optional[float]) -> str:
    from runner.planning.plan import gpt_config

    if peak is None:
        return "MFU unknown (no peak for this device)"
    return f"MFU {100 * flops_per_token(gpt_config(cfg)) * tokens_per_s / peak:.1f}%"


def plain_lightning_tokens_per_s(cfg, p: Profile) -> float:
    """The runner's LightningModule and data source (``build_module_and_data``) under a plain Lightning Trainer
    on one device; tokens/s after the same warm-up steps, each step timed once its kernels finished."""
    import lightning.pytorch as pl

    from runner.data import StepLoader
    from runner.training.worker import build_module_and_data

    module, data = build_module_and_data(cfg, p.global_batch)
    source = data.source
    ends: list[float] = []

    class Timing(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            sync(p.device)
            ends.append(time.perf_counter())

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            trainer = self.trainer
            assert trainer is not None
            return StepLoader(source, lambda: trainer.global_step, lambda: 0)

    trainer = pl.Trainer(accelerator="gpu" if p.device == "cuda" else "cpu", devices=1,
                         precision=cfg.trainer.precision, max_steps=p.steps,
                         gradient_clip_val=cfg.trainer.grad_clip or None, logger=False, callbacks=[Timing()],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False)
    trainer.fit(module, datamodule=Data())
    steady = ends[p.skip:]
    del trainer, module
    free_device(p.device)
    return (len(steady) - 1) / (steady[-1] - steady[0]) * p.global_batch * cfg.model.seq_len


def check_training(p: Profile, peak: Optional[float]) -> list[Row]:
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30 if p.device == "cuda" else None
    overrides = train_overrides(p, memory and round(memory))
    cfg = compose(overrides)
    tokens_per_step = p.global_batch * cfg.model.seq_len
    summary, metrics, _ = run_cli(*overrides, timeout=300)
    label = f"{p.recipe} {p.precision}, 1 {p.device} rank, steps {p.skip}..{p.steps}"
    if summary["status"] != "completed":
        return [Row(f"runner: {label}", f"{summary['status']}: {summary.get('error')}", False)]
    ours = steady_steps_per_s(metrics, p.skip) * tokens_per_step
    plain = plain_lightning_tokens_per_s(cfg, p)
    return [Row(f"runner: {label}", f"{ours:,.0f} tokens/s, {mfu_text(ours, cfg, peak)}", True),
            Row("plain Lightning, same module and data", f"{plain:,.0f} tokens/s, {mfu_text(plain, cfg, peak)}; "
                f"runner / plain {ours / plain:.3f}")]


# -- 2. a flash snapshot under GPU compute, and its restore ------------------------------------------------------
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_device(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def fit_to_shm(state: GPTConfig, free: int) -> GPTConfig:
    """Fewer layers until the snapshot's two slots fit in 80% of the free /dev/shm (containers often have little)."""
    while state.n_layer > 1 and 2 * ADAMW_BYTES * count_params(state) > 0.8 * free:
        state = replace(state, n_layer=state.n_layer - 1)
    return state


class Workload:
    """A GPT and AdamW on the device (bf16 autocast on a GPU): the compute a snapshot runs under, and the state."""

    def __init__(self, cfg: GPTConfig, batch: int, device: str) -> None:
        from runner.model import GPT

        torch.manual_seed(0)
        self.device = device
        self.model = GPT(cfg).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device)
        self.forward_backward()
        self.opt.step()

    def forward_backward(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.device == "cuda"):
            loss = self.model.loss(self.idx, self.idx)
        loss.backward()

    def state(self, step: int) -> dict:
        """What the callback snapshots (Lightning's checkpoint dict, minus loop state): live references."""
        return {"global_step": step, "state_dict": self.model.state_dict(),
                "optimizer_states": [self.opt.state_dict()]}


def same_bits(a: Any, b: Any) -> bool:
    """The two states have the same structure and every tensor the same dtype, shape and bytes."""
    from runner.recovery.flash_ckpt.codec import flatten

    fa, fb = flatten(a), flatten(b)
    if fa.skeleton != fb.skeleton or len(fa.tensors) != len(fb.tensors):
        return False
    for x, y in zip(fa.tensors, fb.tensors):
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.to(x.device).reshape(-1).view(torch.uint8)):
            return False
    return True


def floor_copy(total: int, device: str) -> Callable[[], None]:
    """One copy of ``total`` bytes off the device into pinned host memory (on CPU: into warm private memory)."""
    src = torch.randint(0, 255, (total,), dtype=torch.uint8, device=device)
    dst = torch.empty(total, dtype=torch.uint8, pin_memory=device == "cuda")

    def copy() -> None:
        dst.copy_(src, non_blocking=True)
        sync(device)

    copy()  # faults the destination in
    return copy


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def check_snapshot(p: Profile) -> list[Row]:
    from runner.recovery.flash_ckpt.codec import flatten
    from runner.recovery.flash_ckpt.hygiene import cleanup
    from runner.recovery.flash_ckpt.restore import load_newest
    from runner.recovery.flash_ckpt.shm import free_bytes
    from runner.recovery.flash_ckpt.snapshotter import Snapshotter

    cfg = fit_to_shm(p.state, free_bytes())
    work = Workload(cfg, p.state_batch, p.device)
    total = sum(t.numel() * t.element_size() for t in flatten(work.state(0)).tensors)
    floor = floor_copy(total, p.device)
    job = f"gpucheck{os.getpid()}"
    snap = Snapshotter(job, 0)
    step = 0

    def plain_step() -> None:
        work.forward_backward()
        work.opt.step()
        sync(p.device)

    def snapshot_step(commit: bool = True) -> float:
        """A step with a snapshot of the state before it; returns seconds the loop was held in the calls."""
        nonlocal step
        step += 1
        held = snap.save_async(work.state(step), step)
        work.forward_backward()
        held += snap.wait()  # where the callback waits: right before the optimizer step
        if commit:
            work.opt.step()
        sync(p.device)
        return held

    floors, stalls, held = [], [], []
    try:
        for _ in range(2):  # the first two saves create and pre-fault the two slots
            snapshot_step()
        for _ in range(p.rounds):
            floors.append(timed(floor))
            plain = timed(plain_step)
            t0 = time.perf_counter()
            held.append(snapshot_step())
            stalls.append(time.perf_counter() - t0 - plain)
        snapshot_step(commit=False)  # the state now is the snapshot's
        live = work.state(step)
        target = copy.deepcopy(live)
        for t in flatten(target).tensors:
            t.zero_()
        zeroed_differs = not same_bits(live, target)
        sync(p.device)
        t0 = time.perf_counter()
        restored = load_newest(job, 0, step=step, into=target)
        sync(p.device)
        restore_s = time.perf_counter() - t0
        identical = zeroed_differs and same_bits(live, restored.state)
    finally:
        snap.close(unlink=True)
        cleanup(job)
    stall, floor_s = statistics.median(stalls), statistics.median(floors)
    where = "pinned" if p.device == "cuda" else "host (no pinned memory on CPU)"
    untouched = "" if zeroed_differs else "; the zeroed target already equalled it"
    return [Row(f"flash snapshot of {total / 1e9:.2f} GB under {p.device} compute ({cfg.n_layer} layers, "
                f"{p.rounds} rounds)",
                f"stall {stall * 1e3:.1f} ms (held in save_async + wait {statistics.median(held) * 1e3:.1f} ms) vs "
                f"floor {floor_s * 1e3:.1f} ms, device->{where} copy ({total / floor_s / 1e9:.1f} GB/s): "
                f"{stall / floor_s:.2f}x floor"),
            Row("flash restore into zeroed device tensors = live state, bit for bit",
                f"{'equal' if identical else 'DIFFERENT'} ({restored.candidate.source}, "
                f"step {restored.candidate.step}, {restore_s * 1e3:.0f} ms){untouched}", identical)]


# -- 3. two ranks on the one device -------------------------------------------------------------------------------
def _nccl_rank(rank: int, store_path: str, results) -> None:
    """A probe rank: an NCCL group of two on GPU 0, built as the runner builds its groups, and one all-reduce."""
    try:
        torch.cuda.set_device(0)
        pg = dist.ProcessGroupNCCL(dist.FileStore(store_path, 2), rank, 2, dist.ProcessGroupNCCL.Options())
        t = torch.ones(1, device="cuda")
        pg.allreduce([t]).wait()  # type: ignore[attr-defined]  # the stubs declare no allreduce
        torch.cuda.synchronize()
        results.put((rank, t.item() == 2.0, f"all-reduce gave {t.item()}"))
    except Exception as e:
        results.put((rank, False, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"))


def nccl_shares_a_gpu(timeout_s: float = 120.0) -> tuple[bool, str]:
    """Whether NCCL runs a two-rank all-reduce with both ranks on GPU 0; why not if it does not."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="rr-gpucheck-nccl") as d:
        procs = [ctx.Process(target=_nccl_rank, args=(r, f"{d}/store", results), daemon=True) for r in range(2)]
        for proc in procs:
            proc.start()
        answers: list[tuple[int, bool, str]] = []
        deadline = time.monotonic() + timeout_s
        try:
            while len(answers) < 2 and time.monotonic() < deadline:
                try:
                    answers.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
                except Exception:
                    break
        finally:
            for proc in procs:
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
    if len(answers) < 2:
        return False, f"the probe did not finish within {timeout_s:.0f} s"
    failed = [why for _, ok, why in sorted(answers) if not ok]
    return not failed, "; ".join(dict.fromkeys(failed)) or "a two-rank all-reduce on GPU 0 completed"


def check_pair(p: Profile) -> list[Row]:
    if p.device == "cpu":
        backend, why = "gloo", "gloo on CPU tensors (dry run: no GPU)"
    else:
        shared, reason = nccl_shares_a_gpu()
        backend = "nccl" if shared else "gloo"
        why = (f"NCCL: it accepted two ranks on one GPU ({reason})" if shared
               else f"gloo on CUDA tensors: NCCL refused two ranks on one GPU ({reason})")
    rows = [Row("two ranks on one device: backend", why)]
    base = pair_overrides(p, backend)
    clean, _, _ = run_cli(*base, timeout=300)
    label = f"gpt_tiny {p.precision}, 2 ranks, {backend}, ft=[flashrecovery], {p.pair_steps} steps"
    clean_ok = clean["status"] == "completed" and clean["param_checksum"] is not None
    rows.append(Row(f"fault-free: {label}", f"{clean['status']}, checksum {clean['param_checksum']}"
                    + (f", error: {clean.get('error')}" if clean["status"] != "completed" else ""), clean_ok))
    faulty, _, _ = run_cli(*base, *kill_overrides(p), timeout=300)
    rto = [round(r["rto_s"], 3) if r.get("rto_s") is not None else None for r in faulty["recoveries"]]
    same = clean_ok and faulty["param_checksum"] == clean["param_checksum"]
    ok = faulty["status"] == "completed" and bool(faulty["recoveries"]) and same
    rows.append(Row(f"rank 1 SIGKILLed at step {p.pair_steps // 2}: checksum = fault-free",
                    f"{faulty['status']}, {len(rto)} recoveries (RTO {rto} s), checksum {faulty['param_checksum']}"
                    f" {'=' if same else '!='} fault-free"
                    + (f", error: {faulty.get('error')}" if faulty["status"] != "completed" else ""), ok))
    return rows


# -- the summary --------------------------------------------------------------------------------------------------
def guarded(name: str, part: Callable[[], list[Row]]) -> list[Row]:
    """A part that raised is a failed row with its error; the other parts still run."""
    try:
        return part()
    except Exception as e:
        traceback.print_exc()
        return [Row(name, f"raised {type(e).__name__}: {str(e).strip()[:300]}", False)]


def print_table(rows: list[Row]) -> None:
    width = max(len(r.check) for r in rows)
    print(f"\n{'check':{width}s}  {'':4s}  result")
    for r in rows:
        verdict = {True: "PASS", False: "FAIL", None: "info"}[r.ok]
        print(f"{r.check:{width}s}  {verdict}  {r.result}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=sorted(PROFILES), default="cuda",
                    help="cuda: the check (one GPU); cpu: a dry run of the same code paths with tiny sizes")
    args = ap.parse_args()
    p = PROFILES[args.device]
    if p.device == "cuda":  # one GPU, the first visible, for this process and every job it starts
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        if not torch.cuda.is_available():
            print("no GPU here: run it on a host with one, or use --device cpu for a dry run", file=sys.stderr)
            return 2
    t0 = time.monotonic()
    name = torch.cuda.get_device_name(0) if p.device == "cuda" else "CPU"
    peak = peak_of(name) if p.device == "cuda" else None
    print(f"torch {torch.__version__}, device {name}, dense bf16 peak "
          f"{'unknown' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}", flush=True)
    rows = [Row("device", f"{name}; {torch.cuda.device_count()} GPU(s) visible")]
    rows += guarded("runner and plain Lightning, one rank", lambda: check_training(p, peak))
    rows += guarded("flash snapshot and restore", lambda: check_snapshot(p))
    free_device(p.device)  # the snapshot's state and buffers are gone with check_snapshot's frame
    rows += guarded("two ranks on one device", lambda: check_pair(p))
    elapsed = time.monotonic() - t0
    target = f" (target under 480 s: {'met' if elapsed < 480 else 'missed'})" if p.device == "cuda" else ""
    rows.append(Row("wall time", f"{elapsed:.0f} s{target}"))
    print_table(rows)
    passed = all(r.ok is not False for r in rows)
    print(f"\n{'all checks passed' if passed else 'SOME CHECKS FAILED'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
