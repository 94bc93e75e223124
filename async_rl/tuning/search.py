"""The search over the tunable keys' ranges, judged by an evaluator (the simulator).

Owns: ``search`` (from the config, moves the top idle cause asks for, one ladder rung at
a time, kept while they gain; then coordinate descent over each key's ladder, kept
where the predicted groups/s is best; stopped by a budget of evaluations or seconds),
what each idle cause asks to turn (``MOVES``), the words that say why a key moved
(``reason``), and the ranked result (``Candidate``, ``SearchResult``). Deterministic: no
randomness of its own, and the simulator is seeded by the config. Knows nothing about
how a candidate is evaluated or where the result is written.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import msgspec

from async_rl import knobs
from async_rl.analysis.idle import HINTS, WEIGHT_PHASES
from async_rl.config import Config
from async_rl.knobs import SPLIT, Range, Value
from async_rl.tuning.simulated import Evaluation
from buffers.common.config import ConfigError

Evaluator = Callable[[Config], Evaluation]

MIN_GAIN = 0.01
"""A move is kept when it predicts at least this much more groups/s: below it, the
simulator's own noise between neighbouring settings."""
PATIENCE = 2
"""Coordinate descent walks on past this many rungs in a row that gain nothing (a
plateau before a knee), no further."""
MIN_SHARE = 0.02
"""Idle causes below this share of a role's time ask for nothing."""

_WEIGHT_MOVES = (("weights.sync_every", 1), ("weights.update_mode", -1))
MOVES: dict[tuple[str, str], tuple[tuple[str, int], ...]] = {
    ("trainer", "wait_data"): (("rollout.max_inflight_prompts", 1), (SPLIT, 1),
                               ("rollout.cpus_per_worker", 1),
                               ("staleness.max_staleness", 1), ("queue.max_groups", 1)),
    ("trainer", "weight_publish"): (("weights.sync_every", 1),),
    ("trainer", "barrier"): (("trainer.micro_batch_tokens", -1),),
    ("rollout", "gate_closed"): (("staleness.max_staleness", 1), (SPLIT, -1),
                                 ("trainer.cpus_per_shard", 1)),
    ("rollout", "queue_full"): (("queue.max_groups", 1), (SPLIT, -1),
                                ("trainer.cpus_per_shard", 1)),
    ("rollout", "no_work"): (("rollout.max_inflight_prompts", 1),),
    **{("rollout", phase): _WEIGHT_MOVES for phase in WEIGHT_PHASES},
}
"""What each role's idle cause asks to turn, and which way (+1: the next rung up the
key's ladder; for weights.update_mode, -1 is towards in_flight): the advice of
``async_rl.analysis.idle.HINTS`` as moves."""

Point = tuple[tuple[str, Value], ...]
"""A value for every searched key, in the ranges' order."""


def reason(role: str, cause: str, share: float) -> str:
    """``trainer waits for data 89% of its time``: an idle cause in words."""
    if cause in WEIGHT_PHASES:
        what = f"{role} pauses for weight updates ({WEIGHT_PHASES[cause][0]})"
    else:
        what = HINTS.get((role, cause), f"{role} {cause}").partition(":")[0]
    return f"{what} {100 * share:.0f}% of its time"


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """A setting the search evaluated."""

    values: dict[str, Value]
    """The keys it changes from the config, with their new values."""
    groups_per_s: float
    """Predicted."""
    reasons: dict[str, str]
    """Per changed key: the idle cause that moved it, in words, and at which values."""
    evaluation: Evaluation


class SearchResult(msgspec.Struct, frozen=True, kw_only=True):
    base: Candidate
    """The config itself (no changes)."""
    ranked: tuple[Candidate, ...]
    """The best few settings that beat the config, best first (empty when none did),
    leaving out those with changes that buy nothing over a candidate without them."""
    evaluated: int
    failed: int
    """Settings the config's rules refused (validation), or whose run failed."""
    failures: tuple[str, ...] = ()
    """Each failed run's settings and first line of its error."""
    seconds: float
    stopped: str
    """Why the search ended: "converged", "evaluations" or "seconds"."""


