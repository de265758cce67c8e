"""NDB's own config checks (run by ``runner.config.validate`` when it is in ``ft``)."""

from __future__ import annotations

from omegaconf import DictConfig


def config_problems(cfg: DictConfig, for_training: bool) -> list[str]:
    """NDB's approximations are the built-in GPT's: it cannot drive a user's module."""
    if not cfg.model._target_:
        return []
    return ["ft=ndb approximates the built-in GPT's attention and FFN branches; it cannot drive "
            f"model._target_={cfg.model._target_}: use ft=flashrecovery for your own module."]
