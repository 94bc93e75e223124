"""Idle accounting: resolve why workers waited, then split each device's wall time.

Owns: turning raw worker spans into resolved spans (a worker's ``idle`` stretches take
the cause the controller was waiting on at that moment) and the per-worker, per-role and
per-step breakdowns whose busy time plus idle causes add up to wall time (each in one
pass over the spans, so a run of a thousand devices and a hundred steps is accounted in
seconds), the order workers are listed in (``natural_key``: rollout-2 before
rollout-10), and the OS cross-check of a worker's busy share (``busy_fraction``). Knows
nothing about where spans come from or how they are drawn.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence

import msgspec

from buffers.common.reports import UsageReading
from workers.common.spans import BUSY, IDLE, UNRESOLVED, Span

ROLE_ORDER = ("rollout", "trainer", "critic", "reference")
"""Roles in the order tables and pictures list them (others after)."""
ROLLOUT_TRACK = "controller-admission"
"""Controller track whose causes explain rollout idleness (gate_closed, queue_full)."""
TRAINER_TRACK = "controller-training"
"""Controller track whose causes explain trainer idleness (wait_data, weight_publish,
checkpoint)."""


def resolve(worker_spans: Sequence[Span], controller_spans: Sequence[Span]) -> list[Span]:
    """Replaces each ``idle`` worker span by the controller causes overlapping it.

    Rollout workers are explained by the admission track, trainers (and the critic)
    by the training track; a stretch no explaining cause covers becomes ``no_work``.
    """
    tracks: dict[str, list[Span]] = defaultdict(list)
    for span in controller_spans:
        tracks[span.worker].append(span)
    for spans in tracks.values():
        spans.sort(key=lambda s: s.start)
    # Controller spans tile their track, so their ends are sorted too: bisect to the
    # first one that can overlap instead of scanning each track from its start.
    ends = {name: [s.end for s in spans] for name, spans in tracks.items()}
    resolved: list[Span] = []
    for span in worker_spans:
        if span.cause != UNRESOLVED:
            resolved.append(span)
            continue
        name = ROLLOUT_TRACK if span.role == "rollout" else TRAINER_TRACK
        track = tracks[name]
        allowed = IDLE.get(span.role, ())
        cursor = span.start
        first = bisect.bisect_right(ends.get(name, []), cursor)
        for explain in track[first:]:
            if explain.end <= cursor or explain.cause not in allowed:
                continue
            if explain.start >= span.end:
                break
            lo, hi = max(explain.start, cursor), min(explain.end, span.end)
            if lo > cursor:
                resolved.append(msgspec.structs.replace(span, cause="no_work", start=cursor,
                                                        end=lo))
            resolved.append(msgspec.structs.replace(span, cause=explain.cause, start=lo,
                                                    end=hi))
            cursor = hi
        if cursor < span.end:
            resolved.append(msgspec.structs.replace(span, cause="no_work", start=cursor))
    return resolved


class Breakdown(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's (or role's) wall time split into busy time and idle causes."""

    name: str
    role: str
    device: str
    wall_s: float
    busy_s: float
    idle_by_cause: dict[str, float]

    @property
    def idle_s(self) -> float:
        return sum(self.idle_by_cause.values())

    @property
    def idle_fraction(self) -> float:
        return self.idle_s / self.wall_s if self.wall_s else 0.0

    @property
    def top_cause(self) -> str:
        return max(self.idle_by_cause, key=lambda c: self.idle_by_cause[c], default="")


def _clip(spans: Iterable[Span], start: float, end: float) -> Iterable[tuple[Span, float]]:
    for span in spans:
        overlap = min(span.end, end) - max(span.start, start)
        if overlap > 0:
            yield span, overlap


