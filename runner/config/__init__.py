"""Config schema, recipe registration and validation."""

from collections.abc import Iterable
from pathlib import Path

from runner.config.errors import ConfigError
from runner.config.registry import register_recipes
from runner.config.schema import register_schema


def register_all(config_dirs: Iterable[Path] = ()) -> None:
    """The schema and the shipped recipes, plus those of ``<dir>/recipes`` for each of ``config_dirs``."""
    register_schema()
    register_recipes(config_dirs)


__all__ = ["ConfigError", "register_all"]
