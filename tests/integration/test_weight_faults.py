"""A rollout engine killed in the middle of a weight broadcast (real Ray, real vLLM CPU
engines, the real trainer): the broadcast fails for every member, the group is rebuilt
without the dead engine and the survivor takes the same version in the same delivery,
the dead worker is replaced and its replacement joins at a later version, and no engine
generates from a version it did not load whole."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import ray

from async_rl.analysis.report import read_spans
from async_rl.config_io import decode_config
from async_rl.run.run_dir import METRICS, read_ledger
from async_rl.run.summary import RunSummary
from async_rl.shell.ray_shell import NAMESPACE, run_training

pytestmark = pytest.mark.ray
# The hook below runs inside a rollout actor, which cannot import this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = 10
KILL_AT = 4
"""The version whose broadcast the victim dies in."""


def kill_engine_when_version_arrives(worker: Any, version: int) -> None:
    """Runs inside the victim rollout actor: when the transfer of ``version`` begins (the
    engine is paused and the trainer is sending), SIGKILLs the vLLM engine process,
    then lets the receive run into the dead engine."""
    import psutil

    receiver = worker._receiver
    receive = receiver.receive

    async def receive_into_a_dead_engine(engine: Any, update_info: Any) -> None:
        if receiver._pending == version:
            # The engine's title, or multiprocessing's spawn command line where
            # setproctitle cannot rewrite it (CI's interpreter).
            for child in psutil.Process().children():
                title = " ".join(child.cmdline()) + child.name()
                if "EngineCore" in title or "multiprocessing.spawn" in title:
                    child.kill()
                    child.wait(timeout=30)
        await receive(engine, update_info)

    receiver.receive = receive_into_a_dead_engine


def run_with_a_kill(tiny_model_dir: Path, out: Path) -> RunSummary:
    config = decode_config({
        "model": {"path": str(tiny_model_dir)},
        "task": {"eval_size": 0},
        "rollout": {"num_workers": 2, "group_size": 4, "max_new_tokens": 6,
                    "max_inflight_prompts": 4, "memory_fraction": 0.1},
        "staleness": {"max_staleness": 1},
        "trainer": {"groups_per_step": 4, "micro_batch_tokens": 512},
        "weights": {"timeout_s": 20.0},
        "run": {"num_steps": STEPS, "output_dir": str(out), "progress": False},
    })
    result: list[RunSummary] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(run_training(config))
        except BaseException as err:  # surfaced by the assertions below
            errors.append(err)

    # A daemon: a failed assertion below must not leave the run holding pytest open.
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 240
    victim = None
    while time.monotonic() < deadline and not errors and victim is None:
        metrics = out / METRICS
        if metrics.exists() and metrics.read_bytes().count(b"\n") >= 1:
            victim = ray.get_actor("rollout-0", namespace=NAMESPACE)
        time.sleep(0.1)
    assert not errors, errors
    assert victim is not None, "the run never trained a step"
    ray.get(victim.__ray_call__.remote(kill_engine_when_version_arrives, KILL_AT), timeout=60)
    thread.join(timeout=400)
    assert not thread.is_alive()
    assert not errors, errors
    (summary,) = result
    return summary


def test_an_engine_killed_mid_broadcast_is_replaced_and_the_others_get_the_version(
    tiny_model_dir: Path, tmp_path: Path, ray_shutdown: None
) -> None:
    out = tmp_path / "run"
    summary = run_with_a_kill(tiny_model_dir, out)
    assert summary.steps == summary.final_version == STEPS
    assert summary.restarts == summary.failures["worker_restarts"] == 1

    # Nothing lost, nothing trained twice.
    entries = read_ledger(out)
    trained = [e.prompt_id for e in entries if e.event == "trained"]
    assert len(trained) == len(set(trained)) == STEPS * 4

    # Which version each rollout worker loaded whole, per the broadcasts' timings.
    rows = [msgspec.json.decode(line) for line in (out / METRICS).read_bytes().splitlines()]
    assert len(rows) == STEPS
    loaded: dict[int, set[int]] = {0: set(), 1: set()}
    for row in rows:
        for timing in row["broadcast"]:
            loaded[timing["rollout_rank"]].add(timing["version"])
    # The survivor took the version the victim died in (a retry over a group without
    # the dead engine, in the same delivery), and every later one (a row holds the
    # timings of the deliveries done when it is written: the last versions' are in none).
    assert KILL_AT in loaded[1] and KILL_AT not in loaded[0]
    assert set(range(KILL_AT, max(loaded[1]) + 1)) <= loaded[1]
    assert max(loaded[1]) >= STEPS - 2

    # No engine generated from a version it had not loaded whole: every generate span's
    # version is the engine's first (0, or the replacement's start), one it loaded, or
    # the last one.
    spans = [s for s in read_spans(out) if s.role == "rollout" and s.cause == "generate"]
    assert spans
    by_worker: dict[str, set[int]] = {}
    for span in spans:
        by_worker.setdefault(span.worker, set()).add(span.version)
    # (The killed worker's own spans die with it: it is killed before they are read.)
    assert "rollout-1" in by_worker and set(by_worker) <= {"rollout-0", "rollout-1"}
    after_rows = set(range(max(loaded[1]) + 1, STEPS + 1))  # delivered, in no row
    assert by_worker["rollout-1"] <= {0} | loaded[1] | after_rows
    started_at = by_worker.get("rollout-0", set()) - loaded[0] - {0} - after_rows
    assert len(started_at) <= 1  # the replacement's own start, at most
