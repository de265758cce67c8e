"""The LightningModule that trains ``runner.model.GPT`` and the DataModule for step-indexed sources."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Optional

import lightning.pytorch as pl
import torch

from runner.data import BatchSource, HeldOutSplit, StepLoader
from runner.model import GPT, GPTConfig
from runner.planning.model_cost import flops_per_token
from runner.training.strategy import ResilientStrategy


class GPTModule(pl.LightningModule):
    """``runner.model.GPT`` with AdamW and a warm-up + cosine schedule.

    Its constructor arguments are saved as hyper-parameters in plain types (the shape as a dict), so
    ``GPTModule.load_from_checkpoint(path)`` rebuilds it from a checkpoint alone, with
    ``torch.load(weights_only=True)``.
    """

    def __init__(self, model_cfg: GPTConfig | dict[str, Any], lr: float, min_lr: float, warmup_steps: int,
                 max_steps: int, weight_decay: float, betas: tuple[float, float]) -> None:
        super().__init__()
        if isinstance(model_cfg, dict):  # from a checkpoint's hyper-parameters
            model_cfg = GPTConfig(**model_cfg)
        beta1, beta2 = betas
        self.save_hyperparameters({"model_cfg": asdict(model_cfg), "lr": lr, "min_lr": min_lr,
                                   "warmup_steps": warmup_steps, "max_steps": max_steps,
                                   "weight_decay": weight_decay, "betas": (beta1, beta2)})
        self.model_cfg = model_cfg
        self.model = GPT(model_cfg)
        self.lr, self.min_lr, self.warmup_steps, self.max_steps = lr, min_lr, warmup_steps, max_steps
        self.weight_decay, self.betas = weight_decay, (beta1, beta2)
        self.tokens_per_sample = model_cfg.seq_len
        self.flops_per_token = flops_per_token(model_cfg)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model.loss(batch["idx"], batch["targets"])
        # the mean over the DP ranks, reduced in the step's own all-reduce (runner.training.commit)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model.loss(batch["idx"], batch["targets"])

    def configure_optimizers(self):
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr, betas=self.betas,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self._lr_factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _lr_factor(self, step: int) -> float:
        """Linear warm-up, then cosine decay to min_lr (as a factor of the peak)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
        floor = self.min_lr / self.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class StepDataModule(pl.LightningDataModule):
    """Serves a step-indexed source at the trainer's committed position for the current logical rank, and
    its held-out split (when validation is on) to the runner's validation."""

    def __init__(self, source: BatchSource, held_out: Optional[HeldOutSplit] = None) -> None:
        super().__init__()
        self.source, self.held_out = source, held_out

    def train_dataloader(self) -> StepLoader:
        trainer = self.trainer
        assert trainer is not None  # Lightning attaches the trainer before it asks for the dataloader
        strategy = trainer.strategy
        assert isinstance(strategy, ResilientStrategy)  # which logical rank's samples to serve
        return StepLoader(self.source, lambda: trainer.global_step, lambda: strategy.data_rank)

    def val_dataloader(self) -> HeldOutSplit:
        if self.held_out is None:
            raise ValueError("validation of the built-in data was not set up (trainer.val_check_interval=0)")
        return self.held_out
