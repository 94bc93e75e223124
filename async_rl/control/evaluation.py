"""Held-out evaluation over a run: when to evaluate, what each result is charged against,
and time-to-target.

Owns: the schedule of evaluations during training (``EvalSchedule``) and the hand-off of
due ones to the evaluation loop, the training progress (wall time,
samples, groups, tokens) at which each policy version was produced, turning a rollout
worker's ``EvalResult`` into an ``EvalPoint`` (a line of eval.jsonl), and the first point
at a target accuracy. Knows nothing about Ray, engines or files: the controller runs the
evaluations, passes the clock in and writes the rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import anyio

from async_rl.config import RunConfig
from async_rl.control.protocols import PolicyWeights
from async_rl.run.summary import EvalPoint
from buffers.common.reports import EvalResult


class EvalSchedule:
    """Which policy versions to evaluate while training runs.

    An evaluation is due every ``every`` optimizer steps. It is asked for when a version
    at or past the due step can be evaluated: once delivered to the rollout workers (so
    the engine already runs it; with weights.sync_every > 1 the due version itself may
    never be), or once trained (run.eval_on = "idle_cpu" scores the trainer's weights).
    The last step is left to the end-of-run evaluation; ``every == 0``: none.
    """

    def __init__(self, every: int, num_steps: int) -> None:
        self.every, self.num_steps = every, num_steps
        self.next_due = every

    def due(self, version: int) -> int | None:
        """The step whose evaluation ``version`` stands for, or None.

        Versions are asked about in increasing order; a version past several due steps
        stands for the latest of them (one evaluation, not a burst of identical ones).
        """
        if not self.every or version < self.next_due or version >= self.num_steps:
            return None
        step = version // self.every * self.every
        self.next_due = step + self.every
        return step


def planned_steps(every: int, num_steps: int, sync_every: int = 1) -> list[int]:
    """The ``step`` of every evaluation a run makes, start and end included (eval on)."""
    schedule = EvalSchedule(every, num_steps)
    during = [schedule.due(v) for v in range(sync_every, num_steps + 1, sync_every)]
    return [0, *(step for step in during if step is not None), num_steps]


def describe(point: EvalPoint) -> str:
    """The console line of one evaluation."""
    mixed = f"-{point.version}" if point.version_min != point.version else ""
    return (f"eval accuracy at version {point.version_min}{mixed}: {point.accuracy:.3f} "
            f"(step {point.step}, {point.wall_s:.1f}s and {point.samples_trained} samples "
            "into training)")


def first_at_target(points: Sequence[EvalPoint], target: float) -> EvalPoint | None:
    """The earliest evaluation (by wall_s) whose accuracy reached ``target``."""
    reached = [p for p in points if p.accuracy >= target]
    return min(reached, key=lambda p: (p.wall_s, p.version), default=None)


class EvalLog:
    """A run's evaluation points and the training progress they are charged against.

    ``restore`` on resume, ``start`` when training starts, ``produced`` after every
    optimizer step, ``due`` and ``queue`` when a version can be evaluated, ``record`` for
    every finished evaluation (times come from the same monotonic clock). ``due_steps``
    yields the (step, weights) of each evaluation that fell due, until
    ``training_ended``.
    """

    @classmethod
    def from_config(cls, run: RunConfig) -> EvalLog:
        """Evaluations every run.eval_every of run.num_steps steps."""
        return cls(every=run.eval_every, num_steps=run.num_steps)

    def __init__(self, *, every: int, num_steps: int) -> None:
        self.schedule = EvalSchedule(every, num_steps)
        self.points: list[EvalPoint] = []
        # Unbounded: a weight delivery never waits on an evaluation; a slow evaluation
        # only delays the next (each then scores the version the engine has by then).
        self._due_in, self.due_steps = anyio.create_memory_object_stream[
            tuple[int, PolicyWeights | None]](math.inf)
        self.started = 0.0
        """perf_counter() when training started (earlier by the time a resumed run had)."""
        # version -> (wall_s, samples, groups, tokens) when it was produced; the initial
        # weights exist before training starts.
        self._produced: dict[int, tuple[float, int, int, int]] = {0: (0.0, 0, 0, 0)}

    def start(self, now: float) -> None:
        self.started = now

    def produced(self, version: int, now: float, *, samples: int, groups: int,
                 tokens: int) -> None:
        """Training produced ``version`` at ``now``, having trained these totals."""
        self._produced[version] = (now - self.started, samples, groups, tokens)

    def restore(self, points: Sequence[EvalPoint], version: int, wall_s: float, *,
                samples: int, groups: int, tokens: int) -> None:
        """A checkpoint's evaluation points, and its ``version`` as produced ``wall_s``
        into training with these totals (what a resumed run's evaluations are charged
        from; the initial weights, version 0, stay charged with nothing)."""
        self.points.extend(points)
        if version > 0:
            self._produced[version] = (wall_s, samples, groups, tokens)

    def due(self, version: int) -> int | None:
        """The step whose evaluation ``version`` stands for, or None (``EvalSchedule``):
        asked once per version, in order, when it can be evaluated."""
        return self.schedule.due(version)

    def queue(self, step: int, weights: PolicyWeights | None = None) -> None:
        """Hands a due evaluation to ``due_steps``; ``weights``: what it is to score
        (None: whatever the rollout engine runs)."""
        self._due_in.send_nowait((step, weights))

    def training_ended(self) -> None:
        """No evaluation falls due any more; ``due_steps`` ends after those queued."""
        self._due_in.close()

    def record(self, step: int, result: EvalResult) -> EvalPoint:
        """The row of a finished evaluation, charged at the newest version it scored
        (a mixed-version evaluation is not credited with fewer samples than it saw)."""
        known = max(v for v in self._produced if v <= result.version_max)
        wall_s, samples, groups, tokens = self._produced[known]
        point = EvalPoint(
            step=step, version=result.version_max, version_min=result.version_min,
            accuracy=result.accuracy, wall_s=wall_s, samples_trained=samples,
            groups_trained=groups, tokens_trained=tokens, eval_s=result.seconds,
            num_prompts=result.num_prompts,
        )
        self.points.append(point)
        return point
