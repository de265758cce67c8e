"""Tiny user Lightning modules the validation and training-loop tests train through ``model._target_``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def _regression(rows: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * torch.randn(rows, 1, generator=g))


class RegressionData(pl.LightningDataModule):
    """Map-style training rows and a held-out set of 5 validation batches of 8."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_regression(256, 0), batch_size=8)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_regression(40, 1), batch_size=8)


class ValidatedRegressor(pl.LightningModule):
    """A user's module with a validation_step that logs as usual and returns the batch's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class ManualRegressor(ValidatedRegressor):
    """The same training with manual optimization: one optimizer step per training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()
        return loss


class WideRegressor(ValidatedRegressor):
    """A hidden width as a constructor argument, saved as a hyper-parameter (Lightning's save_hyperparameters)."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))


class LoggingOnlyRegressor(ValidatedRegressor):
    """Lightning's documented idiom: a validation_step that logs its loss and returns nothing."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))


class StatedRegressor(WideRegressor):
    """A module that states its cost: 4 tokens per sample (its 8 inputs in pairs) and its training FLOPs per sample
    (6 x parameters, forward and backward), so the run reports tokens/s and MFU."""

    tokens_per_sample = 4

    @property
    def flops_per_sample(self) -> float:
        return 6.0 * sum(p.numel() for p in self.parameters())


class LoggingRegressor(ValidatedRegressor):
    """Logs as a Lightning user does: step and epoch values, synced and not, one kept from the logger, and a StepLR
    schedule (``train/lr``)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.net(x)
        loss = nn.functional.mse_loss(pred, y)
        self.log("my/mae", (pred - y).abs().mean(), sync_dist=True)  # the DP mean
        self.log_dict({"my/rank_loss": loss, "my/pred_max": pred.max()}, on_step=True)  # this rank's own
        self.log("my/loss_mean", loss, sync_dist=True)  # the runner's own loss, as Lightning reduces it
        self.log("my/loss_peak", loss, sync_dist=True, reduce_fx="max")
        self.log("my/epoch_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("my/both", loss, on_step=True, on_epoch=True)  # my/both_step, my/both_epoch
        self.log("my/bar_only", loss, prog_bar=True, logger=False)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 4, 0.5),
                                                   "interval": "step"}}


class LoggingValidatingRegressor(LoggingRegressor):
    """And a validation_step in Lightning's idiom: it logs and returns nothing."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        err = self.net(x) - y
        self.log("val/mse", (err ** 2).mean(), sync_dist=True)
        self.log("val/worst", err.abs().max(), sync_dist=True, reduce_fx="max")


class LossLoggingRegressor(ValidatedRegressor):
    """Logs under ``loss``, a field the runner writes itself in metrics.jsonl."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss


class RegressionTestData(RegressionData):
    """With a test set of 5 batches of 8 (``runner.test_after_fit``)."""

    def test_dataloader(self) -> DataLoader:
        return DataLoader(_regression(40, 2), batch_size=8)


class SeenAtValidationEnd(pl.Callback):
    """A user's callback: what logical rank 0 finds in ``trainer.callback_metrics`` at each ``on_validation_end``, one
    JSON line per call, in ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            seen = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
            stopping = trainer.early_stopping_callback
            if stopping is not None:
                seen["early_stopping_best"] = float(stopping.best_score)
            with open(self.path, "a") as f:
                f.write(json.dumps({"global_step": trainer.global_step, **seen}) + "\n")


class EvaluatedRegressor(ValidatedRegressor):
    """Lightning's evaluation idioms: a validation_step that only logs (means weighted by batch size, a max, a sum,
    one value without sync_dist), an on_validation_epoch_end that logs, a test_step, and (``seen``) Lightning's
    EarlyStopping on val/loss and a callback of its own (``configure_callbacks``) that records what it sees at
    on_validation_end."""

    def __init__(self, seen: str = "") -> None:
        super().__init__()
        self.seen = seen

    def validation_step(self, batch, batch_idx):
        x, y = batch
        err = self.net(x) - y
        self.log("val/loss", (err ** 2).mean(), sync_dist=True, prog_bar=True)
        self.log_dict({"val/mae": err.abs().mean(), "val/rows": float(len(x))}, sync_dist=True)
        self.log("val/worst", err.abs().max(), sync_dist=True, reduce_fx="max")
        self.log("val/count", float(len(x)), sync_dist=True, reduce_fx="sum")
        self.log("val/rank0_mae", err.abs().mean())  # no sync_dist: logical rank 0's own batches
        self.log("val/hidden", err.abs().mean(), sync_dist=True, logger=False)

    def on_validation_epoch_end(self):
        self.log("val/ranks", 1.0, sync_dist=True, reduce_fx="sum")

    def test_step(self, batch, batch_idx):
        x, y = batch
        err = self.net(x) - y
        self.log("test/mae", err.abs().mean(), sync_dist=True)
        self.log("test/count", float(len(x)), sync_dist=True, reduce_fx="sum")

    def configure_callbacks(self):
        stopping = EarlyStopping(monitor="val/loss", patience=100)  # stock: it checks at on_validation_end
        return [stopping, SeenAtValidationEnd(self.seen)] if self.seen else []


class IndexedData(pl.LightningDataModule):
    """Regression rows that carry their dataset index, in the order of the sampler asked for: ``sequential``,
    ``random`` (shuffle=True) or ``distributed`` (a DistributedSampler with shuffle and a seed of its own)."""

    def __init__(self, rows: int = 68, sampler: str = "sequential", sampler_seed: int = 7) -> None:
        super().__init__()
        self.rows, self.sampler, self.sampler_seed = rows, sampler, sampler_seed

    def train_dataloader(self) -> DataLoader:
        data = _regression(self.rows, 0)
        dataset = TensorDataset(*data.tensors, torch.arange(self.rows))
        if self.sampler == "distributed":
            sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=self.sampler_seed)
            return DataLoader(dataset, batch_size=4, sampler=sampler)
        return DataLoader(dataset, batch_size=4, shuffle=self.sampler == "random")


class IndexRecordingRegressor(ValidatedRegressor):
    """Writes, to a file of its process under ``record_dir``, the dataset indices each training step read (with the
    step, epoch and data rank) and the epoch every ``on_train_epoch_start``/``end`` saw, with the epoch its
    sampler was set to: what the epoch tests account for across processes, a replacement's included. The mean
    index of the epoch's rows is logged as an epoch value (``rows/mean_index``)."""

    def __init__(self, record_dir: str) -> None:
        super().__init__()
        self.record_dir = Path(record_dir)

    def _record(self, **entry: object) -> None:
        self.record_dir.mkdir(parents=True, exist_ok=True)
        with open(self.record_dir / f"{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self._record(kind="step", step=self.trainer.global_step, epoch=self.trainer.current_epoch,
                     batch_idx=batch_idx, rank=self.trainer.strategy.data_rank, idx=idx.tolist())
        self.log("rows/mean_index", idx.double().mean(), on_step=False, on_epoch=True, sync_dist=True)
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_epoch_start(self) -> None:
        sampler = self.trainer.train_dataloader.sampler
        self._record(kind="epoch_start", epoch=self.trainer.current_epoch, step=self.trainer.global_step,
                     sampler_epoch=getattr(sampler, "epoch", None))

    def on_train_epoch_end(self) -> None:
        self._record(kind="epoch_end", epoch=self.trainer.current_epoch, step=self.trainer.global_step)
