"""Imports run one way: shell -> orchestrator -> buffers and records; workers implement the
protocols and import only the shared vocabulary (docs/architecture.md draws the layers).

Read from the source (every import statement, function-level ones included), so a late
import cannot hide a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHELL = {"async_rl.ray_shell", "async_rl.launch", "async_rl.cli", "async_rl.sweep"}
"""The thin Ray shell and the commands above it (cli, sweep): they may import anything."""
VOCABULARY = {"async_rl.config", "async_rl.records", "async_rl.spans", "async_rl.grpo",
              "async_rl.rewards", "async_rl.greedy"}
"""What workers share with the control plane: config, records, span causes, loss math,
reward functions, greedy decoding for evaluation."""
COMPUTE = {"ray", "workers", "vllm"}


def modules(package: str) -> dict[str, set[str]]:
    """Every module of ``package`` -> the dotted names it imports."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).glob("*.py")):
        name = f"{package}.{path.stem}".removesuffix(".__init__")
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module)
        found[name] = imported
    assert found, package
    return found


def top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("name", sorted(set(modules("async_rl")) - SHELL))
def test_the_control_plane_below_the_shell_never_touches_ray_or_workers(name: str) -> None:
    imported = modules("async_rl")[name]
    assert not {top(m) for m in imported} & COMPUTE, name
    assert not imported & SHELL, name


@pytest.mark.parametrize("name", sorted(modules("workers")))
def test_workers_import_only_the_shared_vocabulary(name: str) -> None:
    from_control = {m for m in modules("workers")[name] if top(m) == "async_rl"}
    assert from_control <= VOCABULARY, (name, from_control - VOCABULARY)


def test_the_vocabulary_depends_on_nothing_above_it() -> None:
    everything = modules("async_rl")
    for name in VOCABULARY:
        above = {m for m in everything[name] if top(m) == "async_rl"} - VOCABULARY
        assert not above, (name, above)


@pytest.mark.parametrize("name", sorted(modules("buffers")))
def test_buffers_stand_alone(name: str) -> None:
    imported = {top(m) for m in modules("buffers")[name]}
    assert not imported & {"ray", "torch", "vllm", "async_rl", "workers"}, name
