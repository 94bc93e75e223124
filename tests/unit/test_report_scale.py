"""Reports of many workers stay readable and quick: bounded tables in natural order, a
trace that keeps every trainer shard and a sample of engines, role rows in the
timeline, per-step idle in one pass, and `simulate`'s result table within its lines."""

from __future__ import annotations

import itertools
import random
import re
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from async_rl.analysis.idle import (
    ROLLOUT_TRACK,
    TRAINER_TRACK,
    breakdown,
    by_role,
    natural_key,
    resolve,
    roles_in_windows,
)
from async_rl.analysis.report import TIMELINE, TRACE
from async_rl.analysis.results import RESULT_LINES, fill_steps, result_table, step_split
from async_rl.analysis.tables import DEVICE_ROWS, FEW_DEVICES, wide_console
from async_rl.analysis.trace import cause_shares
from async_rl.cli import main
from workers.common.spans import Span

SIZE = {"parameters": 4.0e6, "kv_bytes_per_token": 4096, "lengths": "lognormal",
        "length_median": 30.0, "length_sigma": 0.8}


def span(worker: str, role: str, cause: str, start: float, end: float, version: int = 0) -> Span:
    return Span(worker=worker, role=role, rank=0, device="cpu:0", cause=cause, start=start,
                end=end, version=version)


def write_config(path: Path, out: Path, workers: int, shards: int, steps: int = 4) -> Path:
    path.write_text(f"""
[model]
path = "not-needed"
[task]
kind = "longtail"
eval_size = 0
[rollout]
num_workers = {workers}
group_size = 4
max_new_tokens = 128
max_inflight_prompts = 2
[queue]
max_groups = {4 * workers}
bucket_edges = [128, 512]
[staleness]
max_staleness = 1
[trainer]
num_shards = {shards}
groups_per_step = {shards}
micro_batch_tokens = 512
[run]
num_steps = {steps}
output_dir = "{out}"
progress = false
eval_every = 0
[simulate]
{chr(10).join(f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v}" for k, v in SIZE.items())}
detail = 6
""".replace("'", '"'))
    return path


def console_lines(text: str) -> list[str]:
    return [line for line in text.splitlines()]


def test_natural_key_counts_as_people_do() -> None:
    names = ["rollout-10", "rollout-2", "trainer-1", "rollout-100", "rollout-0"]
    assert sorted(names, key=natural_key) == [
        "rollout-0", "rollout-2", "rollout-10", "rollout-100", "trainer-1"]


def test_per_step_idle_in_one_pass_equals_a_breakdown_per_window() -> None:
    rng = random.Random(3)
    spans: list[Span] = []
    for role, causes in (("rollout", ["generate", "idle", "weight_sync"]),
                         ("trainer", ["forward", "idle", "barrier", "optimizer"])):
        for rank in range(3):
            t = rng.uniform(0, 3)
            while t < 40:
                dt = rng.expovariate(1.5)
                spans.append(span(f"{role}-{rank}", role, rng.choice(causes), t, t + dt))
                t += dt
    controller = [span(ROLLOUT_TRACK, "controller", "gate_closed", 0, 45),
                  span(TRAINER_TRACK, "controller", "wait_data", 0, 45)]
    resolved = resolve(spans, controller)
    bounds = sorted(rng.uniform(0, 45) for _ in range(9))
    windows = list(itertools.pairwise(bounds))
    assert len(windows) == 8
    fast = roles_in_windows(resolved, windows)
    for (lo, hi), roles in zip(windows, fast, strict=True):
        slow = by_role(breakdown(resolved, lo, hi))
        assert [r.role for r in roles] == [r.role for r in slow] == ["rollout", "trainer"]
        for got, want in zip(roles, slow, strict=True):
            assert got.wall_s == pytest.approx(want.wall_s)
            assert got.busy_s == pytest.approx(want.busy_s)
            assert set(got.idle_by_cause) == set(want.idle_by_cause)
            for cause, seconds in want.idle_by_cause.items():
                assert got.idle_by_cause[cause] == pytest.approx(seconds, abs=1e-9)
    assert roles_in_windows(resolved, []) == []


