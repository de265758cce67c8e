"""The Lightning callbacks of the ``callbacks`` group, built in a worker (``runner.config.callbacks`` checked them).

A model summary (``ModelSummary``, ``RichModelSummary``) is kept only where the summary is shown, on logical rank 0
and not in a replacement (which would print it again); Lightning adds none of its own (``enable_model_summary`` is
off), so ``callbacks=none`` prints none. A ``ModelCheckpoint`` without a ``dirpath`` writes into the run's
``checkpoints/``, beside the runner's ``last.ckpt`` (its own names never collide with it: ``save_last`` is refused).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from hydra.utils import get_object, instantiate
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary
from omegaconf import DictConfig, OmegaConf

from runner.checkpoint import last_checkpoint


def configured_callbacks(cfg: DictConfig, run_dir: str | Path, show_summary: bool) -> list[pl.Callback]:
    out = []
    for entry in (cfg.get("callbacks") or {}).values():
        kwargs = OmegaConf.to_container(entry, resolve=True)
        assert isinstance(kwargs, dict)
        cls = get_object(kwargs["_target_"])
        if issubclass(cls, ModelSummary) and not show_summary:
            continue
        if issubclass(cls, ModelCheckpoint) and kwargs.get("dirpath") is None:
            kwargs["dirpath"] = str(last_checkpoint(run_dir).parent)
        out.append(instantiate(kwargs))
    return out
