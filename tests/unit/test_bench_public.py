"""bench/ uses the library's public names only, so a refactor that keeps them cannot break a
benchmark silently: no ``x._name`` on anything but the script's own objects, no private
name imported from the project, no private method of a project class overridden."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
PROJECT = {"async_rl", "workers", "buffers"}
SCRIPTS = sorted(BENCH.rglob("*.py"))


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(source: str) -> list[str]:
    """Each private name the source reaches into the project for, as ``line: what``."""
    tree = ast.parse(source)
    project_names: set[str] = set()
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PROJECT:
            project_names.update(a.asname or a.name for a in node.names)
            found += [f"{node.lineno}: import {a.name}" for a in node.names if private(a.name)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and b.id in project_names for b in node.bases):
            found += [f"{f.lineno}: {node.name}.{f.name} overrides a private method"
                      for f in node.body if isinstance(f, ast.FunctionDef) and private(f.name)]
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def test_the_scan_sees_each_kind_of_private_use() -> None:
    source = ("from workers.trainer import attention, _hidden\n"
              "from workers.trainer.ppo_update import StepLoss\n"
              "attention._per_sequence()\n"
              "class Mine(StepLoss):\n"
              "    def _forward(self):\n"
              "        return self._own\n")
    assert private_uses(source) == ["1: import _hidden", "3: attention._per_sequence",
                                    "5: Mine._forward overrides a private method"]


def test_bench_has_scripts_to_scan() -> None:
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(BENCH)))
def test_a_bench_script_uses_public_names_only(script: Path) -> None:
    assert private_uses(script.read_text()) == []
