"""The autopilot's decisions: which live key to turn, given the idle causes of a window.

Owns: ``Autopilot``, which every ``autopilot.every_steps`` steps reads a ``Window`` (the
groups/s of each of its steps, and its idle shares by role and cause) and answers with at
most one ``Move``: a live key along its ladder (``async_rl.knobs.ladder``) against the
biggest idle cause (one rung, or as far as the trainer's wait says rollout must speed
up: see ``Autopilot._candidates``; the queue first when it could not hold a step's groups
and the prompts then in flight: ``Autopilot._room_first``), or, when the window after
a move trained slower than the window before it by more than the noise band (at the
earlier window's group lengths: ``Window.at_lengths_of``), that move taken back. Where
the workers can lend devices (``EngineLending``), the engine count is a key too
(``ENGINES``: ``balanced_engines`` says how far). The
rules, the shares they read and the range of each key are below; the advice they follow
is the idle report's (``async_rl.analysis.idle.HINTS``), whose words go into each move's cause.
Knows nothing about how a window is measured or how a move is applied
(``async_rl.control.live_tuning``).

Noise band: the standard error of the difference between the two windows' mean per-step
groups/s (each window's sample variance over its steps, over its step count), at least
``MIN_BAND`` of the earlier window's groups/s, so a window of one step or of identical
steps still has a band. A reverted move is not tried again in the same direction on
that key for ``COOLDOWN_WINDOWS`` windows.
"""

from __future__ import annotations

import math
from statistics import variance

import msgspec

from async_rl.analysis.idle import HINTS
from async_rl.config import Config
from async_rl.control.protocols import EngineLending
from async_rl.knobs import live_ladders
from async_rl.run.run_record import AutopilotChange, AutopilotState

INFLIGHT = "rollout.max_inflight_prompts"
QUEUE = "queue.max_groups"
MICRO_BATCH = "trainer.micro_batch_tokens"
STALENESS = "staleness.max_staleness"
ENGINES = "rollout.num_workers"
"""The engine count: a key only where the workers can lend devices (``EngineLending``)."""

WORTH_A_MOVE = 0.10
"""An idle cause below this share of the window is not worth a move."""
NEVER_WAITS = 0.05
"""A trainer waiting for data less than this share of the window is not starved."""
MIN_BAND = 0.02
"""The noise band is at least this fraction of the earlier window's groups/s."""
COOLDOWN_WINDOWS = 4
"""Windows during which a reverted move is not tried again in its direction."""
MAX_JUMP = 8.0
"""The most a key's value may be multiplied by in one move."""


class Window(msgspec.Struct, frozen=True, kw_only=True):
    """What one window of steps measured."""

    last_step: int
    groups_per_s: tuple[float, ...]
    """Each step's groups over its wall time (from the previous step's end to its own)."""
    groups: int
    wall_s: float
    idle: dict[str, dict[str, float]]
    """role -> idle cause -> the share of the window's wall time it held that role."""
    tokens: int = 0
    """Prompt and completion tokens of the groups trained (0: not known)."""

    @property
    def throughput(self) -> float:
        """Groups trained per second over the window."""
        return self.groups / self.wall_s if self.wall_s > 0 else 0.0

    def at_lengths_of(self, earlier: Window) -> float:
        """This window's groups/s had its groups been as long as ``earlier``'s: its
        tokens/s over the earlier window's tokens per group (its groups/s when either
        window's tokens are not known)."""
        if self.tokens <= 0 or earlier.tokens <= 0:
            return self.throughput
        return self.throughput * (self.tokens / self.groups) / (earlier.tokens / earlier.groups)

    def share(self, role: str, cause: str) -> float:
        return self.idle.get(role, {}).get(cause, 0.0)


class Move(msgspec.Struct, frozen=True, kw_only=True):
    """Set ``key`` from ``old`` to ``new``; ``revert``: taking back a move that did not
    pay, ``cause`` then saying why."""

    key: str
    old: int
    new: int
    cause: str
    revert: bool = False