class _OutOfBudget(Exception):
    pass


@dataclass
class _Search:
    config: Config
    ranges: Mapping[str, Range]
    evaluate: Evaluator
    max_evaluations: int
    deadline: float
    clock: Callable[[], float]
    ladders: dict[str, list[Value]] = field(default_factory=dict)
    seen: dict[Point, Candidate | None] = field(default_factory=dict)
    base_values: dict[str, Value] = field(default_factory=dict)
    spent: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    stopped: str = "converged"

    def __post_init__(self) -> None:
        for key, span in self.ranges.items():
            current = knobs.value_of(self.config, key)
            self.base_values[key] = current
            self.ladders[key] = knobs.ladder(key, span, current)

    def start(self) -> Point:
        """The config's values, each moved to its ladder's nearest rung when its range
        leaves it out."""
        return tuple((key, _nearest(self.ladders[key], self.base_values[key]))
                     for key in self.ranges)

    def evaluate_point(self, point: Point, parent: Candidate | None, moved: str,
                       why: str) -> Candidate | None:
        """The point's candidate (evaluated once; None when the config's rules refuse
        it); raises _OutOfBudget when the budget leaves no room for it."""
        if point in self.seen:
            return self.seen[point]
        values = {key: value for key, value in point if value != self.base_values[key]}
        try:
            config = knobs.with_values(self.config, values)
        except ConfigError:
            self.seen[point] = None
            return None
        typical = max(self.spent, default=0.0)
        if (len(self.spent) >= self.max_evaluations
                or self.clock() + typical > self.deadline):
            self.stopped = ("evaluations" if len(self.spent) >= self.max_evaluations
                            else "seconds")
            raise _OutOfBudget
        began = self.clock()
        try:
            evaluation = self.evaluate(config)
        except Exception as err:  # a candidate's run failed (a micro-batch too small)
            self.spent.append(self.clock() - began)
            self.failures.append(f"{', '.join(f'{k} = {v}' for k, v in values.items())}: "
                                 f"{_first_line(err)}")
            self.seen[point] = None
            return None
        self.spent.append(self.clock() - began)
        reasons = {key: text for key, text in (parent.reasons if parent else {}).items()
                   if key in values}
        if moved in values:
            reasons[moved] = why
        candidate = Candidate(values=values, groups_per_s=evaluation.groups_per_s,
                              reasons=reasons, evaluation=evaluation)
        self.seen[point] = candidate
        return candidate

    def guided(self, point: Point, best: Candidate) -> tuple[Point, Candidate]:
        """Moves the top idle causes ask for, kept while each gains."""
        while (found := self.first_gain(point, best)) is not None:
            point, best = found
        return point, best

    def first_gain(self, point: Point, best: Candidate) -> tuple[Point, Candidate] | None:
        """The first move the idle causes ask for, the largest cause first, that gains."""
        for role, cause, share in best.evaluation.causes():
            if share < MIN_SHARE:
                return None
            for key, direction in MOVES.get((role, cause), ()):
                moved = self.step(point, key, direction)
                if moved is None:
                    continue
                why = f"{reason(role, cause, share)} at {_shown(point, key)}"
                found = self.evaluate_point(moved, best, key, why)
                if found and found.groups_per_s > best.groups_per_s * (1 + MIN_GAIN):
                    return moved, found
        return None

    def descend(self, point: Point, best: Candidate) -> tuple[Point, Candidate]:
        """Coordinate descent: each key walked up its ladder, then down, rung by rung,
        until ``PATIENCE`` rungs in a row gain nothing; passes over every key until one
        keeps nothing."""
        improved = True
        while improved:
            improved = False
            for key in self.ranges:
                role, cause, share = (best.evaluation.causes() or [("", "", 0.0)])[0]
                why = (f"{reason(role, cause, share)} at {_shown(point, key)}" if role
                       else f"searched over {key}")
                for direction in (1, -1):
                    walked, idle = point, 0
                    while idle < PATIENCE:
                        walked_to = self.step(walked, key, direction)
                        if walked_to is None:
                            break
                        walked = walked_to
                        found = self.evaluate_point(walked, best, key, why)
                        if found and found.groups_per_s > best.groups_per_s * (1 + MIN_GAIN):
                            point, best, improved, idle = walked, found, True, 0
                        else:
                            idle += 1
        return point, best

    def step(self, point: Point, key: str, direction: int) -> Point | None:
        if key not in self.ladders:
            return None
        ladder = self.ladders[key]
        at = ladder.index(dict(point)[key]) + direction
        return _with(point, key, ladder[at]) if 0 <= at < len(ladder) else None