def breakdown(spans: Sequence[Span], start: float, end: float) -> list[Breakdown]:
    """Per worker: busy seconds and idle seconds by cause over [start, end].

    Time of the window a worker has no span for (before it started, after it stopped)
    counts as ``no_work``, so busy + idle always equals the window's wall time.
    """
    by_worker: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        if span.role in BUSY:
            by_worker[span.worker].append(span)
    wall = end - start
    result: list[Breakdown] = []
    for name in sorted(by_worker, key=natural_key):
        worker_spans = by_worker[name]
        role = worker_spans[0].role
        busy = 0.0
        idle: dict[str, float] = dict.fromkeys(IDLE[role], 0.0)
        covered = 0.0
        for span, seconds in _clip(worker_spans, start, end):
            covered += seconds
            if span.cause in BUSY[role]:
                busy += seconds
            else:
                cause = "no_work" if span.cause == UNRESOLVED else span.cause
                idle[cause] = idle.get(cause, 0.0) + seconds
        idle["no_work"] += max(wall - covered, 0.0)
        result.append(Breakdown(name=name, role=role, device=worker_spans[0].device,
                                wall_s=wall, busy_s=busy, idle_by_cause=idle))
    return result


def natural_key(name: str) -> tuple[str, int, str]:
    """Sorts worker names as people count: rollout-2 before rollout-10."""
    match = re.fullmatch(r"(.*?)(\d+)", name)
    return (match.group(1), int(match.group(2)), name) if match else (name, -1, name)


def roles_in_windows(spans: Sequence[Span], windows: Sequence[tuple[float, float]]
                     ) -> list[list[Breakdown]]:
    """Per window (sorted, not overlapping), what ``by_role(breakdown(spans, lo, hi))``
    gives, in one pass over the spans: each span is added to the windows it overlaps
    (found by bisection), instead of every window scanning every span."""
    if not windows:
        return []
    starts = [lo for lo, _ in windows]
    count = len(windows)
    workers: dict[str, set[str]] = defaultdict(set)
    # Per window, per role: [covered seconds, busy seconds], idle seconds by cause.
    sums: list[dict[str, tuple[list[float], dict[str, float]]]] = [{} for _ in windows]
    for span in spans:
        role = span.role
        if role not in BUSY:
            continue
        workers[role].add(span.worker)
        busy = span.cause in BUSY[role]
        cause = "no_work" if span.cause == UNRESOLVED else span.cause
        start, end = span.start, span.end
        i = bisect.bisect_right(starts, start) - 1 if start > starts[0] else 0
        while i < count and windows[i][0] < end:
            lo, hi = windows[i]
            overlap = (end if end < hi else hi) - (start if start > lo else lo)
            if overlap > 0:
                per_role = sums[i]
                if role not in per_role:
                    per_role[role] = ([0.0, 0.0], dict.fromkeys(IDLE[role], 0.0))
                totals, idle = per_role[role]
                totals[0] += overlap
                if busy:
                    totals[1] += overlap
                else:
                    idle[cause] = idle.get(cause, 0.0) + overlap
            i += 1
    result = []
    for (lo, hi), per_role in zip(windows, sums, strict=True):
        roles = []
        for role in sorted(workers):
            (covered, busy_s), idle = per_role.get(role) or (
                (0.0, 0.0), dict.fromkeys(IDLE[role], 0.0))
            wall = len(workers[role]) * (hi - lo)
            idle["no_work"] = idle.get("no_work", 0.0) + max(wall - covered, 0.0)
            roles.append(Breakdown(name=role, role=role,
                                   device=f"{len(workers[role])} device(s)", wall_s=wall,
                                   busy_s=busy_s, idle_by_cause=idle))
        result.append(roles)
    return result


def by_role(per_worker: Sequence[Breakdown]) -> list[Breakdown]:
    """Sums worker breakdowns into one per role (wall time adds up across devices)."""
    roles: dict[str, list[Breakdown]] = defaultdict(list)
    for item in per_worker:
        roles[item.role].append(item)
    result = []
    for role, items in sorted(roles.items()):
        causes: dict[str, float] = defaultdict(float)
        for item in items:
            for cause, seconds in item.idle_by_cause.items():
                causes[cause] += seconds
        result.append(Breakdown(
            name=role, role=role, device=f"{len(items)} device(s)",
            wall_s=sum(i.wall_s for i in items), busy_s=sum(i.busy_s for i in items),
            idle_by_cause=dict(causes),
        ))
    return result


