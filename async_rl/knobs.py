"""The keys the tuner and the autopilot may change, their bounds, and ``--allow``.

Owns: the table of tunable keys (``KNOBS``: which may change while a run trains, which
only when ``--allow`` names them), each key's bounds for a given config (``bounds``: the
config's own rules, and ``staleness.max_staleness`` capped at the config's value, the
user's ceiling on off-policy-ness), the ``split`` pseudo-key (how the devices, on CPU
the cores, of rollout plus training are divided between them), parsing ``--allow
KEY=LO..HI`` / ``--allow KEY`` into the ranges a search may use (``allowed_ranges``; a
ConfigError naming the key otherwise), the ladder of values a search tries within a
range (``ladder``), which keys ``[autopilot]`` may name
(``check_live``), and applying chosen values to a config (``with_values``, validated
as any config is). Knows nothing about searching or running.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from async_rl.config import Config
from async_rl.config_io import decode_config
from buffers.common.config import ConfigError

Value = int | float | str
"""A tunable key's value: a count, a rate, or one of a key's choices."""

SPLIT = "split"
"""Pseudo-key: of a device cluster's rollout plus training devices, those given to
rollout (the rest go to the trainer shards). On CPU hardware ``--allow split`` means the
cores of each instead: ``rollout.cpus_per_worker`` and ``trainer.cpus_per_shard``."""
CPU_SPLIT = ("rollout.cpus_per_worker", "trainer.cpus_per_shard")

DEFAULT_SPAN = 16
"""A default range reaches this factor below and above the config's value: wide enough
for the knee of any throughput curve, narrow enough to search in seconds."""

BIG = 1 << 20
"""Upper bound of the counts that have no natural one (prompts in flight, queue
groups): far above what any run uses, so a range can always be given."""


class Knob(msgspec.Struct, frozen=True, kw_only=True):
    """One tunable key."""

    key: str
    kind: Literal["int", "float", "choice"]
    live: bool = False
    """The autopilot may change it while a run trains."""
    guarded: bool = False
    """An algorithmic choice (the effective batch, the learning rate): searched only when
    ``--allow`` names it."""
    choices: tuple[str, ...] = ()


KNOBS: tuple[Knob, ...] = (
    Knob(key="rollout.max_inflight_prompts", kind="int", live=True),
    Knob(key="queue.max_groups", kind="int", live=True),
    Knob(key="trainer.micro_batch_tokens", kind="int", live=True),
    Knob(key="staleness.max_staleness", kind="int", live=True),
    Knob(key="weights.sync_every", kind="int"),
    Knob(key="weights.update_mode", kind="choice", choices=("in_flight", "drain")),
    Knob(key=SPLIT, kind="int", guarded=True),
    Knob(key="rollout.cpus_per_worker", kind="int", guarded=True),
    Knob(key="trainer.cpus_per_shard", kind="int", guarded=True),
    Knob(key="trainer.groups_per_step", kind="int", guarded=True),
    Knob(key="rollout.group_size", kind="int", guarded=True),
    Knob(key="trainer.lr", kind="float", guarded=True),
)
"""Every key a search or the autopilot may change. Everything else (the model, the
task, the loss and its coefficients) is never changed."""

LIVE_KEYS = tuple(knob.key for knob in KNOBS if knob.live)
"""The keys ``[autopilot]`` may change while a run trains."""

_BY_KEY = {knob.key: knob for knob in KNOBS}

Range = tuple[Value, Value] | tuple[str, ...]
"""A numeric key's (lo, hi), both included; a choice key's allowed choices."""


def knob(key: str) -> Knob:
    """The tunable key ``key``; a ConfigError naming it when it is not one."""
    if key not in _BY_KEY:
        raise ConfigError(f"config error: --allow {key}: not a tunable key (one of "
                          f"{', '.join(_BY_KEY)})")
    return _BY_KEY[key]


def check_live(config: Config) -> None:
    """A ConfigError naming the first of autopilot.keys that may not change while a run
    trains (not a tunable key, or not a live one)."""
    for key in config.autopilot.keys:
        if key not in LIVE_KEYS:
            why = "not a live key" if key in _BY_KEY else "not a tunable key"
            raise ConfigError(f"config error: autopilot.keys: {key!r} is {why} (one of "
                              f"{', '.join(LIVE_KEYS)})")


def staleness_ceiling(config: Config) -> int:
    """The most staleness.max_staleness may be while a run trains: autopilot.max_staleness,
    else (-1) the config's own bound."""
    chosen = config.autopilot.max_staleness
    return config.staleness.max_staleness if chosen < 0 else chosen


