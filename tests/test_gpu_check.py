"""``bench/gpu_check.py``, the one-GPU check, on a host without a GPU: its dry run (``--device cpu``) takes the
same code paths with tiny sizes and must pass every check; the jobs its GPU run starts must pass the runner's
config-time checks here; and its pieces that only matter on a GPU (the NCCL probe's failure path, the peak
table, the bit-for-bit comparison) are checked on their own. No timing is asserted (benchmarks never are)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import uuid

import pytest
import torch

from tests.conftest import ROOT, assert_no_process_of
from tests.local_hosts import TOKEN_ENV


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return importlib.import_module("gpu_check")


def rows(stdout: str) -> dict[str, tuple[str, str]]:
    """The summary table: check -> (PASS/FAIL/info, result)."""
    table = stdout[stdout.rindex("\ncheck "):]
    found = {}
    for line in table.splitlines()[1:]:
        match = re.match(r"(.+?)\s{2,}(PASS|FAIL|info)  (.*)", line)
        if match:
            found[match[1]] = (match[2], match[3])
    return found


@pytest.mark.timeout(600)
def test_the_dry_run_passes_every_check_on_cpu():
    from runner.recovery.flash_ckpt.shm import SHM_DIR as shm
    before_shm = {p.name for p in shm.iterdir()}
    token = uuid.uuid4().hex  # every process the bench starts inherits it: tests running beside this one don't
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu"], cwd=ROOT,
                         env={**os.environ, TOKEN_ENV: token}, capture_output=True, text=True, timeout=570)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.rstrip().endswith("all checks passed")
    table = rows(run.stdout)
    verdicts = {check.split(":")[0]: verdict for check, (verdict, _) in table.items()}
    assert verdicts == {"device": "info", "runner": "PASS", "plain Lightning, same module and data": "info",
                        "flash snapshot of 0.00 GB under cpu compute (2 layers, 3 rounds)": "info",
                        "flash restore into zeroed device tensors = live state, bit for bit": "PASS",
                        "two ranks on one device": "info", "fault-free": "PASS",
                        "rank 1 SIGKILLed at step 6": "PASS", "wall time": "info"}, table
    runner = table["runner: gpt_tiny 32-true, 1 cpu rank, steps 4..12"][1]
    plain = table["plain Lightning, same module and data"][1]
    assert re.fullmatch(r"[\d,]+ tokens/s, MFU unknown \(no peak for this device\)", runner)
    assert re.match(r"[\d,]+ tokens/s, MFU unknown .*; runner / plain \d+\.\d{3}", plain)
    assert table["two ranks on one device: backend"][1] == "gloo on CPU tensors (dry run: no GPU)"
    clean = re.search(r"checksum ([0-9a-f]{64})", table["fault-free: gpt_tiny 32-true, 2 ranks, gloo, "
                                                        "ft=[flashrecovery], 12 steps"][1])
    killed = table["rank 1 SIGKILLed at step 6: checksum = fault-free"][1]
    assert clean and f"checksum {clean[1]} = fault-free" in killed and killed.startswith("completed, 1 recoveries")
    assert not [n for n in {p.name for p in shm.iterdir()} - before_shm if "gpucheck" in n]  # snapshot's segments
    assert_no_process_of(token)  # nothing the bench started (its jobs, their agents and workers) is left


def test_the_gpu_runs_jobs_pass_the_runners_config_checks_here(bench):
    """A refusal at config time would only show on the day a GPU is lent: the GPU profile's jobs, composed and
    checked as ``python -m runner`` checks them (two ranks on one GPU with gloo included), and planned to fit an
    80 GiB GPU."""
    from runner.config.validate import validate
    from runner.planning.plan import make_plan

    gpu = bench.PROFILES["cuda"]
    train = bench.compose(bench.train_overrides(gpu, 80))
    validate(train, for_training=True)
    assert (train.recipe_name, train.trainer.precision, train.runner.device) == ("gpt_small", "bf16-mixed", "cuda")
    assert make_plan(train).bytes_per_rank <= 80 * 2**30
    for backend in ("nccl", "gloo"):
        pair = bench.compose(bench.pair_overrides(gpu, backend) + bench.kill_overrides(gpu))
        validate(pair, for_training=True)
        assert (pair.parallel.backend, pair.runner.deterministic, pair.fault.kind) == (backend, True, "kill_rank")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the probe's answer where NCCL cannot run")
def test_the_nccl_probe_reports_why_two_ranks_cannot_share_a_gpu(bench):
    shared, reason = bench.nccl_shares_a_gpu(timeout_s=120)
    assert not shared and reason and "did not finish" not in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_the_gpu_check_refuses_to_run_without_a_gpu():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "--device cpu for a dry run" in run.stderr, run.stderr[-2000:]


def test_the_peak_table_names_the_gpus_it_knows(bench):
    assert bench.peak_of("NVIDIA H200") == bench.peak_of("NVIDIA H100 80GB HBM3") == 989e12
    assert bench.peak_of("NVIDIA H100 PCIe") == 756e12
    assert bench.peak_of("NVIDIA A100-SXM4-80GB") == 312e12
    assert bench.peak_of("Tesla T4") is None


def test_a_restore_that_differs_in_one_bit_is_not_the_same_state(bench):
    state = {"w": torch.randn(4, 4, dtype=torch.bfloat16), "step": torch.tensor(3.0), "n": 1}
    same = {"w": state["w"].clone(), "step": state["step"].clone(), "n": 1}
    assert bench.same_bits(state, same)
    flipped = same["w"].view(torch.int16)
    flipped[2, 1] ^= 1
    assert not bench.same_bits(state, same)
    assert not bench.same_bits(state, {**state, "n": 2})


def test_the_snapshotted_state_shrinks_to_fit_a_small_dev_shm(bench):
    from runner.planning.model_cost import count_params

    state = bench.PROFILES["cuda"].state
    assert bench.fit_to_shm(state, 1 << 40) == state
    small = bench.fit_to_shm(state, 10 * 10**9)
    assert small.n_layer < state.n_layer and 2 * bench.ADAMW_BYTES * count_params(small) <= 8 * 10**9
