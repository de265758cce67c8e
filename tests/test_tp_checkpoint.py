"""The Lightning checkpoint of a tensor-parallel run (tp=2, dp=2, real processes): one file holding the full
model and the full optimizer state, as at tp = 1, which an unsharded GPT loads and from which a tp=2 run
resumes bit-identically.

The resume test's runs keep the learning rate constant after warm-up (``trainer.min_lr`` = ``trainer.lr``), so a 10-step
run is the first half of a 20-step one (tests/test_checkpoint.py).
"""

from __future__ import annotations

import pytest
import torch

from runner.lightning_module import GPTModule
from runner.training.checksum import param_checksum
from tests.conftest import TP2_DP2_STEPS, Run, run_cli

TP2 = ("+recipe=gpt_tiny", "trainer.min_lr=3e-3", "parallel.nodes=2", "parallel.procs_per_node=2", "parallel.tp=2")


@pytest.fixture(scope="module")
def first10(tmp_path_factory) -> Run:
    return run_cli(*TP2, "trainer.max_steps=10", "checkpoint.every_n_steps=5",
                   run_dir=tmp_path_factory.mktemp("first10") / "run")


def test_a_tp_run_writes_the_full_model_and_optimizer_state_into_one_file(tp2_dp2):
    run = tp2_dp2  # the shared run at tp=2, dp=2 (tests/conftest.py): 20 steps, a checkpoint every 5
    assert run.returncode == 0, run.output[-3000:]
    assert [e["at_step"] for e in run.events("checkpoint_saved")] == [5, 10, 15, TP2_DP2_STEPS]
    assert not run.events("checkpoint_skipped")
    path = run.dir / "checkpoints" / "last.ckpt"
    module = GPTModule.load_from_checkpoint(path, map_location="cpu")  # the unsharded GPT: every shape full
    assert param_checksum(module) == run.summary["param_checksum"]  # the gathered slices of the run's model
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == TP2_DP2_STEPS
    names = [n for n, p in module.model.named_parameters() if p.dim() >= 2] + \
            [n for n, p in module.model.named_parameters() if p.dim() < 2]  # the optimizer's order (its two groups)
    params = dict(module.model.named_parameters())
    state = ckpt["optimizer_states"][0]["state"]
    assert sorted(state) == list(range(len(names)))
    for k, name in enumerate(names):
        assert state[k]["exp_avg"].shape == state[k]["exp_avg_sq"].shape == params[name].shape, name
        assert int(state[k]["step"]) == TP2_DP2_STEPS
    # a tp=1 optimizer loads it as it is
    module.configure_optimizers()["optimizer"].load_state_dict(ckpt["optimizer_states"][0])


@pytest.mark.slow  # run time: a variant of what the default tier covers
def test_a_tp_run_resumed_from_the_file_ends_bit_identical_to_an_uninterrupted_one(first10, tmp_path):
    straight = run_cli(*TP2, "trainer.max_steps=20", run_dir=tmp_path / "straight")
    assert straight.returncode == 0, straight.output[-3000:]
    resumed = run_cli(*TP2, "trainer.max_steps=20", f"runner.resume={first10.dir}", run_dir=tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.output[-3000:]
    s = resumed.summary
    assert [e["at_step"] for e in resumed.events("resumed")] == [10]
    assert s["global_step"] == 20 and s["samples_lost"] == 0
    assert s["samples_committed"] == straight.summary["samples_committed"] // 2
    assert s["param_checksum"] == straight.summary["param_checksum"]
