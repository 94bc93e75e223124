"""Loads a file from bench/ or scripts/ as a module of its own, for the unit tests of its
pure logic."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(relative: str, name: str) -> ModuleType:
    """The file ``ROOT / relative`` as a fresh module ``name`` (a test may set its
    attributes); the repository root goes on sys.path first, for the ``bench.`` imports
    of a benchmark."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # msgspec Structs resolve their annotations through it
    spec.loader.exec_module(module)
    return module
