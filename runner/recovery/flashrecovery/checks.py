"""FlashRecovery's own config checks (run by ``runner.config.validate`` when it is in ``ft``)."""

from __future__ import annotations

from omegaconf import DictConfig


def config_problems(cfg: DictConfig, for_training: bool) -> list[str]:
    """A standby is forked before it knows which slot of its host it will take, so it cannot pick that slot's GPU;
    it runs on CPU hosts only."""
    if not for_training or not cfg.ft.flashrecovery.standby or cfg.runner.device == "cpu":
        return []
    return [f"ft.flashrecovery.standby=true with runner.device={cfg.runner.device}: a standby is started before it "
            "knows which slot of its host (and so which GPU) it takes; set runner.device=cpu or "
            "ft.flashrecovery.standby=false."]