def _needless(candidate: Candidate, others: list[Candidate]) -> bool:
    """Another candidate makes some of the same changes, and no others, for as much
    (within ``MIN_GAIN``): the rest of this one's changes buy nothing."""
    changes = candidate.values.items()
    return any(other.values.items() < changes
               and other.groups_per_s >= candidate.groups_per_s * (1 - MIN_GAIN)
               for other in others)


def _first_line(err: BaseException) -> str:
    while isinstance(err, BaseExceptionGroup) and err.exceptions:
        err = err.exceptions[0]
    return (str(err).splitlines() or [repr(err)])[0]


def _nearest(ladder: list[Value], value: Value) -> Value:
    if value in ladder:
        return value
    if isinstance(value, str):
        return ladder[0]
    return min(ladder, key=lambda rung: abs(math.log(float(rung) or 1e-12)
                                            - math.log(float(value) or 1e-12)))


def _with(point: Point, key: str, value: Value) -> Point:
    return tuple((name, value if name == key else old) for name, old in point)


def _shown(point: Point, key: str) -> str:
    return f"{key} = {dict(point)[key]}"


def searchable(config: Config, ranges: Mapping[str, Range]) -> list[str]:
    """The keys of ``ranges`` that offer a value besides the config's own."""
    return [key for key, span in ranges.items()
            if set(knobs.ladder(key, span, current := knobs.value_of(config, key)))
            - {current}]


def search(config: Config, ranges: Mapping[str, Range], evaluate: Evaluator, *,
           max_evaluations: int = 1000, budget_s: float = math.inf, keep: int = 5,
           clock: Callable[[], float] = time.monotonic) -> SearchResult:
    """The best settings within ``ranges`` by ``evaluate``'s groups/s: guided by idle
    causes, then coordinate descent; at most ``max_evaluations`` evaluations (the
    config's own included) or ``budget_s`` seconds, whichever ends first (an evaluation
    is not started when one as long as the longest so far would pass the budget)."""
    began = clock()
    state = _Search(config, ranges, evaluate, max_evaluations, began + budget_s, clock)
    base_evaluation = evaluate(config)
    state.spent.append(clock() - began)
    base = Candidate(values={}, groups_per_s=base_evaluation.groups_per_s, reasons={},
                     evaluation=base_evaluation)
    point = state.start()
    state.seen[tuple(state.base_values.items())] = base
    try:
        best = state.evaluate_point(point, base, "", "") or base
        point, best = state.guided(point, best)
        state.descend(point, best)
    except _OutOfBudget:
        pass
    better = [found for found in state.seen.values()
              if found and found.values and found.groups_per_s > base.groups_per_s]
    ranked = sorted((found for found in better if not _needless(found, better)),
                    key=lambda found: -found.groups_per_s)
    return SearchResult(base=base, ranked=tuple(ranked[:keep]), evaluated=len(state.spent),
                        failed=sum(found is None for found in state.seen.values()),
                        failures=tuple(state.failures),
                        seconds=clock() - began, stopped=state.stopped)
