"""Make ``recipes/`` visible to Hydra from any working directory.

Hydra names a group after its folder and resolves ``file://`` search paths against the cwd, so the
recipes are stored in the ConfigStore instead: ``recipes/*.yaml`` as group ``recipe`` (package
``_global_``) and ``recipes/fault/*.yaml`` as group ``fault``.
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = PROJECT_ROOT / "conf"
RECIPES_DIR = PROJECT_ROOT / "recipes"
FAULTS_DIR = RECIPES_DIR / "fault"


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def fault_names() -> list[str]:
    return sorted(p.stem for p in FAULTS_DIR.glob("*.yaml"))


def register_recipes() -> None:
    cs = ConfigStore.instance()
    for name in recipe_names():
        cs.store(group="recipe", name=name, node=OmegaConf.load(RECIPES_DIR / f"{name}.yaml"), package="_global_")
    for name in fault_names():
        cs.store(group="fault", name=name, node=OmegaConf.load(FAULTS_DIR / f"{name}.yaml"))
