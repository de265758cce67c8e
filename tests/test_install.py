"""The built wheel runs from any directory, with nothing of the checkout on the path, and finds a user's
own recipes in their ``recipes/`` folder (``hydra.searchpath`` or ``--config-dir``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT, Run, assert_nothing_left, read_summary, run_cli

from runner.config.registry import user_config_dirs

SOURCES = ["pyproject.toml", "README.md", "runner", "callbacks", "conf", "recipes"]
USER_RECIPE = """\
# @package _global_
recipe_name: my_gpt
model:
  n_layer: 1
trainer:
  max_steps: 3
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the checkout's sources (the build leaves nothing in the checkout)."""
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(src)], check=True, capture_output=True, timeout=180)
    (built,) = dist.glob("resilient_runner-*.whl")
    return built


@pytest.fixture(scope="module")
def site(wheel, tmp_path_factory) -> Path:
    """The wheel unpacked: what an installed runner's site-packages holds."""
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    return site


def from_wheel(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python *args`` in ``cwd`` with the unpacked wheel, and nothing of the checkout, on the path."""
    token = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(site), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "RR_TEST_TOKEN": token}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=240, env=env)
    assert_nothing_left(token, Run(proc, cwd / "run"))
    return proc


def test_the_wheel_holds_every_module_config_and_recipe(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {str(p.relative_to(ROOT)) for p in (ROOT / "runner").rglob("*.py")}
    expected |= {f"runner/{p.relative_to(ROOT)}" for p in (ROOT / "callbacks").rglob("*.py")}
    expected |= {f"runner/{p.relative_to(ROOT)}" for d in ("conf", "recipes") for p in (ROOT / d).rglob("*.yaml")}
    assert not expected - names


@pytest.mark.slow
def test_the_wheel_trains_gpt_tiny_from_another_directory(site, tmp_path):
    which = from_wheel(site, tmp_path, "-c", "import runner.callbacks.metrics as m; print(m.__file__)")
    assert all(Path(f).is_relative_to(site) for f in which.stdout.split()), which.stdout + which.stderr
    proc = from_wheel(site, tmp_path, "-m", "runner", "+recipe=gpt_tiny", "trainer.max_steps=3", "logger=none",
                      "trainer.progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = read_summary(tmp_path / "run")
    assert (summary["status"], summary["global_step"]) == ("completed", 3)


@pytest.mark.slow  # run time: a variant of what the default tier covers (the wheel's contents, recipes composed)
def test_a_users_recipe_in_their_recipes_folder_runs_through_hydra_searchpath(site, tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "my_gpt.yaml").write_text(USER_RECIPE)
    proc = from_wheel(site, tmp_path, "-m", "runner", "+recipe=my_gpt", "hydra.searchpath=[file://.]", "logger=none",
                      "trainer.progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = read_summary(tmp_path / "run")
    assert (summary["status"], summary["global_step"]) == ("completed", 3)
    assert summary["run_name"].startswith("my_gpt-")


def test_the_directories_a_command_line_adds_to_the_search_path_are_where_user_recipes_are_looked_for():
    argv = ["+recipe=my_gpt", "--config-dir", "a", "-cd", "b", "--config-dir=c", "hydra.searchpath=[file://d,e]",
            "+hydra.searchpath=[pkg://runner]", "trainer.max_steps=3"]
    assert user_config_dirs(argv) == [Path(x) for x in "abcde"] + [Path(str(ROOT / "runner"))]
    assert user_config_dirs(["hydra.searchpath=[unclosed"]) == []  # left for Hydra to report


def test_a_run_from_a_directory_with_its_own_callbacks_module_and_folder_completes(tmp_path):
    """A user's ``callbacks.py`` and ``callbacks/`` in the working directory (first on every process's path: the
    launcher's, the fork servers' and the workers') are never imported: the runner's are ``runner.callbacks``."""
    trap = "raise RuntimeError('the user\\'s callbacks were imported in place of the runner\\'s')\n"
    (tmp_path / "callbacks.py").write_text(trap)
    (tmp_path / "callbacks").mkdir()
    (tmp_path / "callbacks" / "__init__.py").write_text(trap)
    run = run_cli("+recipe=gpt_tiny", "trainer.max_steps=3", run_dir=tmp_path / "run", cwd=tmp_path)
    assert run.returncode == 0, run.output[-3000:]
    assert (run.summary["status"], run.summary["global_step"]) == ("completed", 3)
    assert "callbacks were imported" not in run.output
