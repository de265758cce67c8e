"""Make the shipped ``conf/`` and ``recipes/``, and a user's own ``recipes/``, visible to Hydra from any directory.

Where they are: a wheel (or ``pip install .``) ships them inside the package as ``runner/conf`` and
``runner/recipes`` (the package-dir mapping in pyproject.toml); a checkout, on PYTHONPATH or installed
with ``pip install -e .``, has them beside the package. Both are found from the imported package's
location (``importlib.resources``), never from the working directory.

Hydra names a group after its folder, so ``recipes/*.yaml`` would be group ``recipes``. The recipes
are therefore stored in the ConfigStore: ``recipes/*.yaml`` as group ``recipe`` (package
``_global_``) and ``recipes/fault/*.yaml`` as group ``fault``; the same for the ``recipes/`` folder of
each directory the command line adds to Hydra's search path (``--config-dir DIR``,
``hydra.searchpath=[file://DIR]``), registered after the shipped ones so a user's recipe of the same
name wins.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterable
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

PACKAGE_DIR = Path(str(importlib.resources.files("runner")))


def _shipped(folder: str) -> Path:
    """``folder`` inside the installed package (wheel), else beside the package (checkout, editable install)."""
    inside = PACKAGE_DIR / folder
    return inside if inside.is_dir() else PACKAGE_DIR.parent / folder


CONF_DIR = _shipped("conf")
RECIPES_DIR = _shipped("recipes")
FAULTS_DIR = RECIPES_DIR / "fault"


def recipe_names(recipes_dir: Path = RECIPES_DIR) -> list[str]:
    return sorted(p.stem for p in recipes_dir.glob("*.yaml"))


def fault_names(recipes_dir: Path = RECIPES_DIR) -> list[str]:
    return sorted(p.stem for p in (recipes_dir / "fault").glob("*.yaml"))


def register_recipes(config_dirs: Iterable[Path] = ()) -> None:
    """The shipped recipes, then those of ``<dir>/recipes`` for each of ``config_dirs`` that has one."""
    cs = ConfigStore.instance()
    for recipes in [RECIPES_DIR, *(Path(d) / "recipes" for d in config_dirs)]:
        for name in recipe_names(recipes):
            cs.store(group="recipe", name=name, node=OmegaConf.load(recipes / f"{name}.yaml"), package="_global_")
        for name in fault_names(recipes):
            cs.store(group="fault", name=name, node=OmegaConf.load(recipes / "fault" / f"{name}.yaml"))


def user_config_dirs(argv: list[str]) -> list[Path]:
    """The directories a command line adds to Hydra's search path: ``--config-dir``/``-cd`` and
    ``hydra.searchpath`` (``file://`` and plain paths relative to the working directory, as Hydra reads
    them, and ``pkg://`` packages). Malformed overrides are left for Hydra to report."""
    dirs: list[Path] = []
    overrides = []
    args = iter(argv)
    for arg in args:
        if arg in ("--config-dir", "-cd"):
            dirs.append(Path(next(args, "")))
        elif arg.startswith("--config-dir="):
            dirs.append(Path(arg.split("=", 1)[1]))
        elif arg.lstrip("+~").startswith("hydra.searchpath="):
            overrides.append(arg)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # Hydra parses the same overrides next and says what is wrong
        return dirs
    for override in parsed:
        value = override.value()
        for entry in value if isinstance(value, list) else [value]:
            if str(entry).startswith("pkg://"):
                try:
                    dirs.append(Path(str(importlib.resources.files(str(entry)[len("pkg://"):].replace("/", ".")))))
                except ModuleNotFoundError:  # Hydra reports the missing search path
                    continue
            else:
                dirs.append(Path(str(entry).removeprefix("file://")))
    return dirs
