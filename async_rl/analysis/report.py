"""Run reports: the idle table, the Perfetto trace and the timeline, rebuilt from spans.

Owns: reading a run directory's stored spans and summary, resolving idle causes, writing
``trace.json`` (with each step's staleness split as counter tracks, and the agent
sessions of the engines it shows) and ``timeline.png``,
and the tables printed at the end of a run and by ``async-rl report RUN_DIR [RUN_B]``:
the run's experiment record (run.json) and the autopilot's changes in it (with the
engines it added, from workers.json), and for two
runs what differs in their config and record before their figures side by side. Knows
nothing about how the run was executed.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from async_rl.analysis.idle import (
    Breakdown,
    breakdown,
    busy_fraction,
    by_role,
    hint,
    natural_key,
    resolve,
    roles_in_windows,
    step_windows,
)
from async_rl.analysis.results import result_table
from async_rl.analysis.tables import (
    DEVICE_ROWS,
    FEW_DEVICES,
    idle_table,
    listed_workers,
    most_idle,
    pct,
    wide_console,
)
from async_rl.analysis.trace import Counter, write_chrome_trace, write_timeline_png
from async_rl.config import SimulateConfig
from async_rl.roster import registry_line
from async_rl.run.run_dir import (
    CONFIG,
    EVALS,
    METRICS,
    RUN_RECORD,
    SPANS,
    SUMMARY,
    USAGE,
    read_metrics,
    read_record,
    read_sessions,
    read_summary,
    read_workers,
)
from async_rl.run.run_record import RunRecord, describe
from async_rl.run.summary import BucketDrops, RunSummary, describe_failures
from buffers.common.reports import UsageReading
from workers.common.spans import COMPUTING_IDLE, Span
from workers.layout import WorkerIdentity

TRACE = "trace.json"
TIMELINE = "timeline.png"
IDLE_JSON = "idle.json"
NOT_COMPARED = ("config run.output_dir", "record started", "record ended", "record command")
"""Differ between any two runs, so they say nothing about why their figures differ (the
command's --set values show up as config differences)."""


def read_spans(run_dir: str | Path) -> list[Span]:
    return msgspec.json.Decoder(Span).decode_lines((Path(run_dir) / SPANS).read_bytes())


class StepIdle(msgspec.Struct, frozen=True, kw_only=True):
    """Idle accounting of one optimizer step's window, per role."""

    step: int
    start: float
    end: float
    roles: tuple[Breakdown, ...]


class RunIdle(msgspec.Struct, frozen=True, kw_only=True):
    """A run's idle accounting: per worker and per role, over the training window."""

    start: float
    end: float
    workers: tuple[Breakdown, ...]
    roles: tuple[Breakdown, ...]
    steps: tuple[StepIdle, ...] = ()
    """The same split per optimizer step (window: from one step's wait for data to the
    next's)."""
    cross_check: dict[str, dict[str, float]] = {}
    """Per worker: span-derived busy fraction next to the OS's CPU busy fraction (and
    NVML utilisation on CUDA), from usage.json."""


def idle_of(spans: Sequence[Span]) -> tuple[RunIdle, list[Span]]:
    """Resolves causes and accounts the window from the first to the last controller span.

    Returns the accounting and the resolved spans clipped to that window, for drawing.
    """
    workers = [s for s in spans if s.role != "controller"]
    controller = [s for s in spans if s.role == "controller"]
    resolved = resolve(workers, controller)
    window = controller or workers
    start = min((s.start for s in window), default=0.0)
    end = max((s.end for s in window), default=0.0)
    per_worker = breakdown(resolved, start, end)
    steps = step_windows(controller)
    per_step = tuple(
        StepIdle(step=step, start=lo, end=hi, roles=tuple(roles))
        for (step, lo, hi), roles in zip(
            steps, roles_in_windows(resolved, [(lo, hi) for _, lo, hi in steps]),
            strict=True))
    shown = [
        s if start <= s.start and s.end <= end
        else msgspec.structs.replace(s, start=max(s.start, start), end=min(s.end, end))
        for s in resolved + controller
        if s.end > start and s.start < end
    ]
    return (RunIdle(start=start, end=end, workers=tuple(per_worker),
                    roles=tuple(by_role(per_worker)), steps=per_step), shown)


def build_report(run_dir: str | Path) -> RunIdle:
    """Writes trace.json, timeline.png and idle.json into the run directory. Past
    ``DEVICE_ROWS`` workers, the trace keeps every trainer shard and the engines
    ``traced_engines`` picks (simulate.detail of the run's config), and the timeline
    draws one row per role and the most idle devices. The trace draws the agent
    sessions (sessions.jsonl) of the engines it keeps that ran within the window."""
    path = Path(run_dir)
    idle, resolved = idle_of(read_spans(path))
    if (path / USAGE).exists():
        idle = msgspec.structs.replace(idle, cross_check=cross_check(idle, path / USAGE))
    engines = traced_engines(idle, _detail(path))
    write_chrome_trace([s for s in resolved if s.role != "rollout" or s.worker in engines],
                       path / TRACE, note=_sampled(idle, engines),
                       counters=staleness_counters(path, idle.steps),
                       sessions=[s for s in read_sessions(path) if s.worker in engines
                                 and idle.start <= s.opened and s.closed <= idle.end])
    notes = {w.name: f"busy {w.busy_s / w.wall_s:.0%}, most waiting: {w.top_cause}"
             for w in idle.workers if w.wall_s}
    hints = [f"{r.role}: {hint(r)}" for r in idle.roles if r.idle_s > 0 and hint(r)]
    title = (f"{path.name}: what each device did "
             "(green/blue = busy, warm colours = waiting, by cause)")
    if len(idle.workers) <= DEVICE_ROWS:
        write_timeline_png(resolved, path / TIMELINE, title=title, row_notes=notes,
                           footer="\n".join(hints))
    else:
        drawn = {w.name for w in most_idle(idle.workers, FEW_DEVICES)}
        write_timeline_png(
            [s for s in resolved if s.role == "controller" or s.worker in drawn],
            path / TIMELINE, title=title, row_notes=notes, footer="\n".join(hints),
            roles={r.role: ([s for s in resolved if s.role == r.role],
                            len([w for w in idle.workers if w.role == r.role]))
                   for r in idle.roles})
    (path / IDLE_JSON).write_bytes(msgspec.json.format(msgspec.json.encode(idle)))
    return idle


def staleness_counters(run_dir: Path, steps: Sequence[StepIdle]) -> list[Counter]:
    """Two counter tracks, from each step's start: its staleness in flight and in queue
    (mean and max over its trained tokens; none for a run made before the split)."""
    starts = {s.step: s.start for s in steps}
    rows = read_metrics(run_dir) if (run_dir / METRICS).exists() else []
    return [Counter(track=f"staleness {part.replace('_', ' ')}", at=starts[row["step"]],
                    values={"mean": row[f"staleness_{part}_mean"],
                            "max": row[f"staleness_{part}_max"]})
            for row in rows if row["step"] in starts and "staleness_in_flight_mean" in row
            for part in ("in_flight", "in_queue")]


def _detail(run_dir: Path) -> int:
    """simulate.detail of the run's config (its default without one)."""
    config = tomllib.loads((run_dir / CONFIG).read_text()) if (run_dir / CONFIG).exists() else {}
    return int(config.get("simulate", {}).get("detail", SimulateConfig().detail))


def traced_engines(idle: RunIdle, detail: int) -> set[str]:
    """The rollout engines whose spans the trace keeps: all of them up to ``detail``,
    else ``detail`` evenly spaced ranks and the ``FEW_DEVICES`` most idle engines."""
    engines = [w.name for w in idle.workers if w.role == "rollout"]
    if len(engines) <= detail:
        return set(engines)
    spaced = {engines[i * len(engines) // detail] for i in range(detail)}
    return spaced | {w.name for w in most_idle(idle.workers, FEW_DEVICES)
                     if w.role == "rollout"}


def _sampled(idle: RunIdle, engines: set[str]) -> str:
    """What the trace kept, in words ("" when it kept every worker)."""
    total = sum(w.role == "rollout" for w in idle.workers)
    if len(engines) == total:
        return ""
    ranks = ", ".join(n.rpartition("-")[2] for n in sorted(engines, key=natural_key))
    return (f"every trainer shard; {len(engines)} of {total} rollout engines (ranks "
            f"{ranks}): evenly spaced and the most idle; idle.json accounts for all")


def cross_check(idle: RunIdle, usage_path: Path) -> dict[str, dict[str, float]]:
    """Span busy fraction beside what the OS (CPU time) and NVML measured per worker."""
    usage = msgspec.json.decode(usage_path.read_bytes(),
                                type=dict[str, dict[str, UsageReading | float]])
    result = {}
    for item in idle.workers:
        counters = usage.get(item.name)
        if not counters:
            continue
        first, last, cores = counters["first"], counters["last"], counters["cores"]
        assert isinstance(first, UsageReading) and isinstance(last, UsageReading)
        measured = busy_fraction(first, last, float(cores) if isinstance(cores, float) else 1.0)
        computing = item.busy_s + sum(item.idle_by_cause.get(c, 0.0) for c in COMPUTING_IDLE)
        result[item.name] = {"span_busy": item.busy_s / item.wall_s if item.wall_s else 0.0,
                             "span_computing": computing / item.wall_s if item.wall_s else 0.0,
                             **measured}
    return result


def to_target(summary: RunSummary) -> str:
    """When the run's held-out accuracy first reached its target, or that it did not."""
    if summary.time_to_target_s is None:
        return "not reached"
    return (f"reached after {summary.time_to_target_s:.1f}s, "
            f"{summary.samples_to_target} samples trained")


def drops_by_length(buckets: Sequence[BucketDrops]) -> str:
    """Stale drops over groups generated, per token-length bucket of a group."""
    def label(b: BucketDrops) -> str:
        if b.high is None:
            return f">={b.low}"
        return f"<{b.high}" if b.low == 0 else f"{b.low}-{b.high - 1}"

    return "stale drops by length (tokens per group): " + ", ".join(
        f"{label(b)}: {b.dropped}/{b.groups} ({pct(b.dropped, b.groups)})" for b in buckets)


def print_report(run_dir: str | Path, console: Console | None = None, *,
                 every: bool = False) -> RunIdle:
    """Rebuilds the outputs and prints the idle table (per-role rows, then every worker
    up to ``DEVICE_ROWS`` or with ``every``, else the most idle few), their OS
    cross-checks, hints and headline figures."""
    console = console or wide_console()
    path = Path(run_dir)
    idle = build_report(path)
    console.print(idle_table(idle.workers, idle.roles, f"idle time by cause: {path}",
                             every=every))
    listed = {w.name for w in listed_workers(idle.workers, every)}
    for name, check in idle.cross_check.items():
        if name not in listed:
            continue
        extra = f", NVML {check['gpu_util']:.0%}" if "gpu_util" in check else ""
        # Weight loads and snapshot copies use the worker's cores without being busy.
        computing = check.get("span_computing", check["span_busy"])
        loads = (f" ({computing:.0%} with weight loads and copies)"
                 if computing - check["span_busy"] >= 0.005 else "")
        console.print(f"cross-check {name}: spans say busy {check['span_busy']:.0%}{loads}, "
                      f"OS CPU time says {check['cpu_busy']:.0%}{extra}")
    for role in idle.roles:
        if role.idle_s > 0 and hint(role):
            console.print(f"top idle cause of {role.role}: {role.top_cause} "
                          f"({pct(role.idle_by_cause[role.top_cause], role.wall_s)}) - "
                          f"{hint(role)}")
    if (path / SUMMARY).exists():
        s = read_summary(path)
        console.print(result_table(path, idle.roles))
        if s.filtered_groups:
            console.print(f"filtered (rollout.filter_groups, no signal): {s.filtered_groups} "
                          f"of {s.groups_generated} groups generated")
        if s.dropped_stale and s.stale_drops_by_length:  # older summaries have none
            console.print(drops_by_length(s.stale_drops_by_length))
        if s.evals:
            console.print(f"held-out accuracy {s.target_accuracy} {to_target(s)} "
                          f"({len(s.evals)} evaluations in {EVALS})")
        console.print(f"failures: {describe_failures(s.failures) or 'none'}"
                      + (f"; stopped: {s.stopped}" if s.stopped else ""), markup=False)
    for line in autopilot_lines(read_record(path), read_workers(path)):
        console.print(line, markup=False, highlight=False)
    sampled = _sampled(idle, traced_engines(idle, _detail(path)))
    console.print(f"trace: {path / TRACE} (open in ui.perfetto.dev"
                  + (f"; {sampled.partition(' (')[0]}" if sampled else "")
                  + f")  timeline: {path / TIMELINE}", markup=False, highlight=False)
    return idle


def autopilot_lines(record: RunRecord | None,
                    registry: Sequence[WorkerIdentity] = ()) -> list[str]:
    """The autopilot's changes (run.json), one line each, then the engines it added
    (workers.json: where each ran, when added and removed): none without any."""
    changes = record.autopilot if record else ()
    lent = [w for w in registry if w.added_after_step >= 0]
    if not changes and not lent:
        return []
    lines = [f"autopilot: {len(changes)} change(s), each judged on the window after it"]
    for change in changes:
        judged = (f"{change.outcome} at step {change.judged_step}: {change.judgement}"
                  if change.judged_step else "pending: the run ended first")
        lines.append(f"  after step {change.step}: {change.key} {change.old} -> "
                     f"{change.new} ({judged}); cause: {change.cause}")
    if lent:
        lines.append(f"engines the autopilot added ({len(lent)}, workers.json):")
        lines += [f"  {registry_line(w)}" for w in lent]
    return lines


def print_record(run_dir: str | Path, console: Console | None = None) -> None:
    """The run's experiment record: command, source, versions, hardware, seeds, times."""
    console = console or wide_console()
    record = read_record(run_dir)
    lines = describe(record) if record else [f"no {RUN_RECORD} (the run predates it)"]
    for line in lines:
        console.print(line, markup=False, highlight=False)


def _flatten(tree: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _text(value: Any) -> str:
    if value is None:
        return "-"
    return " ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def differences(run_dirs: Sequence[Path]) -> Table | None:
    """Config keys and record fields whose values differ between the runs; None if none."""
    sides = []
    for path in run_dirs:
        config = tomllib.loads((path / CONFIG).read_text()) if (path / CONFIG).exists() else {}
        record = read_record(path)
        sides.append({**_flatten(config, "config "),
                      **_flatten(msgspec.to_builtins(record) if record else {}, "record ")})
    names = dict.fromkeys(name for side in sides for name in side if name not in NOT_COMPARED)
    rows = [(name, [_text(side.get(name)) for side in sides]) for name in names]
    rows = [(name, values) for name, values in rows if len(set(values)) > 1]
    if not rows:
        return None
    table = Table(title="what differs: config and record (run.json)")
    table.add_column("")
    for path in run_dirs:
        table.add_column(path.name, overflow="fold")
    for name, values in rows:
        table.add_row(Text(name), *map(Text, values))  # values are data, never markup
    return table


def compare(run_dirs: Sequence[str | Path], console: Console | None = None) -> None:
    """Two (or more) runs side by side: what differs in their config and record, then
    throughput, accuracy and idle by role and cause."""
    console = console or wide_console()
    columns = [Path(r) for r in run_dirs]
    differing = differences(columns)
    console.print(differing or "config and record: no differences "
                               f"(not compared: {', '.join(NOT_COMPARED)})")
    rows: dict[str, list[str]] = {}

    def put(label: str, i: int, value: str) -> None:
        rows.setdefault(label, [""] * len(columns))[i] = value

    for i, path in enumerate(columns):
        idle = build_report(path)
        if (path / "summary.json").exists():
            s = read_summary(path)
            put("max_staleness", i, str(s.max_staleness))
            put("wall s", i, f"{s.wall_s:.1f}")
            put("groups/s", i, f"{s.groups_per_s:.2f}")
            put("tokens/s", i, f"{s.tokens_per_s:.0f}")
            put("accuracy start -> end", i, f"{s.accuracy_start} -> {s.accuracy_end}")
            put(f"time to accuracy {s.target_accuracy}", i, to_target(s))
        for role in idle.roles:
            put(f"{role.role} idle", i, pct(role.idle_s, role.wall_s))
            for cause, seconds in role.idle_by_cause.items():
                put(f"  {role.role} {cause}", i, pct(seconds, role.wall_s))
    table = Table(title="runs side by side")
    table.add_column("")
    for path in columns:
        table.add_column(path.name, justify="right")
    for label, values in rows.items():
        table.add_row(label, *values)
    console.print(table)