class Rule(msgspec.Struct, frozen=True):
    """A rule the window met: turn ``key`` in ``direction`` (+1 up, -1 down) against an
    idle cause holding ``share`` of the window, to about ``factor`` times its value
    (at least one rung)."""

    share: float
    key: str
    direction: int
    cause: str
    factor: float = 1.0


def balanced_engines(engines: int, ratio: float, devices_per_engine: int,
                     trainer_devices: int) -> float:
    """The engine count at which generation keeps pace with training, from ``engines``
    whose generation takes ``ratio`` times the trainer's time for a step's groups:
    generation scales with the engines and training with the trainer's devices, each
    engine added taking ``devices_per_engine`` of its ``trainer_devices`` now (0: spare
    devices; the trainer keeps its pace, and the count scales by ``ratio``). With E
    engines, T devices and e per engine, k engines more balance the roles when
    ``r E (T - k e) = T (E + k)``: ``k = E T (r - 1) / (T + r E e)`` (negative when
    ``ratio`` < 1: engines given back)."""
    if trainer_devices <= 0:
        return engines * ratio
    e, t = devices_per_engine, trainer_devices
    return engines + engines * t * (ratio - 1) / (t + ratio * engines * e)


def noise_band(before: Window, after: Window) -> float:
    """See the module docstring."""
    spread = sum(variance(w.groups_per_s) / len(w.groups_per_s)
                 for w in (before, after) if len(w.groups_per_s) > 1)
    return max(math.sqrt(spread), MIN_BAND * before.throughput)


