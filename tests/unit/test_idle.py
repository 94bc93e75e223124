"""Spans and idle accounting: recorder tiling, cause resolution, the wall-time invariant."""

from __future__ import annotations

import itertools
import random

import pytest

from async_rl.analysis.idle import (
    ROLLOUT_TRACK,
    TRAINER_TRACK,
    breakdown,
    by_role,
    hint,
    resolve,
    step_windows,
)
from workers.common.spans import Span, SpanRecorder


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def recorder(clock: FakeClock, worker: str, role: str) -> SpanRecorder:
    return SpanRecorder(worker=worker, role=role, rank=0, device="cpu:0", clock=clock)


def test_recorder_tiles_time_without_gaps() -> None:
    clock = FakeClock()
    rec = recorder(clock, "rollout-0", "rollout")
    for cause, dt in [("generate", 1.0), ("idle", 0.5), ("generate", 2.0), ("weight_sync", 0.25)]:
        rec.switch(cause)
        clock.now += dt
    spans = rec.flush()
    # The recorder's initial zero-length "idle" is not kept.
    assert [s.cause for s in spans] == ["generate", "idle", "generate", "weight_sync"]
    assert spans[0].start == 100.0
    for a, b in itertools.pairwise(spans):
        assert a.end == b.start
    assert spans[-1].end == clock.now


def test_recorder_ignores_repeated_state_and_can_be_off() -> None:
    clock = FakeClock()
    rec = recorder(clock, "trainer-0", "trainer")
    rec.switch("forward")
    clock.now += 1
    rec.switch("forward")
    clock.now += 1
    assert len(rec.flush()) == 1
    off = SpanRecorder(worker="w", role="trainer", rank=0, device="cpu:0", clock=clock,
                       enabled=False)
    off.switch("forward")
    clock.now += 1
    assert off.flush() == []


def span(worker: str, role: str, cause: str, start: float, end: float, version: int = 0) -> Span:
    return Span(worker=worker, role=role, rank=0, device="cpu:0", cause=cause, start=start,
                end=end, version=version)


def test_idle_resolves_against_the_controller_track() -> None:
    worker = [span("rollout-0", "rollout", "generate", 0, 2),
              span("rollout-0", "rollout", "idle", 2, 6)]
    controller = [span(ROLLOUT_TRACK, "controller", "gate_closed", 3, 4),
                  span(ROLLOUT_TRACK, "controller", "queue_full", 4, 5),
                  span(TRAINER_TRACK, "controller", "wait_data", 2, 6)]
    got = [(s.cause, s.start, s.end) for s in resolve(worker, controller)]
    assert got == [("generate", 0, 2), ("no_work", 2, 3), ("gate_closed", 3, 4),
                   ("queue_full", 4, 5), ("no_work", 5, 6)]


def test_breakdown_adds_up_to_wall_time_on_random_timelines() -> None:
    rng = random.Random(7)
    causes = {"rollout": ["generate", "idle", "weight_sync"],
              "trainer": ["forward", "backward", "optimizer", "idle", "barrier"]}
    spans: list[Span] = []
    controller: list[Span] = []
    for role in ("rollout", "trainer"):
        for rank in range(2):
            t = rng.uniform(0, 2)  # workers start late: the gap must count as idle
            while t < 50:
                dt = rng.expovariate(2.0)
                spans.append(span(f"{role}-{rank}", role, rng.choice(causes[role]), t, t + dt))
                t += dt
    t = 0.0
    while t < 60:
        dt = rng.expovariate(1.0)
        controller.append(span(ROLLOUT_TRACK, "controller",
                               rng.choice(["gate_closed", "queue_full", "admitting"]), t, t + dt))
        controller.append(span(TRAINER_TRACK, "controller",
                               rng.choice(["wait_data", "weight_publish", "training"]), t, t + dt))
        t += dt
    resolved = resolve(spans, controller)
    items = breakdown(resolved, 1.0, 45.0)
    assert len(items) == 4
    for item in items:
        assert item.busy_s + item.idle_s == pytest.approx(item.wall_s, rel=0.01)
        assert "idle" not in item.idle_by_cause
    roles = by_role(items)
    assert [r.role for r in roles] == ["rollout", "trainer"]
    for role in roles:
        assert role.busy_s + role.idle_s == pytest.approx(role.wall_s, rel=0.01)


def test_top_cause_has_a_hint() -> None:
    spans = [span("trainer-0", "trainer", "forward", 0, 1),
             span("trainer-0", "trainer", "wait_data", 1, 9)]
    (item,) = breakdown(spans, 0, 10)
    assert item.top_cause == "wait_data"
    assert item.idle_fraction == pytest.approx(0.9)
    assert "add rollout workers" in hint(item)


@pytest.mark.parametrize(("wire", "load", "dominant"), [
    (6, 2, "on the wire dominates"), (1, 5, "loading into the engines dominates")])
def test_a_weight_update_pause_is_split_by_phase_and_the_hint_names_the_dominant_one(
        wire: float, load: float, dominant: str) -> None:
    spans = [span("rollout-0", "rollout", "generate", 0, 1),
             span("rollout-0", "rollout", "weight_sync", 1, 2),
             span("rollout-0", "rollout", "weight_wire", 2, 2 + wire),
             span("rollout-0", "rollout", "weight_load", 2 + wire, 2 + wire + load)]
    (item,) = breakdown(spans, 0, 2 + wire + load)
    assert item.idle_by_cause["weight_wire"] == pytest.approx(wire)
    assert item.idle_by_cause["weight_load"] == pytest.approx(load)
    text = hint(item)
    total = 1 + wire + load
    assert f"{100 * 1 / total:.0f}% waiting on the broadcast" in text
    assert f"{100 * wire / total:.0f}% on the wire" in text
    assert f"{100 * load / total:.0f}% loading into the engines" in text
    assert dominant in text


def test_a_weight_hint_over_no_pause_is_empty() -> None:
    from async_rl.analysis.idle import weight_hint

    assert weight_hint({}) == weight_hint({"weight_wire": 0.0}) == ""


def test_step_windows_follow_the_training_track() -> None:
    controller = [span(TRAINER_TRACK, "controller", "wait_data", 0, 1, version=0),
                  span(TRAINER_TRACK, "controller", "training", 1, 3, version=0),
                  span(TRAINER_TRACK, "controller", "wait_data", 3, 4, version=1),
                  span(TRAINER_TRACK, "controller", "training", 4, 7, version=1)]
    assert step_windows(controller) == [(1, 0, 3), (2, 3, 7)]
