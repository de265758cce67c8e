"""Config schema, recipe registration and validation."""

from runner.config.errors import ConfigError
from runner.config.registry import register_recipes
from runner.config.schema import register_schema


def register_all() -> None:
    register_schema()
    register_recipes()


__all__ = ["ConfigError", "register_all"]
