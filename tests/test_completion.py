"""Shell completion: ``resilient-runner`` (the console script, same entry point as ``python -m runner``) completes
config groups, recipes and keys through Hydra's completion, which finds commands on PATH only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(sys.executable).with_name("resilient-runner")


def _complete(line: str, tmp_path: Path) -> list[str]:
    out = subprocess.run([str(SCRIPT), "-sc", "query=bash"], env={**os.environ, "COMP_LINE": line}, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.split()


def test_the_console_script_completes_groups_recipes_and_keys(tmp_path):
    assert SCRIPT.exists(), f"{SCRIPT} is missing: install the project (pip install -e .)"
    assert "ft=" in _complete("resilient-runner ft", tmp_path)
    assert "+recipe=gpt_tiny" in _complete("resilient-runner +recipe=", tmp_path)
    assert _complete("resilient-runner parallel.no", tmp_path) == ["parallel.nodes="]


def test_the_completion_script_installs_for_the_console_script(tmp_path):
    out = subprocess.run([str(SCRIPT), "-sc", "install=bash"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.rstrip().endswith("complete -o nospace -o default -F hydra_bash_completion resilient-runner")
