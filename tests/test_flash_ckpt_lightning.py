"""FlashCheckpoint on a plain single-process CPU Trainer: resume bit-identical, clean up, keep on failure."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from test_flash_ckpt import assert_same
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from runner.recovery.flash_ckpt.callback import FlashCheckpoint
from runner.recovery.flash_ckpt.disk import checkpoint_path, list_checkpoints
from runner.recovery.flash_ckpt.hygiene import cleanup
from runner.recovery.flash_ckpt.persister import persist_latest
from runner.recovery.flash_ckpt.restore import list_snapshots, load_newest
from runner.recovery.flash_ckpt.shm import job_files, segment_name


class TinyRegressor(pl.LightningModule):
    """Deterministic on CPU: fixed data, no shuffle, AdamW plus a per-step LR schedule."""

    def __init__(self, init_seed: int) -> None:
        super().__init__()
        torch.manual_seed(init_seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(20, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)  # 5 steps an epoch


def fit(module: pl.LightningModule, max_steps: int, root: Path, callbacks=(), ckpt_path=None) -> pl.Trainer:
    trainer = pl.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks), default_root_dir=root,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def test_callback_snapshot_resumes_bit_identical(job, tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    cb = FlashCheckpoint(5, 5, ckpt_dir, overlap=True, job_id=job, unlink_on_success=False)
    run = TinyRegressor(init_seed=0)
    trainer = fit(run, 10, tmp_path, [cb])
    assert len(cb.blocked_s) == 2

    memory = load_newest(job, 0)
    assert (memory.candidate.source, memory.candidate.step) == ("memory", 10)
    assert_same(run.state_dict(), memory.state["state_dict"])
    assert_same(trainer.optimizers[0].state_dict(), memory.state["optimizer_states"][0])
    assert memory.state["global_step"] == 10
    persisted = checkpoint_path(ckpt_dir, 0, 10)
    assert_same(memory.state, torch.load(persisted, weights_only=True))
    assert [s for s, _ in list_checkpoints(ckpt_dir, 0)] == [10, 5]
    cleanup(job)

    resumed = TinyRegressor(init_seed=1)
    fit(resumed, 15, tmp_path, ckpt_path=persisted)
    straight = TinyRegressor(init_seed=0)
    fit(straight, 15, tmp_path)
    assert_same(straight.state_dict(), resumed.state_dict())


def test_callback_without_overlap_persists_and_cleans_up(job, tmp_path):
    cb = FlashCheckpoint(5, 10, tmp_path, overlap=False, job_id=job)
    run = TinyRegressor(init_seed=0)
    fit(run, 10, tmp_path, [cb])
    assert not job_files(job)
    assert [s for s, _ in list_checkpoints(tmp_path, 0)] == [10]
    assert_same(run.state_dict(), torch.load(checkpoint_path(tmp_path, 0, 10), weights_only=True)["state_dict"])


class CrashingRegressor(TinyRegressor):
    def training_step(self, batch, batch_idx):
        if self.global_step == 7:
            raise RuntimeError("injected fault")
        return super().training_step(batch, batch_idx)


def test_callback_keeps_memory_snapshot_after_a_failed_fit(job, tmp_path):
    run = CrashingRegressor(init_seed=0)
    with pytest.raises(RuntimeError, match="injected fault"):
        fit(run, 10, tmp_path, [FlashCheckpoint(5, None, tmp_path, job_id=job)])
    assert [c.step for c in list_snapshots(job, 0)] == [5]  # left for a restart or a breakpoint persist
    path = persist_latest(segment_name(job, 0), tmp_path / "ckpt")
    assert torch.load(path, weights_only=True)["global_step"] == 5
    cleanup(job)