class Autopilot:
    """See the module docstring. ``values``: each tuned key's value in effect now."""

    def __init__(self, config: Config, lending: EngineLending | None = None) -> None:
        """``lending``: devices the engine count may take (None: it is no key)."""
        ladders = live_ladders(config)
        self.keys = config.autopilot.keys
        self.rungs = {key: rungs for key, (rungs, _) in ladders.items()}
        """Each key's values within its range (``async_rl.knobs.live_ladders``)."""
        self.values = {key: start for key, (_, start) in ladders.items()}
        self.lending = lending
        self.inflight = config.rollout.max_inflight_prompts
        """rollout.max_inflight_prompts where it is no key (a cause names it)."""
        if lending is not None and lending.engines[1] > lending.engines[0]:
            lo, hi = lending.engines
            self.rungs[ENGINES], self.values[ENGINES] = list(range(lo, hi + 1)), lo
        self.room_needed = (config.trainer.groups_per_step, config.rollout.num_workers)
        """(a step's groups, rollout workers): a queue that holds fewer than a step's
        groups plus every prompt in flight makes finished groups wait for room."""
        self.changes: list[AutopilotChange] = []
        self.windows = 0
        self._pending: tuple[Window, int] | None = None
        """The window a move was decided on, and the move's place in ``changes``."""
        self._blocked: dict[tuple[str, int], int] = {}
        """(key, direction) -> the window count until which it is not tried."""

    def state(self) -> AutopilotState:
        """What a checkpoint keeps: the values in effect and the changes so far."""
        return AutopilotState(values=dict(self.values), changes=tuple(self.changes))

    def restore(self, saved: AutopilotState, engines: int) -> list[str]:
        """Goes on from a checkpoint's ``saved`` state: its changes, and each key's value
        where this run tunes the key, within its range here (the config may have changed:
        a value off the ladder moves to the nearest rung); the engine count is
        ``engines``, those the resumed run started with. A move pending at the
        checkpoint stays pending (the window it was decided on is gone). Lines saying
        where a value was not resumed as saved."""
        self.changes = list(saved.changes)
        lines = []
        for key, rungs in self.rungs.items():
            if key == ENGINES:
                self.values[key] = min(max(engines, rungs[0]), rungs[-1])
                continue
            if key not in saved.values:
                continue
            value = saved.values[key]
            self.values[key] = min(rungs, key=lambda rung: (abs(rung - value), rung))
            if self.values[key] != value:
                lines.append(f"autopilot: {key} was {value} at the checkpoint, outside "
                             f"its range here ({rungs[0]}..{rungs[-1]}): it resumes at "
                             f"{self.values[key]}")
        return lines

    def observe(self, window: Window) -> Move | None:
        """The move after ``window`` (None: none). A window that trained nothing decides
        nothing and judges nothing."""
        if window.groups == 0 or window.wall_s <= 0 or not window.groups_per_s:
            return None
        self.windows += 1
        if self._pending is not None:
            revert = self._judge(*self._pending, window)
            self._pending = None
            if revert is not None:
                return revert
        move = self._decide(window)
        if move is not None:
            self.values[move.key] = move.new
            self.changes.append(AutopilotChange(step=window.last_step, key=move.key,
                                                old=move.old, new=move.new, cause=move.cause))
            self._pending = (window, len(self.changes) - 1)
        return move

    def _judge(self, before: Window, index: int, after: Window) -> Move | None:
        change = self.changes[index]
        band = noise_band(before, after)
        # Judged at the earlier window's group lengths: a workload whose completions
        # lengthen as the policy learns trains fewer groups/s whatever the move did.
        adjusted = after.at_lengths_of(before)
        fell = adjusted < before.throughput - band
        lengths = (f" ({adjusted:.3g} at the earlier window's group lengths)"
                   if adjusted != after.throughput else "")
        judgement = (f"groups/s {before.throughput:.3g} -> {after.throughput:.3g}{lengths}, "
                     f"noise band {band:.2g}")
        self.changes[index] = msgspec.structs.replace(
            change, outcome="reverted" if fell else "kept", judged_step=after.last_step,
            judgement=judgement)
        if not fell:
            return None
        direction = 1 if change.new > change.old else -1
        self._blocked[(change.key, direction)] = self.windows + COOLDOWN_WINDOWS
        self.values[change.key] = change.old
        return Move(key=change.key, old=change.new, new=change.old, revert=True,
                    cause=f"{judgement}: groups/s fell by more than the noise band")

    def _decide(self, window: Window) -> Move | None:
        """The biggest idle cause a rule answers, whose key can still move that way."""
        # Ties keep the rules' order.
        for rule in sorted(self._candidates(window), key=lambda r: -r.share):
            if (rule.key not in self.values
                    or self._blocked.get((rule.key, rule.direction), 0) > self.windows):
                continue
            new = self._next_rung(rule)
            if new is not None:
                return Move(key=rule.key, old=self.values[rule.key], new=new,
                            cause=rule.cause)
        return None

    def _next_rung(self, rule: Rule) -> int | None:
        """The rung nearest ``factor`` times the key's value, at least one rung away."""
        current = self.values[rule.key]
        beyond = sorted((v for v in self.rungs[rule.key]
                         if (v - current) * rule.direction > 0),
                        key=lambda v: v * rule.direction)
        if not beyond:
            return None
        target = current * rule.factor
        reaching = [v for v in beyond if (v - target) * rule.direction >= 0]
        return reaching[0] if reaching else beyond[-1]

    def _candidates(self, window: Window) -> list[Rule]:
        """Every rule the window's idle shares meet.

        The trainer's groups/s is the run's: while it waits for data, rollout must make
        more, held back by the staleness gate (raise the bound), by a full queue that the
        trainer's takes empty in bursts (raise its size), or else by its prompts in
        flight (raise them). A trainer that never waits while rollout waits on a full
        queue trains groups staler than throughput needs: lower the bound. Shards
        waiting on each other: smaller micro-batches balance better.

        How far: a trainer that waited a share ``w`` of the window for data was busy
        ``1 - w`` of it, so rollout must make ``1 / (1 - w)`` times as many groups for
        it never to wait; the prompts in flight and the queue's size scale about
        linearly with what rollout makes, so they move that far (at most ``MAX_JUMP``
        times, at least one rung; an overshoot that slows the run is reverted). The
        staleness bound and the micro-batch move one rung: their effect is not
        proportional."""
        waits = window.share("trainer", "wait_data")
        gate = window.share("rollout", "gate_closed")
        full = window.share("rollout", "queue_full")
        barrier = window.share("trainer", "barrier")
        speedup = min(1.0 / max(1.0 - waits, 1e-9), MAX_JUMP)
        found: list[Rule] = []
        if waits >= WORTH_A_MOVE and gate >= WORTH_A_MOVE:
            found.append(Rule(gate, STALENESS, 1, _cause(
                f"rollout waited at the staleness gate {gate:.0%} of the window while the "
                f"trainer waited for data {waits:.0%}", ("rollout", "gate_closed"))))
        if waits >= WORTH_A_MOVE and full >= WORTH_A_MOVE:
            found.append(Rule(full, QUEUE, 1, _cause(
                f"rollout waited on a full queue {full:.0%} of the window while the "
                f"trainer waited for data {waits:.0%}{_speedup(speedup)}",
                ("rollout", "queue_full")), speedup))
        if waits >= WORTH_A_MOVE and max(gate, full) < WORTH_A_MOVE:
            starved = (f"trainer waited {waits:.0%} of the window for data at "
                       f"{self.values.get(INFLIGHT, self.inflight)} prompts in flight per rollout "
                       f"worker{_speedup(speedup)}")
            found.append(self._room_first(Rule(waits, INFLIGHT, 1, _cause(
                starved, ("trainer", "wait_data")), speedup), starved))
            found += self._engines(waits, 1, speedup, starved)
        if waits < NEVER_WAITS and full >= WORTH_A_MOVE:
            found.append(Rule(full, STALENESS, -1,
                          f"rollout waited on a full queue {full:.0%} of the window and the "
                          f"trainer waited for data only {waits:.0%}: fresher groups cost "
                          "no groups/s"))
            found += self._engines(full, -1, 1.0 - full,
                                   f"rollout waited on a full queue {full:.0%} of the window "
                                   f"and the trainer waited for data only {waits:.0%}")
        if barrier >= WORTH_A_MOVE:
            found.append(Rule(barrier, MICRO_BATCH, -1, _cause(
                f"trainer shards waited on each other {barrier:.0%} of the window",
                ("trainer", "barrier"))))
        return found


    def _engines(self, share: float, direction: int, ratio: float, measured: str
                 ) -> list[Rule]:
        """The engine count's rule (after the in-flight prompts' or the staleness bound's:
        free keys first): to ``balanced_engines`` at generation ``ratio`` times the
        trainer's pace; none where the workers cannot lend."""
        if ENGINES not in self.values or self.lending is None:
            return []
        engines, lending = self.values[ENGINES], self.lending
        trainer = (lending.trainer_devices and lending.trainer_devices
                   - (engines - lending.engines[0]) * lending.devices_per_engine)
        target = balanced_engines(engines, ratio, lending.devices_per_engine, trainer)
        return [Rule(share, ENGINES, direction,
                     f"{measured}: about {target:.0f} engines balance generation and "
                     f"training ({lending.devices_per_engine} device(s) each, from "
                     + (f"the trainer's {trainer})" if trainer else "spare devices)"),
                     target / engines)]

    def _room_first(self, raise_inflight: Rule, starved: str) -> Rule:
        """``raise_inflight``, or the queue's rise before it when the queue could not
        hold a step's groups plus every prompt then in flight: the slots would wait on a
        full queue in bursts between the trainer's takes (measured on the long-tail job:
        16 in flight over a 16-group queue made 1.9 s steps where 8 made 0.9 s).
        ``starved``: what the trainer's wait measured, the start of either move's cause."""
        if INFLIGHT not in self.values or QUEUE not in self.values:
            return raise_inflight
        target = self._next_rung(raise_inflight) or self.values[INFLIGHT]
        step_groups, workers = self.room_needed
        workers = self.values.get(ENGINES, workers)  # the engines running now
        room = step_groups + target * workers
        queue = self.values[QUEUE]
        if queue >= room:
            return raise_inflight
        return Rule(raise_inflight.share, QUEUE, 1, _cause(
            f"{starved}; a queue of {queue} cannot hold a "
            f"step's {step_groups} groups and the {target * workers} prompts that would be "
            "in flight, so it rises first", ("trainer", "wait_data")), room / queue)


def _speedup(factor: float) -> str:
    return f"; {factor:.1f}x the groups would keep it busy"


def _cause(measured: str, role_cause: tuple[str, str]) -> str:
    """What was measured, then the idle report's advice for it."""
    return f"{measured} ({HINTS[role_cause]})"
