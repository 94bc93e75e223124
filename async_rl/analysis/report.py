"""Run reports: the idle table, the Perfetto trace and the timeline, rebuilt from spans.

Owns: reading a run directory's stored spans and summary, resolving idle causes, writing
``trace.json`` and ``timeline.png``, and the tables printed at the end of a run and by
``async-rl report RUN_DIR [RUN_B]``: the run's experiment record (run.json), and for two
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
    resolve,
    step_windows,
)
from async_rl.analysis.trace import write_chrome_trace, write_timeline_png
from async_rl.run.run_dir import CONFIG, EVALS, RUN_RECORD, SPANS, USAGE, read_record, read_summary
from async_rl.run.run_record import describe
from async_rl.run.summary import BucketDrops, RunSummary, describe_failures
from buffers.records import UsageReading
from workers.spans import COMPUTING_IDLE, IDLE, Span

TRACE = "trace.json"
TIMELINE = "timeline.png"
IDLE_JSON = "idle.json"
NOT_COMPARED = ("config run.output_dir", "record started", "record ended", "record command")
"""Differ between any two runs, so they say nothing about why their figures differ (the
command's --set values show up as config differences)."""


def read_spans(run_dir: str | Path) -> list[Span]:
    decoder = msgspec.json.Decoder(Span)
    lines = (Path(run_dir) / SPANS).read_bytes().splitlines()
    return [decoder.decode(line) for line in lines if line]


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
    per_step = tuple(
        StepIdle(step=step, start=lo, end=hi,
                 roles=tuple(by_role(breakdown(resolved, lo, hi))))
        for step, lo, hi in step_windows(controller)
    )
    shown = [
        msgspec.structs.replace(s, start=max(s.start, start), end=min(s.end, end))
        for s in resolved + controller
        if s.end > start and s.start < end
    ]
    return (RunIdle(start=start, end=end, workers=tuple(per_worker),
                    roles=tuple(by_role(per_worker)), steps=per_step), shown)


def build_report(run_dir: str | Path) -> RunIdle:
    """Writes trace.json, timeline.png and idle.json into the run directory."""
    path = Path(run_dir)
    idle, resolved = idle_of(read_spans(path))
    if (path / USAGE).exists():
        idle = msgspec.structs.replace(idle, cross_check=cross_check(idle, path / USAGE))
    write_chrome_trace(resolved, path / TRACE)
    notes = {w.name: f"busy {w.busy_s / w.wall_s:.0%}, most waiting: {w.top_cause}"
             for w in idle.workers if w.wall_s}
    hints = [f"{r.role}: {hint(r)}" for r in idle.roles if r.idle_s > 0 and hint(r)]
    write_timeline_png(resolved, path / TIMELINE,
                       title=f"{path.name}: what each device did "
                             "(green/blue = busy, warm colours = waiting, by cause)",
                       row_notes=notes, footer="\n".join(hints))
    (path / IDLE_JSON).write_bytes(msgspec.json.format(msgspec.json.encode(idle)))
    return idle


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
        f"{label(b)}: {b.dropped}/{b.groups} ({_pct(b.dropped, b.groups)})" for b in buckets)


def wide_console() -> Console:
    """Wide enough for every cause column even when output goes to a file or a pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def idle_table(idle: RunIdle, title: str) -> Table:
    causes = [c for role in ("rollout", "trainer") for c in IDLE[role]]
    causes = list(dict.fromkeys(causes))
    table = Table(title=title)
    for column in ("worker", "device", "busy", "idle", *causes):
        table.add_column(column, justify="right" if column not in ("worker", "device") else "left")
    for item in (*idle.workers, *idle.roles):
        table.add_row(
            item.name, item.device, _pct(item.busy_s, item.wall_s),
            _pct(item.idle_s, item.wall_s),
            *(_pct(item.idle_by_cause[c], item.wall_s) if c in item.idle_by_cause else ""
              for c in causes),
            style="bold" if item.name == item.role else None,
        )
    return table


def print_report(run_dir: str | Path, console: Console | None = None) -> RunIdle:
    """Rebuilds the outputs and prints the idle table, hints and headline figures."""
    console = console or wide_console()
    path = Path(run_dir)
    idle = build_report(path)
    console.print(idle_table(idle, f"idle time by cause: {path}"))
    for name, check in idle.cross_check.items():
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
                          f"({_pct(role.idle_by_cause[role.top_cause], role.wall_s)}) - "
                          f"{hint(role)}")
    if (path / "summary.json").exists():
        s = read_summary(path)
        console.print(
            f"{s.steps} steps in {s.wall_s:.1f}s: {s.groups_per_s:.2f} groups/s, "
            f"{s.tokens_per_s:.0f} tokens/s; accuracy {s.accuracy_start} -> {s.accuracy_end}; "
            f"staleness histogram {list(s.staleness_histogram)}"
        )
        if s.filtered_groups:
            console.print(f"filtered (rollout.filter_groups, no signal): {s.filtered_groups} "
                          f"of {s.groups_generated} groups generated")
        if s.stale_drops_by_length:  # summaries written before it have none
            console.print(drops_by_length(s.stale_drops_by_length))
        if s.evals:
            console.print(f"held-out accuracy {s.target_accuracy} {to_target(s)} "
                          f"({len(s.evals)} evaluations in {EVALS})")
        console.print(f"failures: {describe_failures(s.failures) or 'none'}"
                      + (f"; stopped: {s.stopped}" if s.stopped else ""), markup=False)
    console.print(f"trace: {path / TRACE} (open in ui.perfetto.dev)  timeline: {path / TIMELINE}")
    return idle


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
            put(f"{role.role} idle", i, _pct(role.idle_s, role.wall_s))
            for cause, seconds in role.idle_by_cause.items():
                put(f"  {role.role} {cause}", i, _pct(seconds, role.wall_s))
    table = Table(title="runs side by side")
    table.add_column("")
    for path in columns:
        table.add_column(path.name, justify="right")
    for label, values in rows.items():
        table.add_row(label, *values)
    console.print(table)
