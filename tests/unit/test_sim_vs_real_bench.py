"""bench/simulator/sim_vs_real.py without training: the order its repeats are trained in, and the
mean of repeated runs' figures a prediction is set against."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_modules import load_script

bench = load_script("bench/simulator/sim_vs_real.py", "sim_vs_real")


def test_repeats_are_trained_in_alternate_orders(monkeypatch: pytest.MonkeyPatch) -> None:
    trained: list[tuple[str, int, int, str]] = []

    def real_run(task: str, staleness: int, workers: int, out: Path, lock: str) -> Path:
        trained.append((task, staleness, workers, out.name))
        return out

    monkeypatch.setattr(bench, "real_run", real_run)
    bench.train_all(["default", "longtail"], [Path("a"), Path("b")], "")
    assert len(trained) == 2 * 2 * len(bench.SETTINGS)
    first = [run[:3] for run in trained if run[3] == "a"]
    second = [run[:3] for run in trained if run[3] == "b"]
    assert trained[:len(first)] == [(*run, "a") for run in first]  # all of a, then b
    assert second == first[::-1]
    # Each task's calibration run comes first in the first repeat.
    assert first[0] == ("default", *bench.CALIBRATION["default"])
    assert first[len(bench.SETTINGS)] == ("longtail", *bench.CALIBRATION["longtail"])
    assert len(set(first)) == len(first)


def test_a_prediction_is_set_against_the_mean_of_its_repeats() -> None:
    one = {"groups_per_s": 10.0, "train_s": 0.4,
           "roles": {"rollout": {"idle": 0.5, "weight_sync": 0.1},
                     "trainer": {"idle": 0.2}}}
    two = {"groups_per_s": 12.0, "train_s": 0.6,
           "roles": {"rollout": {"idle": 0.3},
                     "trainer": {"idle": 0.4, "wait_data": 0.2}}}
    mean = bench.mean_figures([one, two])
    assert mean["groups_per_s"] == pytest.approx(11.0)
    assert mean["train_s"] == pytest.approx(0.5)
    assert mean["spread"] == pytest.approx(0.2)
    # A cause one repeat lacks counts as 0 in it.
    assert mean["roles"]["rollout"] == pytest.approx({"idle": 0.4, "weight_sync": 0.05})
    assert mean["roles"]["trainer"] == pytest.approx({"idle": 0.3, "wait_data": 0.1})
