"""docs/architecture.md against the tree: its import table, its config table, its paths.

The import table ("What the application imports from `workers/`") is exact both ways: a
part of ``async_rl/`` that imports a ``workers`` module its row does not name fails, and
so does a row naming a module the part no longer imports, or a part without a row. Read
with ``ast``, so nothing is imported and no Ray starts.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
IMPORT_TABLE = "## What the application imports from `workers/`"
CONFIG_TABLE = "## Where each config section lives"


def _section(heading: str) -> str:
    text = DOC.read_text()
    assert heading in text, f"docs/architecture.md has no section {heading!r}"
    body = text.split(heading, 1)[1]
    return body.split("\n## ", 1)[0]


def _table_rows(section: str) -> list[list[str]]:
    """The cells of a markdown table's body rows (header and rule left out)."""
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _workers_modules() -> set[str]:
    return {".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for path in (ROOT / "workers").rglob("*.py")}


def _part(path: Path) -> str:
    """The table's key of a file of async_rl/: its subpackage (``async_rl/run/``) or,
    directly under async_rl/, the file itself (``async_rl/config.py``)."""
    parts = path.relative_to(ROOT / "async_rl").parts
    return f"async_rl/{parts[0]}/" if len(parts) > 1 else f"async_rl/{parts[0]}"


def _imported_workers_modules(path: Path, modules: set[str]) -> set[str]:
    """The workers modules a file imports, at any depth (``from workers.common.spans import
    Span`` is ``workers.common.spans``; ``from workers.rollout import config`` is
    ``workers.rollout.config``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] != "workers":
                continue
            while name not in modules:
                name = name.rsplit(".", 1)[0]
            found.add(name)
    return found


def _actual_imports() -> dict[str, set[str]]:
    modules = _workers_modules()
    actual: dict[str, set[str]] = {}
    for path in sorted((ROOT / "async_rl").rglob("*.py")):
        actual.setdefault(_part(path), set()).update(_imported_workers_modules(path, modules))
    return actual


def _documented_imports() -> dict[str, set[str]]:
    rows = _table_rows(_section(IMPORT_TABLE))
    documented: dict[str, set[str]] = {}
    for row in rows:
        part = _ticked(row[0])
        assert len(part) == 1, f"row without one part: {row}"
        documented[part[0]] = set() if row[1] == "nothing" else set(_ticked(row[1]))
    return documented


def test_the_import_table_names_every_part_of_the_application() -> None:
    documented, actual = _documented_imports(), _actual_imports()
    assert len(actual) >= 10
    assert set(documented) == set(actual), (
        f"parts without a row: {sorted(set(actual) - set(documented))}; "
        f"rows of no part: {sorted(set(documented) - set(actual))}")


def test_each_part_imports_exactly_what_its_row_says() -> None:
    documented, actual = _documented_imports(), _actual_imports()
    assert len(documented) >= 10
    drift = {part: {"imported, not in the row": sorted(actual.get(part, set()) - modules),
                    "in the row, not imported": sorted(modules - actual.get(part, set()))}
             for part, modules in documented.items() if modules != actual.get(part, set())}
    assert not drift, f"docs/architecture.md's import table is out of date: {drift}"


def test_the_control_plane_imports_only_plain_python_from_workers() -> None:
    # The doc's prose names these; the table above is checked against the tree.
    assert _documented_imports()["async_rl/control/"] == {
        "workers.common.errors", "workers.rollout.config", "workers.common.spans",
        "workers.trainer.config"}


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_each_config_class_lives_in_the_file_the_doc_names() -> None:
    rows = _table_rows(_section(CONFIG_TABLE))
    assert len(rows) >= 8
    for row in rows:
        files = _ticked(row[2])
        assert len(files) == 1, f"row without one file: {row}"
        classes = [name for name in _ticked(row[1]) if name.isidentifier()]
        assert classes, f"row without a class: {row}"
        missing = set(classes) - _top_level_names(ROOT / files[0])
        assert not missing, f"{sorted(missing)} not defined in {files[0]}"


def test_every_path_the_doc_names_exists() -> None:
    paths = re.findall(r"`((?:async_rl|workers|buffers|tests|bench|scripts|examples)/[\w./-]*)`",
                       DOC.read_text())
    assert len(paths) >= 30
    missing = sorted({path for path in paths if not (ROOT / path).exists()})
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