def live_range(config: Config, key: str) -> tuple[int, int]:
    """Where the autopilot may move live key ``key``: staleness from what
    weights.sync_every needs up to ``staleness_ceiling``; any other key over its
    ``default_ranges`` span."""
    if key == "staleness.max_staleness":
        return config.weights.sync_every - 1, staleness_ceiling(config)
    lo, hi = default_ranges(config)[key]
    return int(lo), int(hi)


def live_ladders(config: Config) -> dict[str, tuple[list[int], int]]:
    """Each of autopilot.keys: the values the autopilot may set it to and the one it
    starts from (staleness at its ceiling); a ConfigError names a key that may not
    change while a run trains (``check_live``)."""
    check_live(config)
    ladders: dict[str, tuple[list[int], int]] = {}
    for key in config.autopilot.keys:
        span = live_range(config, key)
        start = span[1] if key == "staleness.max_staleness" else int(value_of(config, key))
        ladders[key] = ([int(v) for v in ladder(key, span, start)], start)
    return ladders


def inflight_ceiling(config: Config) -> int:
    """The most prompts one rollout worker may be given at once during the run (its
    actor's concurrency is sized for it)."""
    tuned = (config.autopilot.enabled
             and "rollout.max_inflight_prompts" in config.autopilot.keys)
    return (live_range(config, "rollout.max_inflight_prompts")[1] if tuned
            else config.rollout.max_inflight_prompts)


def split_total(config: Config) -> int:
    """Devices (on CPU: cores) of rollout plus training, which ``split`` divides."""
    return rollout_devices(config) + trainer_devices(config)


def rollout_devices(config: Config) -> int:
    """The ``split`` value of ``config``: its rollout workers' devices (on CPU: cores)."""
    return config.rollout.num_workers * _per_rollout_worker(config)


def trainer_devices(config: Config) -> int:
    return config.trainer.num_shards * _per_trainer_shard(config)


def _on_cpu(config: Config) -> bool:
    return config.simulate.hardware == "cpu"


def _per_rollout_worker(config: Config) -> int:
    """A rollout worker's devices, as the simulator counts them: its layout's (an engine
    spans tp x pp), else the hardware override's (the bundled hardware files: 1)."""
    if _on_cpu(config):
        return config.rollout.cpus_per_worker
    return (config.simulate.rollout_layout.devices
            or config.simulate.hardware_overrides.devices_per_rollout_worker or 1)


def _per_trainer_shard(config: Config) -> int:
    """A trainer shard's devices: its layout's (tp x pp x cp), else the override's."""
    if _on_cpu(config):
        return config.trainer.cpus_per_shard
    return (config.simulate.trainer_layout.devices
            or config.simulate.hardware_overrides.devices_per_trainer_shard or 1)


