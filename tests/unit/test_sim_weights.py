"""The simulator's weight path, as a real engine's spans show it: a version's pause is
split into the wait on the group (weight_sync), the bytes arriving (weight_wire) and the
load (weight_load); the collective begins once every engine has paused (no Ray, no
model: the model's size is given)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import msgspec
import pytest

from async_rl.analysis.report import read_spans
from async_rl.api import simulate
from async_rl.config import Config
from async_rl.run.run_dir import read_metrics
from async_rl.sim.run import simulation_costs

SIZE = {"parameters": 4.0e6, "kv_bytes_per_token": 4096, "lengths": "lognormal",
        "length_median": 30.0, "length_sigma": 0.8, "hardware": "cpu"}


def config(out: Path, *, workers: int, mode: str = "in_flight", colocate: object = False,
           shards: int = 1, **overrides: object) -> Config:
    return msgspec.convert({
        "model": {"path": "not-needed"},
        "task": {"kind": "longtail", "eval_size": 0},
        "rollout": {"num_workers": workers, "group_size": 4, "max_new_tokens": 128,
                    "max_inflight_prompts": 8},
        "queue": {"max_groups": 32, "bucket_edges": [128, 512]},
        "staleness": {"max_staleness": 0 if colocate else 1},
        "trainer": {"num_shards": shards, "groups_per_step": 8, "micro_batch_tokens": 512},
        "weights": {"update_mode": mode},
        "run": {"num_steps": 8, "output_dir": str(out), "progress": False,
                "eval_every": 0, "colocate": colocate},
        "simulate": {**SIZE, "hardware_overrides": overrides},
    }, Config)


def _phases(run_dir: Path) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Per rollout worker, per weight cause, its spans' (start, end)."""
    phases: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(
        lambda: defaultdict(list))
    for span in read_spans(run_dir):
        if span.role == "rollout" and span.cause.startswith("weight_"):
            phases[span.worker][span.cause].append((span.start, span.end))
    return phases


@pytest.mark.parametrize("workers", [1, 3])
def test_a_versions_pause_is_split_into_wire_and_load_as_a_real_engines(
        tmp_path: Path, workers: int) -> None:
    simulate(config(tmp_path, workers=workers, weight_load_s=0.05))
    rows = read_metrics(tmp_path)
    timings = [t for row in rows for t in row["broadcast"]]
    assert len(timings) >= workers * (len(rows) - 1)
    wire = float(timings[0]["transfer_s"])
    assert wire > 0
    for timing in timings:
        assert float(timing["transfer_s"]) == pytest.approx(wire)
        assert float(timing["load_s"]) >= 0.05 - 1e-9  # the load, and any wait after
    phases = _phases(tmp_path)
    assert len(phases) == workers
    for causes in phases.values():
        assert causes["weight_wire"] and causes["weight_load"]
        assert all(end - start == pytest.approx(wire) for start, end in causes["weight_wire"])
        assert all(end - start == pytest.approx(0.05) for start, end in causes["weight_load"])


def test_the_collective_begins_once_the_slowest_engine_has_drained(tmp_path: Path) -> None:
    """Drain updates: an engine that drained first stands paused on the group
    (weight_sync) until the last one has; every engine's wire starts together."""
    simulate(config(tmp_path, workers=3, mode="drain"))
    phases = _phases(tmp_path)
    starts = [sorted(s for s, _ in causes["weight_wire"]) for causes in phases.values()]
    assert len(starts) == 3 and len(starts[0]) >= 4
    for version_starts in zip(*starts, strict=False):
        assert max(version_starts) - min(version_starts) == pytest.approx(0.0, abs=1e-9)
    waited = sum(end - start for causes in phases.values()
                 for start, end in causes["weight_sync"])
    assert waited > 0  # three engines never drain at the same moment


def test_one_engine_never_waits_on_a_group(tmp_path: Path) -> None:
    simulate(config(tmp_path, workers=1, mode="drain"))
    (causes,) = _phases(tmp_path).values()
    assert causes["weight_wire"]
    assert sum(end - start for start, end in causes["weight_sync"]) == pytest.approx(0.0)


def test_time_shared_devices_send_no_bytes_and_load_nothing_over_the_wire(
        tmp_path: Path) -> None:
    simulate(config(tmp_path, workers=2, shards=2, colocate="time"))
    assert not any(causes["weight_wire"] for causes in _phases(tmp_path).values())
    timings = [t for row in read_metrics(tmp_path)
               for t in row["broadcast"]]
    assert timings and all(float(t["transfer_s"]) == 0.0 for t in timings)


def test_a_free_wire_and_no_load_still_move_every_version(tmp_path: Path) -> None:
    """A link too fast to cost anything and no load pause: every version still reaches
    the engines, with no load span and wire spans of no length."""
    simulate(config(tmp_path, workers=2, weight_load_s=0.0, interconnect_bandwidth=1e30))
    phases = _phases(tmp_path)
    assert len(phases) == 2
    for causes in phases.values():
        assert not causes["weight_load"]
        assert all(end - start < 1e-9 for start, end in causes["weight_wire"])
    assert read_metrics(tmp_path)[-1]["version"] == 8


@pytest.mark.parametrize("workers", [1, 4])
def test_the_engine_bench_reads_a_versions_wire_and_causes_per_engine(
        tmp_path: Path, workers: int) -> None:
    """bench/simulator/sim_weight_engines.py's figures of a simulated run: the wire is the
    formula's, and each engine's weight_wire spans add up to it once a version."""
    from script_modules import load_script

    bench = load_script("bench/simulator/sim_weight_engines.py", "sim_weight_engines")
    cfg = config(tmp_path, workers=workers, weight_load_s=0.02)
    simulate(cfg)
    costs = simulation_costs(cfg)
    wire = bench.formula(costs, workers, cfg.weights.bucket_mb << 20)
    figures = bench.per_version(tmp_path)
    assert figures["wire"] == pytest.approx(wire)
    # The load, and with several engines the wait for the others to pause, as a real
    # engine's load_s counts it.
    assert figures["load"] >= 0.02 - 1e-9
    if workers == 1:
        assert figures["load"] == pytest.approx(0.02, abs=1e-6)
    # The last version may still be on the wire when the run ends: within one version.
    versions = len({int(t["version"]) for row in read_metrics(tmp_path)
                    for t in row["broadcast"]})
    assert versions >= 6
    assert figures["weight_wire"] == pytest.approx(wire, rel=1.0 / versions + 1e-6)
    assert figures["weight_sync"] < wire
