"""Loads a file from bench/ or scripts/ (neither is a package) as a module, for the unit
tests of its pure logic."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(relative: str, name: str, *, siblings: bool = False) -> ModuleType:
    """The file ``ROOT / relative`` as module ``name``; ``siblings``: it imports modules
    beside it (its folder goes on sys.path)."""
    path = ROOT / relative
    if siblings:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # msgspec Structs resolve their annotations through it
    spec.loader.exec_module(module)
    return module
