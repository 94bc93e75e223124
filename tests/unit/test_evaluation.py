"""Periodic evaluation: the schedule, what a result is charged against, time-to-target,
and the eval.jsonl / summary.json round trip. No Ray, no model."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import pytest

from async_rl.config_io import decode_config
from async_rl.control.evaluation import (
    EvalLog,
    EvalSchedule,
    describe,
    first_at_target,
    planned_steps,
)
from async_rl.control.protocols import PolicyWeights
from async_rl.control.step_metrics import StepTotals
from async_rl.run.run_dir import EVALS, SUMMARY, RunWriter, read_evals, read_summary
from async_rl.run.summary import EvalPoint
from buffers.common.reports import EvalResult


class Weights(msgspec.Struct, frozen=True):
    """A stand-in for a version's weights (the shell's reference)."""

    version: int


def result(accuracy: float, version: int, version_min: int | None = None) -> EvalResult:
    return EvalResult(accuracy=accuracy, version_max=version,
                      version_min=version if version_min is None else version_min,
                      num_prompts=10, rollout_rank=0, seconds=0.5)


def point(accuracy: float, wall_s: float, samples: int, version: int = 1) -> EvalPoint:
    return EvalPoint(step=version, version=version, version_min=version, accuracy=accuracy,
                     wall_s=wall_s, samples_trained=samples, groups_trained=samples // 4,
                     tokens_trained=samples * 10, eval_s=0.1, num_prompts=10)


@pytest.mark.parametrize(
    ("every", "num_steps", "sync_every", "steps"),
    [
        (0, 6, 1, [0, 6]),  # off: start and end only
        (2, 6, 1, [0, 2, 4, 6]),  # the last step is the end evaluation's
        (4, 6, 1, [0, 4, 6]),
        (10, 6, 1, [0, 6]),
        (3, 12, 2, [0, 3, 6, 9, 12]),  # due 3 is met by delivered 4, due 9 by 10
        (1, 6, 2, [0, 2, 4, 6]),  # one evaluation per delivery, not a burst
        (1, 5, 1, [0, 1, 2, 3, 4, 5]),
    ],
)
def test_planned_steps(every: int, num_steps: int, sync_every: int, steps: list[int]) -> None:
    assert planned_steps(every, num_steps, sync_every) == steps


def test_schedule_skips_versions_before_the_due_step() -> None:
    schedule = EvalSchedule(every=3, num_steps=100)
    assert [schedule.due(v) for v in (1, 2, 3, 4, 5, 7, 8, 9)] == [
        None, None, 3, None, None, 6, None, 9]


def test_log_charges_the_newest_scored_version() -> None:
    log = EvalLog(every=2, num_steps=6)
    log.start(100.0)
    log.produced(1, 101.0, samples=8, groups=2, tokens=80)
    log.produced(2, 102.5, samples=16, groups=4, tokens=170)
    start = log.record(0, result(0.25, 0))
    assert (start.wall_s, start.samples_trained, start.version) == (0.0, 0, 0)
    mixed = log.record(2, result(0.5, 2, version_min=1))
    assert (mixed.version_min, mixed.version) == (1, 2)
    assert (mixed.wall_s, mixed.samples_trained, mixed.groups_trained,
            mixed.tokens_trained) == (2.5, 16, 4, 170)
    assert mixed.eval_s == 0.5 and mixed.num_prompts == 10 and mixed.step == 2
    assert log.points == [start, mixed]
    assert "version 1-2: 0.500" in describe(mixed) and "step 2" in describe(mixed)


def test_restored_log_charges_from_the_checkpoints_version() -> None:
    saved = point(0.25, 3.0, 8, version=2)
    log = EvalLog(every=2, num_steps=6)
    log.restore([saved], 2, 40.0, samples=16, groups=4, tokens=170)
    log.start(500.0 - 40.0)  # the resumed clock, earlier by the 40 s already trained
    assert log.points == [saved]
    resumed = log.record(3, result(0.5, 2))  # scored the checkpoint's own weights
    assert (resumed.wall_s, resumed.samples_trained, resumed.groups_trained,
            resumed.tokens_trained) == (40.0, 16, 4, 170)
    log.produced(3, 512.5, samples=24, groups=6, tokens=250)
    later = log.record(4, result(0.75, 3))
    assert (later.wall_s, later.samples_trained) == (52.5, 24)
    assert log.points == [saved, resumed, later]


def test_restored_log_at_version_zero_keeps_the_initial_weights_uncharged() -> None:
    log = EvalLog(every=2, num_steps=6)
    log.restore([], 0, 7.0, samples=0, groups=0, tokens=0)  # stopped before a step
    start = log.record(0, result(0.25, 0))
    assert (start.wall_s, start.samples_trained, start.version) == (0.0, 0, 0)
    assert log.points == [start]


def test_log_hands_due_steps_to_the_evaluation_loop() -> None:
    log = EvalLog(every=2, num_steps=6)
    for version in range(1, 7):
        if (step := log.due(version)) is not None:
            log.queue(step, Weights(version))
    log.training_ended()

    async def collect() -> list[tuple[int, PolicyWeights | None]]:
        async with log.due_steps:
            return [due async for due in log.due_steps]

    assert anyio.run(collect) == [(2, Weights(2)), (4, Weights(4))]


def test_first_at_target() -> None:
    points = [point(0.3, 0.0, 0), point(0.85, 5.0, 40), point(0.8, 3.0, 24),
              point(0.9, 8.0, 64)]
    reached = first_at_target(points, 0.8)
    assert reached is not None and (reached.wall_s, reached.samples_trained) == (3.0, 24)
    assert first_at_target(points, 0.95) is None
    assert first_at_target([], 0.5) is None
    at_start = first_at_target(points, 0.3)
    assert at_start is not None and at_start.wall_s == 0.0


def test_summary_and_eval_file_round_trip(tmp_path: Path) -> None:
    config = decode_config({"model": {"path": "m"},
                            "run": {"output_dir": str(tmp_path), "target_accuracy": 0.8}})
    writer = RunWriter(tmp_path, config)
    points = [point(0.3, 0.0, 0, version=0), point(0.82, 2.0, 16, version=2),
              point(0.9, 4.1, 32, version=4)]
    for p in points:
        writer.eval(p)
    totals = StepTotals()
    totals.samples_trained = 32
    summary = totals.summary(wall_s=4.2, final_version=4, accuracy_start=0.3,
                             accuracy_end=0.9, max_staleness=1, rollout_version=4,
                             evals=points, target_accuracy=config.run.target_accuracy)
    writer.summary(summary)
    writer.close()
    assert read_evals(tmp_path) == points
    assert len((tmp_path / EVALS).read_bytes().splitlines()) == 3
    again = read_summary(tmp_path)
    assert again == summary
    assert (again.time_to_target_s, again.samples_to_target) == (2.0, 16)
    assert again.evals == tuple(points) and again.samples_trained == 32
    assert again.target_accuracy == 0.8


def test_summary_never_reaching_the_target() -> None:
    summary = StepTotals().summary(wall_s=1.0, final_version=1, accuracy_start=0.1,
                                   accuracy_end=0.2, max_staleness=0, rollout_version=1,
                                   evals=[point(0.2, 1.0, 8)], target_accuracy=0.5)
    assert summary.time_to_target_s is None and summary.samples_to_target is None


def test_summary_written_before_periodic_evaluation_still_reads(tmp_path: Path) -> None:
    old = {"steps": 2, "final_version": 2, "rollout_version": 2, "wall_s": 1.0,
           "groups_trained": 8, "tokens_trained": 80, "groups_per_s": 8.0,
           "tokens_per_s": 80.0, "accuracy_start": 0.1, "accuracy_end": 0.2,
           "staleness_histogram": [8], "dropped_stale": 0, "rollout_failures": 0,
           "reward_failures": 0, "nonfinite_steps": 0, "retired_workers": 0,
           "max_staleness": 1}
    (tmp_path / SUMMARY).write_bytes(msgspec.json.encode(old))
    summary = read_summary(tmp_path)
    assert summary.evals == () and summary.time_to_target_s is None


def test_rollout_span_is_evaluate_only_while_nothing_but_evaluation_runs() -> None:
    from workers.model_config import ModelConfig
    from workers.rollout.config import RolloutConfig
    from workers.rollout.spec import RolloutSpec
    from workers.rollout.task import WorkerTask
    from workers.rollout.worker import RolloutWorker
    from workers.weights.config import WeightsConfig

    spec = RolloutSpec(rank=0, model=ModelConfig(path="m"), rollout=RolloutConfig(),
                       weights=WeightsConfig())
    worker = RolloutWorker(spec, WorkerTask(reward_fn=lambda prompt, text: 0.0))
    causes = []
    for running, evaluating in [(1, 1), (3, 1), (2, 0), (0, 0)]:
        worker._requests.in_flight = {f"r{i}": 0 for i in range(running)}
        worker._requests._evaluating = evaluating
        worker._requests.switch_span()
        causes.append(worker._spans.cause)
    assert causes == ["evaluate", "generate", "generate", "idle"]


def test_report_prints_time_to_target(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    from async_rl.analysis.report import print_report
    from async_rl.run.run_dir import SPANS
    from workers.common.spans import Span

    run = tmp_path / "run"
    run.mkdir()
    spans = [Span(worker=w, role=role, rank=0, device="cpu:0", cause=cause, start=0.0,
                  end=3.0, version=0)
             for w, role, cause in [("rollout-0", "rollout", "evaluate"),
                                    ("trainer-0", "trainer", "forward")]]
    (run / SPANS).write_bytes(b"".join(msgspec.json.encode(x) + b"\n" for x in spans))
    points = [point(0.3, 0.0, 0, version=0), point(0.9, 2.0, 16, version=2)]
    summary = StepTotals().summary(wall_s=3.0, final_version=2, accuracy_start=0.3,
                                   accuracy_end=0.9, max_staleness=1, rollout_version=2,
                                   evals=points, target_accuracy=0.8)
    (run / SUMMARY).write_bytes(msgspec.json.encode(summary))
    print_report(run)
    assert "accuracy 0.8 reached after 2.0s, 16 samples trained (2 evaluations" in (
        capsys.readouterr().out)
