"""scripts/gpu-check.sh on a machine without CUDA: one line, exit 0, and the trainer's
import chain (what the GPU machine runs without ray or vllm) checked on the way; every
module that chain needs either beside torch and transformers or in a carried wheel; and
a dry run of every row on the CPU, the CUDA calls stubbed, each row printed and kept as
it is made, a row that raises failing alone."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any
from uuid import UUID

import pytest
import torch
from packaging.requirements import Requirement
from script_modules import load_script

from async_rl.models.tiny_model import TINY

REPO = Path(__file__).resolve().parents[2]
PROJECT = ("async_rl", "buffers", "workers", "bench")
CHECK_SCRIPTS = tuple(f"bench.trainer.{name}" for name in ("gpu_check", "gpu_rows", "trainer_step"))
"""bench/ files the check runs: every import in them counts, not only module-level ones."""

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA run is the check itself")
def test_without_cuda_the_check_skips_in_one_line() -> None:
    done = subprocess.run([str(REPO / "scripts" / "gpu-check.sh")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"gpu check skipped: no CUDA device (torch {torch.__version__}; imports checked, "
        "no ray or vllm)"]


def carried() -> dict[str, str]:
    """The script's ``WHEELS``: module -> the distribution whose wheel it installs."""
    script = (REPO / "scripts" / "gpu-check.sh").read_text()
    (pairs,) = re.findall(r'^WHEELS="([^"]*)"$', script, re.MULTILINE)
    return dict(pair.split(":") for pair in pairs.split())


def test_the_carried_wheels_fit_the_gpu_machine() -> None:
    wheels = sorted(p.name for p in (REPO / "scripts" / "wheels").iterdir())
    assert len(wheels) == len(carried()) == 3
    assert wheels[0].startswith("msgspec-") and "-cp312-" in wheels[0]
    assert wheels[1].startswith("nvidia_ml_py-") and wheels[1].endswith("py3-none-any.whl")
    assert wheels[2].startswith("psutil-") and "-abi3-" in wheels[2]  # any CPython 3
    assert all("manylinux" in w and "x86_64" in w for w in (wheels[0], wheels[2]))
    assert {w.split("-")[0].replace("_", "-") for w in wheels} == set(carried().values())
    assert sum((REPO / "scripts" / "wheels" / w).stat().st_size for w in wheels) < 1 << 20


def beside_torch_and_transformers() -> set[str]:
    """The modules a Python with torch and transformers has: theirs and those of
    everything they require (as installed here)."""
    wanted, seen = ["torch", "transformers"], set()
    while wanted:
        name = wanted.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        for line in importlib.metadata.requires(name) or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                wanted.append(requirement.name)
    return {module for module, dists in importlib.metadata.packages_distributions().items()
            if any(d.lower().replace("_", "-") in seen for d in dists)}


def check_imports() -> dict[str, set[str]]:
    """Every third-party module the GPU check imports -> the files importing it: every
    import of the check's own scripts, the module-level imports of each project module
    they reach (what importing them needs), followed through."""
    def source(name: str) -> tuple[Path, bool] | None:
        path = REPO.joinpath(*name.split("."))
        if name in CHECK_SCRIPTS:
            return path.with_suffix(".py"), True
        for candidate in (path / "__init__.py", path.with_suffix(".py")):
            if candidate.exists():
                return candidate, False
        return None

    found: dict[str, set[str]] = {}
    todo, seen = ["bench.trainer.gpu_check"], set()
    while todo:
        name = todo.pop()
        where = source(name)
        if where is None or where[0] in seen:
            continue
        seen.add(where[0])
        tree = ast.parse(where[0].read_text())
        for node in ast.walk(tree) if where[1] else tree.body:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for imported in names:
                top = imported.split(".")[0]
                if top in PROJECT:
                    parts = imported.split(".")
                    todo += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
                elif top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, set()).add(name)
    return found


def test_the_script_brings_every_module_the_check_imports() -> None:
    needed = check_imports()
    assert {"torch", "transformers", "msgspec", "pynvml", "psutil"} <= set(needed)
    missing = {m: sorted(by) for m, by in needed.items()
               if m not in beside_torch_and_transformers() and m not in carried()}
    assert missing == {}


# -- the dry run ------------------------------------------------------------------------


DRY_SCALE = {"model": TINY, "sequences": 4, "long_sequences": 4, "long_micro_batches": 2,
             "attention_tokens": (300,), "wide_vocab": 1024, "repeats": 1,
             "fsdp_batch": (2, 32)}
ROWS = [
    "device", "varlen attention = loop (300 tokens)",
    "varlen attention = loop (300 tokens, window 128)", "packed = padded logprobs (float32)",
    "(b') new path, float32 compute", "packed = padded logprobs (bfloat16)",
    "(a) today's path, check batch", "(b) new path, check batch", "(c) 4 x 16k eager",
    "(d) 4 x 16k compiled", "(e) 151,936 vocab, today's path",
    "(e) 151,936 vocab, new path compiled", "NVML by UUID (cuda:0)",
    "FSDP2 + pinned CPUOffloadPolicy (1 rank)",
    "FSDP2 offload clip (cpu:gloo,cuda:gloo, 1 rank)", "total"]


