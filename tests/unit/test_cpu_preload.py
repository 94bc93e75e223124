"""CPU engines preload tcmalloc and Intel's OpenMP where found, and stay silent where not."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from workers.rollout.engine import preload_cpu_libs, preload_dirs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD")


def libs(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"")
    return folder


def test_found_libraries_go_in_front(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv = libs(tmp_path / "venv", "libiomp5.so")
    system = libs(tmp_path / "system", "libtcmalloc.so.4", "libtcmalloc_minimal.so.4")
    monkeypatch.setenv("LD_PRELOAD", "/opt/libother.so")
    added = preload_cpu_libs([venv, system])
    # The minimal tcmalloc is preferred; one OpenMP runtime.
    assert added == [str(system / "libtcmalloc_minimal.so.4"), str(venv / "libiomp5.so")]
    assert os.environ["LD_PRELOAD"] == ":".join([*added, "/opt/libother.so"])
    # A second engine in the same process adds nothing twice.
    assert preload_cpu_libs([venv, system]) == []


def test_missing_libraries_are_a_silent_no_op(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert preload_cpu_libs([tmp_path / "absent", libs(tmp_path / "empty")]) == []
    assert "LD_PRELOAD" not in os.environ
    assert capfd.readouterr() == ("", "")


def test_an_openmp_runtime_already_named_is_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM refuses libgomp and libiomp together: a preloaded libgomp stays the only one.
    found = libs(tmp_path / "lib", "libiomp5.so", "libtcmalloc_minimal.so.4")
    monkeypatch.setenv("LD_PRELOAD", "/torch/lib/libgomp.so.1")
    assert preload_cpu_libs([found]) == [str(found / "libtcmalloc_minimal.so.4")]


def test_the_environment_is_searched_first() -> None:
    assert preload_dirs()[0] == Path(sys.prefix, "lib")
