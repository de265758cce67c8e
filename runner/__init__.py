"""The runner's package. Its Lightning callbacks live in the repository's top-level ``callbacks/`` folder and are
``runner.callbacks``: pyproject.toml maps the folder into the package, so a wheel holds ``runner/callbacks``, and a
checkout (on ``PYTHONPATH``, or installed editable) loads the folder beside this one under that name here, by its
path. Either way no ``callbacks`` module or folder of a user's working directory can take its place."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _checkout_callbacks() -> None:
    here = Path(__file__).resolve().parent
    folder = here.parent / "callbacks"
    if (here / "callbacks").is_dir() or not (folder / "__init__.py").is_file() or "runner.callbacks" in sys.modules:
        return  # an installed wheel holds its own runner/callbacks
    spec = importlib.util.spec_from_file_location("runner.callbacks", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["runner.callbacks"] = module
    globals()["callbacks"] = module  # the attribute an import of the subpackage sets
    spec.loader.exec_module(module)


_checkout_callbacks()
