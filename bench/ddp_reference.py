"""Plain Lightning DDP on the runner's model and data: the baseline the bench scripts compare to.

Run under torchrun (one process per rank):
    torchrun --standalone --nproc_per_node=4 bench/ddp_reference.py --steps 60 --out result.json
With --ckpt-every it saves Lightning checkpoints; with --resume it loads one first (what a
restart-all with ``torchrun --max-restarts`` does after a crash).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import lightning.pytorch as pl
import torch

from runner.data import StepLoader, SyntheticTokens
from runner.lightning_module import GPTModule
from runner.model import GPTConfig


class Timing(pl.Callback):
    """Wall-clock time of every committed step, and of the first one after start (restart cost)."""

    def __init__(self) -> None:
        self.t_commit: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.t_commit.append(time.time())


class Loader(pl.LightningDataModule):
    def __init__(self, micro_batch: int) -> None:
        super().__init__()
        self.source = SyntheticTokens(1234, 256, 64, micro_batch)

    def train_dataloader(self):
        t = self.trainer
        return StepLoader(self.source, lambda: t.global_step, lambda: t.global_rank)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(1234)
    module = GPTModule(GPTConfig(), 3e-3, 3e-4, 5, args.steps, 0.1, (0.9, 0.95))
    timing = Timing()
    callbacks = [timing]
    if args.ckpt_every:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.ckpt_every,
                                                      save_top_k=-1, save_last=True))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=args.steps, logger=False,
                         callbacks=callbacks,
                         enable_checkpointing=bool(args.ckpt_every), enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, gradient_clip_val=1.0,
                         num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, datamodule=Loader(args.global_batch // world), ckpt_path=args.resume)
    if trainer.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump({"t_commit": timing.t_commit, "start_step": args.steps - len(timing.t_commit)}, f)


if __name__ == "__main__":
    main()