def test_cause_shares_add_up_to_the_devices_time_in_each_cause() -> None:
    spans = [span("rollout-0", "rollout", "generate", 0, 4),
             span("rollout-0", "rollout", "weight_sync", 4, 6),
             span("rollout-1", "rollout", "generate", 1, 3)]
    edges = np.linspace(0, 6, 7)
    shares = cause_shares(spans, 2, edges)
    assert shares["generate"].tolist() == pytest.approx([0.5, 1, 1, 0.5, 0, 0])
    assert shares["weight_sync"].tolist() == pytest.approx([0, 0, 0, 0, 0.5, 0.5])
    assert cause_shares([], 2, edges) == {}


def test_fill_steps_leave_at_least_one_step() -> None:
    assert [fill_steps(n, 1) for n in (1, 2, 3, 10)] == [0, 1, 2, 2]
    assert fill_steps(10, 0) == 1
    assert step_split([], 1) is None


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A simulated run of 128 engines and 128 trainer shards, and what simulate printed."""
    import contextlib
    import io

    base = tmp_path_factory.mktemp("many")
    config = write_config(base / "many.toml", base / "run", workers=128, shards=128)
    printed = io.StringIO()
    # The run records its command line, which the report prints: the user's, as the CLI
    # records it, not this pytest process's (as long as the files it was given).
    with contextlib.redirect_stdout(printed), pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["async-rl", "simulate", str(config)])
        assert main(["simulate", str(config)]) == 0
    return base / "run", printed.getvalue()


def test_simulate_of_many_workers_prints_a_bounded_console(many: tuple[Path, str]) -> None:
    run, printed = many
    lines = console_lines(printed)
    assert 10 < len(lines) <= 40
    assert any(line.startswith("result: ") for line in lines)
    for label in ("groups/s, tokens/s", "generation wait", "training", "weight sync",
                  "rollout idle", "trainer idle"):
        assert any(label in line for line in lines), label
    console = wide_console()
    with console.capture() as captured:
        console.print(result_table(run, ()))
    assert 5 < len(captured.get().splitlines()) <= RESULT_LINES


def test_report_of_256_workers_lists_roles_first_then_the_most_idle_in_natural_order(
        many: tuple[Path, str], capsys: pytest.CaptureFixture[str]) -> None:
    run, _ = many
    assert main(["report", str(run)]) == 0
    lines = console_lines(capsys.readouterr().out)
    assert len(lines) <= 40
    rows = [m.group(1) for line in lines if (m := re.match(r"│ (\S+)\s+│", line))]
    assert rows[:2] == ["rollout", "trainer"]
    workers = rows[2:]
    assert len(workers) == 2 * FEW_DEVICES
    assert workers == sorted(workers, key=natural_key)
    assert main(["report", "--all", str(run)]) == 0
    every = [m.group(1) for line in capsys.readouterr().out.splitlines()
             if (m := re.match(r"│ ((?:rollout|trainer)-\d+)\s+│", line))]
    assert len(every) == 256 > DEVICE_ROWS
    assert every == sorted(every, key=natural_key)


def test_the_trace_keeps_every_trainer_shard_and_a_sample_of_engines(
        many: tuple[Path, str]) -> None:
    run, _ = many
    trace = msgspec.json.decode((run / TRACE).read_bytes())
    names = [e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"]
    trainers = [n for n in names if n.startswith("trainer-")]
    engines = [n for n in names if n.startswith("rollout-")]
    assert len(trainers) == 128
    assert 6 <= len(engines) <= 6 + FEW_DEVICES  # simulate.detail spaced + the most idle
    assert "rollout engines" in trace["metadata"]["workers"]
    assert (run / TIMELINE).read_bytes()[:4] == b"\x89PNG"
