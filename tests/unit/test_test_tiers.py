"""The test tree collects as one: pytest imports test files by basename (no packages)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_file_basenames_are_unique_across_tiers() -> None:
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) >= 40, files
    # Two tiers holding test_x.py abort collection of the whole run ("import file mismatch").
    clashes = [name for name, n in Counter(p.name for p in files).items() if n > 1]
    assert not clashes, f"rename one of each: {clashes}"
