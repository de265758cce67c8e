"""The flash checkpoint as the runner sees it: every rank restarts from its snapshot in memory."""

from __future__ import annotations

from runner.recovery.flash_ckpt.action import RestartAll
from runner.recovery.flash_ckpt.config import FlashCkptConfig
from runner.recovery.technique import Technique

TECHNIQUE = Technique(
    name="flash_ckpt",
    title="the flash checkpoint",
    options=FlashCkptConfig,
    actions=(RestartAll,),
    worker="runner.recovery.flash_ckpt.worker:FlashCkptWorker",
    restarts_from_snapshots=True,
    saved_state="runner.recovery.flash_ckpt.saved_state",
    checks="runner.recovery.flash_ckpt.checks:config_problems",
)
