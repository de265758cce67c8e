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

    # one W&B run per job, resumed by id when a replacement takes over logical rank 0
    return WandbLogger(project=cfg.logger.project, save_dir=str(run_dir), name=run_name(cfg),
                       group=_wandb_group(cfg, run_dir), id=_wandb_id(run_dir), resume="allow", mode=cfg.logger.mode,
                       config={"recipe": cfg.recipe_name, "ft": list(cfg.ft.keys())})


def _wandb_group(cfg: DictConfig, run_dir: Path) -> str:
    """Runs of one sweep share a group: the sweep directory, relative to the working directory (or its last
    three parts, e.g. multirun/<date>/<time>, when it lies elsewhere), so that a group name does not carry one
    machine's absolute paths."""
    if cfg.logger.group:
        return cfg.logger.group
    run_dir = Path(run_dir).resolve()
    group = run_dir.parent if run_dir.name.isdigit() else run_dir
    try:
        return str(group.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(Path(*group.parts[-3:]))


def _wandb_id(run_dir: Path) -> str:
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


RECOVERY_KEYS = ("rto_s", "detect_s", "decide_s", "replace_s", "rebuild_s", "restore_s", "rpo_steps")


def recovery_metrics(summary: dict) -> list[dict]:
    """One W&B record per recovery, on its own step metric (``recovery/id``), plus the run totals."""
    records = [{"recovery/id": r["id"], "recovery/step": r["step"],
                **{f"recovery/{k}": r[k] for k in RECOVERY_KEYS if r.get(k) is not None}}
               for r in summary["recoveries"]]
    totals = {f"run/{k}": summary[k] for k in ("tokens_per_s", "steps_per_s", "mfu", "effective_training_time_ratio",
                                               "samples_lost", "samples_duplicated") if summary.get(k) is not None}
    return records + [totals]


def log_summary_to_wandb(cfg: DictConfig, run_dir: Path, summary: dict) -> None:
    """Add the recoveries and totals to the job's W&B run (the same run id the metrics rank used)."""
    if cfg.logger.kind != "wandb" or cfg.logger.mode == "disabled":
        return
    import wandb

    run = wandb.init(project=cfg.logger.project, id=_wandb_id(run_dir), resume="allow", dir=str(run_dir),
                     mode=cfg.logger.mode, name=run_name(cfg), group=_wandb_group(cfg, run_dir))
    run.define_metric("recovery/id")
    run.define_metric("recovery/*", step_metric="recovery/id")
    for record in recovery_metrics(summary):
        run.log(record)
    run.summary.update({"status": summary["status"], "param_checksum": summary["param_checksum"]})
    run.finish()
