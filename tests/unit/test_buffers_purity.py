"""buffers/ stays pure: no Ray, torch, vLLM or project imports, so its rules test in ms."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BUFFERS = Path(__file__).resolve().parents[2] / "buffers"
BANNED = {"ray", "torch", "vllm", "async_rl", "workers", "transformers", "asyncio"}
# asyncio: async code in buffers uses anyio, so it runs under any backend the caller picks.

MODULES = sorted(BUFFERS.rglob("*.py"))


def imported_roots(tree: ast.AST) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative imports stay inside buffers/
                continue
            roots.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__":
            roots.add("__import__")  # dynamic imports would dodge this scan
    return roots


def test_buffers_modules_found() -> None:
    assert len(MODULES) >= 5, MODULES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_banned_imports(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = imported_roots(tree) & (BANNED | {"__import__", "importlib"})
    assert not bad, f"{path.name} imports {sorted(bad)}; buffers/ must stay pure"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_module_has_docstring(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    assert ast.get_docstring(tree), f"{path.name} needs a docstring: what it owns, what not"


def test_scanner_catches_banned_imports() -> None:
    source = "import torch.nn\nfrom ray import remote\nfrom .x import y\nimport anyio\n"
    assert imported_roots(ast.parse(source)) == {"torch", "ray", "anyio"}