def step_windows(spans: Sequence[Span]) -> list[tuple[int, float, float]]:
    """(step, start, end) windows from the controller's training track version changes."""
    marks = sorted(
        (s.version, s.start) for s in spans if s.worker == TRAINER_TRACK
    )
    firsts: dict[int, float] = {}
    for version, start in marks:
        firsts.setdefault(version, start)
    versions = sorted(firsts)
    end = max((s.end for s in spans if s.worker == TRAINER_TRACK), default=0.0)
    bounds = [firsts[v] for v in versions] + [end]
    return [(v + 1, bounds[i], bounds[i + 1]) for i, v in enumerate(versions)]


HINTS = {
    ("trainer", "wait_data"): "trainer waits for data: raise "
                              "rollout.max_inflight_prompts, add rollout workers or raise "
                              "max_staleness",
    ("trainer", "weight_publish"): "trainer waits while its weights are published: "
                                   "raise weights.sync_every (loading them into rollout "
                                   "already overlaps the next step)",
    ("trainer", "checkpoint"): "trainer waits for checkpoints: raise run.checkpoint_every "
                               "(writing one already overlaps the next steps)",
    ("trainer", "barrier"): "trainer shards wait on each other: lower micro_batch_tokens "
                            "or add cost_b so the plan balances better",
    ("trainer", "no_work"): "trainer has nothing scheduled: the controller is the "
                            "bottleneck (evaluation, planning)",
    ("trainer", "wait_reference"): "trainer waits for the reference's own worker: give it "
                                   'a device of its own or set reference.placement = "trainer"',
    ("trainer", "wait_critic"): "trainer waits for the critic's own workers: raise "
                                'critic.num_shards or set critic.placement = "trainer"',
    ("rollout", "gate_closed"): "rollout waits at the staleness gate: raise max_staleness "
                                "(max_ahead, where set) or add trainer shards",
    ("rollout", "queue_full"): "rollout waits on a full queue: raise queue.max_groups or "
                               "train faster",
    ("rollout", "no_work"): "rollout has no prompts: raise rollout.max_inflight_prompts",
}


WEIGHT_PHASES = {
    "weight_wire": ("on the wire", "send fewer bytes (rollout.dtype bfloat16) or raise "
                    "weights.sync_every; a version's wire time is about one model over one "
                    "link whatever the number of engines"),
    "weight_load": ("loading into the engines", "raise weights.sync_every: loading is the "
                    "engine's own work"),
    "weight_sync": ("waiting on the broadcast", "raise weights.sync_every or use in_flight "
                    "updates"),
}
"""A rollout engine's pause for a weight update (``workers.common.spans.WEIGHT_UPDATE``), by
phase: what it is, what helps."""


def hint(item: Breakdown) -> str:
    """A one-line suggestion for the biggest idle cause of a role (for a weight update's
    pause: its split by phase, and advice on the phase that dominated)."""
    if item.role == "rollout" and item.top_cause in WEIGHT_PHASES:
        return weight_hint(item.idle_by_cause)
    return HINTS.get((item.role, item.top_cause), "")


def weight_hint(idle_by_cause: dict[str, float]) -> str:
    seconds = {c: idle_by_cause.get(c, 0.0) for c in WEIGHT_PHASES}
    total = sum(seconds.values())
    if total <= 0:
        return ""
    dominant = max(seconds, key=lambda c: seconds[c])
    split = ", ".join(f"{100 * s / total:.0f}% {WEIGHT_PHASES[c][0]}"
                      for c, s in seconds.items() if s > 0)
    if seconds[dominant] == total:  # one phase only: nothing to compare
        return f"rollout pauses for weight updates, {split}: {WEIGHT_PHASES[dominant][1]}"
    return (f"rollout pauses for weight updates ({split}); {WEIGHT_PHASES[dominant][0]} "
            f"dominates: {WEIGHT_PHASES[dominant][1]}")


def busy_fraction(first: UsageReading, last: UsageReading,
                  cores: float) -> dict[str, float]:
    """CPU busy fraction of the worker's cores (and mean GPU utilisation) between readings.

    ``cores`` may be fractional: a sharing trainer's thread count averaged over compute."""
    wall = max(last.wall - first.wall, 1e-9)
    result = {"cpu_busy": (last.cpu_s - first.cpu_s) / (wall * max(cores, 1.0))}
    samples = last.gpu_samples - first.gpu_samples
    if samples:
        result["gpu_util"] = (last.gpu_util_sum - first.gpu_util_sum) / samples / 100.0
    return result