def bounds(key: str, config: Config) -> Range:
    """What ``key`` may be for ``config`` without breaking a rule of the config: a
    step must fit the queue, a micro-batch must hold a completion, and staleness may
    not pass the config's own ``staleness.max_staleness`` (``--allow`` lifts that
    ceiling, up to ``sync_every``'s needs and 64 versions)."""
    spec = knob(key)
    if spec.kind == "choice":
        return spec.choices
    environment = config.task.environment
    # A micro-batch holds at least one whole sequence: the longest completion after its
    # prompt (the simulator's prompt length; a real task's prompts are short beside it).
    shortest_micro_batch = max(config.rollout.max_new_tokens + config.simulate.prompt_tokens,
                               environment.max_trajectory_tokens if environment.enabled else 0)
    numeric: dict[str, tuple[Value, Value]] = {
        "rollout.max_inflight_prompts": (1, BIG),
        "queue.max_groups": (config.trainer.groups_per_step, BIG),
        "trainer.micro_batch_tokens": (shortest_micro_batch, BIG * 16),
        "staleness.max_staleness": (_least_staleness(config),
                                    config.staleness.max_staleness),
        "weights.sync_every": (1, config.staleness.admission_ahead + 1),
        SPLIT: (_split_step(config), split_total(config) - _split_step(config)),
        "rollout.cpus_per_worker": (1, machine_cores(config)),
        "trainer.cpus_per_shard": (1, machine_cores(config)),
        "trainer.groups_per_step": (1, config.queue.max_groups),
        "rollout.group_size": (2, 1024),
        "trainer.lr": (1e-8, 1.0),
    }
    return numeric[key]


def ceiling_bounds(key: str, config: Config) -> Range:
    """``bounds``, with staleness allowed past the config's own value (``--allow``)."""
    if key == "staleness.max_staleness":
        return (_least_staleness(config), 64)
    return bounds(key, config)


def _least_staleness(config: Config) -> int:
    """The lowest staleness.max_staleness a trial's config may have: what
    weights.sync_every needs, and no lower than a staleness.max_ahead that is set."""
    return max(config.weights.sync_every - 1, config.staleness.max_ahead)


def _split_step(config: Config) -> int:
    """Devices one move of ``split`` trades: a rollout worker's or a trainer shard's,
    whichever is larger (one worker for one shard keeps both counts whole)."""
    return max(_per_rollout_worker(config), _per_trainer_shard(config))


def machine_cores(config: Config) -> int:
    """Cores a CPU run may give one worker: run.num_cpus, else this machine's."""
    return config.run.num_cpus or os.cpu_count() or 1