class FakeProfile:
    """``torch.profiler.profile`` on a machine without CUDA: one 1 ms kernel."""

    def __init__(self, **_: Any) -> None:
        pass

    def __enter__(self) -> FakeProfile:
        return self

    def __exit__(self, *_: Any) -> None:
        pass

    def events(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(device_type=SimpleNamespace(name="CUDA"), device_time=1e3)]


@pytest.fixture
def cuda_stubbed(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[Any]]]:
    """Every CUDA call the rows make, answered on the CPU; torch.compile traced by
    dynamo without code generation. Yields what was compiled."""
    import torch._dynamo

    for name in ("synchronize", "reset_peak_memory_stats", "set_sync_debug_mode"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: None)
    for name in ("memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H200 (stub)")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda ordinal: SimpleNamespace(uuid=UUID(int=ordinal + 1)))
    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setitem(sys.modules, "pynvml", SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda uuid: uuid, nvmlDeviceGetIndex=lambda handle: 0,
        nvmlDeviceGetHandleByIndex=lambda i: f"GPU-{UUID(int=i + 1)}",
        nvmlDeviceGetUUID=lambda handle: handle,
        nvmlDeviceGetUtilizationRates=lambda handle: SimpleNamespace(gpu=7)))
    compiled: list[Any] = []
    eager = functools.partial(torch.compile, backend="eager")
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn) or eager(fn, **kw))
    torch._dynamo.reset()
    try:
        yield {"compiled": compiled}
    finally:
        torch._dynamo.reset()


def check_modules() -> tuple[ModuleType, ModuleType]:
    """A fresh gpu_check (the tests set its attributes) and the rows module it imports."""
    check = load_script("bench/trainer/gpu_check.py", "gpu_check_dry")
    return check, importlib.import_module("bench.trainer.gpu_rows")


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_dry_run_makes_every_row_and_prints_each_as_it_is_made(
        cuda_stubbed: dict[str, list[Any]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    gpu_check, gpu_rows = check_modules()
    report = gpu_check.Report(tmp_path / "out" / "results.md")
    printed_before: list[str] = []

    def step_row(*args: Any) -> Any:  # what was printed when each step row started
        printed_before.append(capsys.readouterr().out)
        return real_step_row(*args)

    real_step_row = gpu_rows.step_row
    gpu_check.step_row = step_row
    setup = gpu_rows.Setup(tmp_path / "models", torch.device("cpu"),
                           gpu_rows.Scale(**DRY_SCALE), port=free_port())
    gpu_check.run_all(setup, report)
    printed = "".join(printed_before) + capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[:2] == ["| check | result | figures |", "| --- | --- | --- |"]
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines[2:]]
    assert [c[0] for c in cells] == ROWS
    assert all(c[1] == "ok" for c in cells[1:-1]), printed
    assert report.ok
    # Each row was out before the next began: the first step row saw the two rows before.
    assert printed_before[0].splitlines()[-1].startswith("| packed = padded logprobs (float")
    assert len(printed_before) == 7
    assert (tmp_path / "out" / "results.md").read_text().splitlines()[-len(lines):] == lines
    # Compiled: the two compiled rows' layers only; never the padded reference.
    assert len(cuda_stubbed["compiled"]) == 2 * TINY.num_layers
    assert "\\|diff\\|" in printed  # a figure's own bars do not split its cell


def test_a_row_that_raises_fails_alone_and_the_others_still_print(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_check, _ = check_modules()

    def fails(*args: Any) -> Any:
        raise RuntimeError("compiled row died\nsecond line")

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "stub")
    monkeypatch.setattr(gpu_check, "checks", lambda setup: [
        ("first", lambda: [("first", "ok", "1")]), ("(d) compiled", fails),
        ("after", lambda: [("after", "ok", "2"), ("after, again", "ok", "3")])])
    report = gpu_check.Report(tmp_path / "results.md")
    gpu_check.run_all(None, report)
    rows = capsys.readouterr().out.splitlines()[3:-1]
    assert rows == ["| first | ok | 1 |",
                    "| (d) compiled | FAILED | RuntimeError: compiled row died |",
                    "| after | ok | 2 |", "| after, again | ok | 3 |"]
    assert not report.ok


def test_the_reference_way_is_never_compiled(tmp_path: Path,
                                             cuda_stubbed: dict[str, list[Any]]) -> None:
    check_modules()
    from async_rl.models.real_size import make_random_model
    from bench.trainer import trainer_step

    make_random_model(tmp_path, size=TINY, log=None)
    reference = trainer_step.make_shard(tmp_path, "trl", 1024, compile=True)
    new = trainer_step.make_shard(tmp_path, "new", 1024, compile=True)
    assert reference.compiled_layers == 0 and new.compiled_layers == TINY.num_layers
    assert len(cuda_stubbed["compiled"]) == TINY.num_layers
