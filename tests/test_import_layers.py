"""The package layers of docs/architecture.md ("Packages and what they may import"), checked against the code's
imports: every package imports only what its row allows, the controller no technique, no technique another
technique, and nothing of ``runner`` the tests or the benchmarks. The table in the doc is the rule; this test
reads it, so a new dependency is a change to the doc, reviewed as such."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
ROOT_MODULES = ("runner.__main__", "runner.cli", "runner.model", "runner.data", "runner.lightning_module")


def techniques(root: Path) -> set[str]:
    """The recovery techniques: the packages under runner/recovery/ but the shared one."""
    return {f"runner.recovery.{p.name}" for p in (root / "runner" / "recovery").iterdir()
            if (p / "__init__.py").is_file() and p.name != "common"}


def package_of(module: str, known: set[str]) -> str:
    """The table's row a module belongs to: the longest package of the table that holds it."""
    if module in ROOT_MODULES or module == "runner":
        return "runner"
    return max((p for p in known if module == p or module.startswith(p + ".")), key=len, default=module)


def modules(root: Path) -> dict[str, Path]:
    """Every module of the shipped package by its import name (``callbacks/`` installs as ``runner.callbacks``)."""
    found = {}
    for folder, prefix in ((root / "runner", "runner"), (root / "callbacks", "runner.callbacks")):
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((prefix, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


def imports(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports, lazily or not, also under TYPE_CHECKING (a layer is a layer for types too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: -node.level] if not path.name == "__init__.py" else \
                    module.split(".")[: len(module.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            out.add(target)
            out |= {f"{target}.{a.name}" for a in node.names}  # `from runner.plumbing import protocol`
    return out


def layer_table(doc: Path) -> dict[str, set[str]]:
    """The doc's table: package -> the packages it may import (``*``: any)."""
    text = doc.read_text()
    section = text[text.index("## Packages and what they may import"):]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`runner"):
            rows[re.findall(r"`([\w.]+)`", cells[0])[0]] = set(re.findall(r"`([\w.*]+)`", cells[2]))
    return rows


def allowed(dest: str, may: set[str]) -> bool:
    """Whether a row's ``may import`` admits ``dest``: named, or ``*`` (anything), or ``prefix.*`` (below it)."""
    return "*" in may or dest in may or any(m.endswith(".*") and dest.startswith(m[:-1]) for m in may)


def violations(root: Path, table: dict[str, set[str]]) -> list[str]:
    """Every import that breaks a row of the table or one of the rules that hold for all packages."""
    found = modules(root)
    known = set(table)
    techs = techniques(root)
    problems = []
    for module, path in sorted(found.items()):
        own = package_of(module, known)
        if own not in table:
            problems.append(f"{module}: package {own} has no row in the table")
            continue
        seen = set()  # one problem per module and imported package: `from a import b` imports a and a.b
        for target in sorted(imports(path, module)):
            top = target.split(".")[0]
            if top in ("tests", "bench"):
                problems.append(f"{module} imports {target}: nothing of runner imports the tests or benchmarks")
                continue
            if top != "runner" or target in found and package_of(target, known) == own:
                continue
            if target not in found and not any(m.startswith(target + ".") for m in found):
                continue  # a name imported from a module (`from runner.x import y`): the module is checked
            dest = package_of(target, known)
            if dest == own or dest in seen:
                continue
            seen.add(dest)
            if own in techs and dest in techs:
                problems.append(f"{module} imports {target}: a technique never imports another technique")
            elif own == "runner.control" and dest in techs:
                problems.append(f"{module} imports {target}: the controller never imports a technique")
            elif not allowed(dest, table[own]):
                problems.append(f"{module} imports {target}: {own} may import only {sorted(table[own])}")
    return problems


def test_the_code_keeps_to_the_layers_of_the_architecture_doc():
    table = layer_table(DOC)
    assert "runner.plumbing" in table and "runner.control" in table, "the doc's layer table was not found"
    assert violations(ROOT, table) == []


def test_the_tests_never_import_the_benchmarks():
    bad = [f"{p.name}: {t}" for p in sorted((ROOT / "tests").glob("*.py"))
           for t in imports(p, f"tests.{p.stem}") if t.split(".")[0] == "bench"]
    assert bad == []


@pytest.mark.parametrize(("module", "line", "expected"), [
    ("runner/control/bad.py", "from runner.recovery.ndb import takeover", "the controller never imports a technique"),
    ("runner/recovery/ndb/bad.py", "from runner.recovery.deadpool.replicator import X",
     "a technique never imports another technique"),
    ("runner/plumbing/bad.py", "from runner.training import comm", "runner.plumbing may import only"),
    ("runner/planning/bad.py", "import tests.local_hosts", "nothing of runner imports the tests"),
])
def test_a_wrong_import_is_found(tmp_path: Path, module: str, line: str, expected: str):
    """The check can fail: a copy of the package with one wrong import added is refused, naming the rule."""
    import shutil

    for folder in ("runner", "callbacks"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / module).write_text(f'"""A deliberately wrong import."""\n\n{line}\n')
    problems = violations(tmp_path, layer_table(DOC))
    assert len(problems) == 1 and expected in problems[0], problems
