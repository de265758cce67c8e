"""The flash checkpoint's own config checks (run by ``runner.config.validate`` when it is in ``ft``)."""

from __future__ import annotations

from omegaconf import DictConfig


def config_problems(cfg: DictConfig, for_training: bool) -> list[str]:
    """The snapshot and persist cadences and the files kept."""
    fc = cfg.ft.flash_ckpt
    every, persist = fc.get("every_n_steps", 1), fc.get("persist_every_n_steps", 0)
    out = []
    if not isinstance(every, int) or every < 1:
        out.append(f"ft.flash_ckpt.every_n_steps={every} must be >= 1 (a snapshot every that many steps).")
    elif not isinstance(persist, int) or persist < 0 or persist % every:
        out.append(f"ft.flash_ckpt.persist_every_n_steps={persist} must be 0 (never to disk) or a multiple of "
                   f"ft.flash_ckpt.every_n_steps={every}: only snapshots are persisted.")
    if isinstance(fc.get("keep", 1), int) and fc.get("keep", 1) < 1:
        out.append(f"ft.flash_ckpt.keep={fc.keep} must be >= 1 (persisted checkpoints kept on disk).")
    return out
