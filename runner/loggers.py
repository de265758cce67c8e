"""The experiment logger of the metrics rank: W&B (offline by default), CSV, or none."""

from __future__ import annotations

import hashlib
from pathlib import Path

from omegaconf import DictConfig


def run_name(cfg: DictConfig) -> str:
    ft = "+".join(cfg.ft.keys()) if cfg.ft else "noft"
    return f"{cfg.recipe_name}-{ft}-{cfg.fault.kind}-w{cfg.parallel.nodes}x{cfg.parallel.procs_per_node}"


def build_logger(cfg: DictConfig, run_dir: Path):
    kind = cfg.logger.kind
    if kind == "none":
        return False
    if kind == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir=str(run_dir), name="csv")
    from lightning.pytorch.loggers import WandbLogger

    group = cfg.logger.group or str(Path(run_dir).parent if _in_sweep(run_dir) else run_dir)
    # one W&B run per job, resumed by id when a replacement takes over logical rank 0
    run_id = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return WandbLogger(project=cfg.logger.project, save_dir=str(run_dir), name=run_name(cfg), group=group,
                       id=run_id, resume="allow", mode=cfg.logger.mode,
                       config={"recipe": cfg.recipe_name, "ft": list(cfg.ft.keys())})


def _in_sweep(run_dir: Path) -> bool:
    return Path(run_dir).name.isdigit()