def default_ranges(config: Config) -> dict[str, Range]:
    """The keys a search varies when ``--allow`` names none: every unguarded knob, from
    ``DEFAULT_SPAN`` times below the config's value to as far above, within bounds."""
    ranges: dict[str, Range] = {}
    for spec in KNOBS:
        if spec.guarded:
            continue
        span = bounds(spec.key, config)
        if spec.kind == "int":
            current = int(value_of(config, spec.key))
            lo, hi = span
            span = (max(int(lo), current // DEFAULT_SPAN), min(int(hi), current * DEFAULT_SPAN))
        ranges[spec.key] = span
    return ranges


def allowed_ranges(items: Sequence[str], config: Config) -> dict[str, Range]:
    """``default_ranges`` plus each ``--allow KEY`` (its bounds) or ``KEY=LO..HI``
    (that range, which must lie inside what the key may be). A ConfigError names the key
    that does not exist, is not tunable, or whose range is malformed or out of bounds."""
    ranges = default_ranges(config)
    for item in items:
        key, sep, text = (part.strip() for part in item.partition("="))
        spec = knob(key)
        if key == SPLIT and _on_cpu(config):
            if sep:
                raise ConfigError(f"config error: --allow {item}: on CPU the split is "
                                  f"{' and '.join(CPU_SPLIT)}: give their ranges instead")
            ranges |= {cores: bounds(cores, config) for cores in CPU_SPLIT}
            continue
        limit = ceiling_bounds(key, config)
        if not sep:
            ranges[key] = limit
            continue
        ranges[key] = _parse_range(spec, text, limit, item)
    return ranges


def _parse_range(spec: Knob, text: str, limit: Range, item: str) -> Range:
    if spec.kind == "choice":
        picked = tuple(choice.strip() for choice in text.split(","))
        unknown = [choice for choice in picked if choice not in spec.choices]
        if unknown:
            raise ConfigError(f"config error: --allow {item}: {unknown[0]!r} is not one of "
                              f"{', '.join(spec.choices)}")
        return picked
    lo_text, dots, hi_text = text.partition("..")
    try:
        number = int if spec.kind == "int" else float
        lo, hi = number(lo_text), number(hi_text)
    except ValueError:
        raise ConfigError(f"config error: --allow {item}: expected {spec.key}=LO..HI "
                          f"with {spec.kind} bounds") from None
    low, high = limit
    if not dots or lo > hi:
        raise ConfigError(f"config error: --allow {item}: expected {spec.key}=LO..HI "
                          "with LO <= HI")
    if lo < low or hi > high:  # type: ignore[operator]
        raise ConfigError(f"config error: --allow {item}: {spec.key} may only be "
                          f"{low}..{high} for this config")
    return (lo, hi)


def ladder(key: str, span: Range, around: Value) -> list[Value]:
    """The values a search tries for ``key`` within ``span``: a choice key's choices; a
    count's powers of two (and the ends, and its current value), a rate's factors of
    two, because throughput answers these keys on a log scale."""
    spec = knob(key)
    if spec.kind == "choice":
        return list(span)
    lo, hi = span
    assert isinstance(lo, int | float) and isinstance(hi, int | float)
    if key == SPLIT:  # whole workers, about DEFAULT_SPAN points across the range
        step = int(lo)
        unit = max(step, (int(hi) + step) // DEFAULT_SPAN // step * step)
        return sorted({*range(unit, int(hi) + 1, unit), int(around)}
                      & set(range(int(lo), int(hi) + 1)))
    values: set[Value] = {lo, hi}
    if isinstance(around, int | float) and lo <= around <= hi:
        values.add(around)
    if spec.kind == "int":
        low = max(1, int(lo))
        values |= {2 ** k for k in range(math.ceil(math.log2(low)),
                                         math.floor(math.log2(max(int(hi), 1))) + 1)}
    else:
        k = math.ceil(math.log2(lo))
        while 2.0 ** k <= hi:
            values.add(2.0 ** k)
            k += 1
    return sorted(v for v in values if lo <= v <= hi)  # type: ignore[operator]


def value_of(config: Config, key: str) -> Value:
    """``key``'s value in ``config`` (``split``: its rollout devices)."""
    if key == SPLIT:
        return rollout_devices(config)
    section, name = key.split(".")
    value: Value = getattr(getattr(config, section), name)
    return value


def with_values(config: Config, values: Mapping[str, Value]) -> Config:
    """``config`` with ``values`` applied and validated as any config is (a ConfigError
    names a combination the config's rules refuse). ``split`` sets the rollout workers'
    and trainer shards' counts so that rollout has that many devices (on CPU: the
    rollout worker's and trainer shard's cores, one of each)."""
    raw: dict[str, Any] = msgspec.to_builtins(config)
    for key, value in values.items():
        if key == SPLIT:
            _apply_split(raw, config, int(value))
            continue
        section, name = key.split(".")
        raw[section][name] = value
    return decode_config(raw)


def _apply_split(raw: dict[str, Any], config: Config, rollout: int) -> None:
    rest = split_total(config) - rollout
    if rollout < 1 or rest < 1:
        raise ConfigError(f"config error: split = {rollout}: leaves no devices for "
                          f"{'rollout' if rollout < 1 else 'training'}")
    raw["rollout"]["num_workers"] = max(1, rollout // _per_rollout_worker(config))
    raw["trainer"]["num_shards"] = max(1, rest // _per_trainer_shard(config))


def changed(base: Config, tuned: Config) -> dict[str, Value]:
    """The ``section.key`` values of ``tuned`` that differ from ``base`` (real keys:
    ``split`` shows as the counts or cores it set)."""
    before, after = msgspec.to_builtins(base), msgspec.to_builtins(tuned)
    return {f"{section}.{name}": value
            for section, values in after.items() if isinstance(values, dict)
            for name, value in values.items() if before[section].get(name) != value}


def as_overrides(values: Mapping[str, Value]) -> list[str]:
    """``--set`` items of ``values`` (a string as a JSON string, which TOML reads too)."""
    return [f"{key}={msgspec.json.encode(value).decode()}" for key, value in values.items()]
