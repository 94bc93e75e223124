"""A sweep's results: one row of figures per trial, sweep.csv, the table and sweep.png.

Owns: reading a trial's figures from its run directory (summary.json: throughput,
staleness, drops, accuracy, time to target; metrics.jsonl: the step time split into
generation wait, training and weight sync after the pipeline fills; idle.json: each
role's idle share and top cause), the CSV columns, the printed table and the plot (one
panel per swept key).
Knows nothing about how trials are run (``async_rl.analysis.sweep``).
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from rich.table import Table

from async_rl.analysis.report import IDLE_JSON, RunIdle, build_report
from async_rl.analysis.results import run_split
from async_rl.analysis.tables import wide_console
from async_rl.run.run_dir import SPANS, SUMMARY, read_summary

FIGURES = ("groups_per_s", "tokens_per_s", "step_s", "wait_s", "train_s", "sync_s",
           "trainer_idle", "trainer_top_cause",
           "rollout_idle", "rollout_top_cause", "staleness_mean", "dropped_stale",
           "accuracy_end", "time_to_target_s")
"""The CSV's figure columns, after the swept keys, repeat and status (step_s and its
split: means after the pipeline fills, ``async_rl.analysis.results.step_split``)."""

Row = dict[str, Any]


def run_idle(run_dir: Path) -> RunIdle | None:
    """idle.json (built from spans.jsonl if the run did not write it); None without spans."""
    if (run_dir / IDLE_JSON).exists():
        return msgspec.json.decode((run_dir / IDLE_JSON).read_bytes(), type=RunIdle)
    return build_report(run_dir) if (run_dir / SPANS).exists() else None


def trial_row(run_dir: Path, values: dict[str, str], *, repeat: int, status: str,
              error: str = "") -> Row:
    """The trial's swept values, status and figures (None where the run has none)."""
    row: Row = {**values, "repeat": repeat, "status": status, **dict.fromkeys(FIGURES)}
    if status != "failed" and (run_dir / SUMMARY).exists():
        s = read_summary(run_dir)
        counted = sum(s.staleness_histogram)
        row.update(
            groups_per_s=round(s.groups_per_s, 3), tokens_per_s=round(s.tokens_per_s, 1),
            staleness_mean=round(sum(i * n for i, n in enumerate(s.staleness_histogram))
                                 / counted, 3) if counted else None,
            dropped_stale=s.dropped_stale, accuracy_end=s.accuracy_end,
            time_to_target_s=s.time_to_target_s,
        )
        split = run_split(run_dir)
        if split:
            row.update(step_s=round(split.step_s, 3), wait_s=round(split.wait_s, 3),
                       train_s=round(split.train_s, 3), sync_s=round(split.sync_s, 3))
        idle = run_idle(run_dir)
        for role in idle.roles if idle else ():
            row[f"{role.role}_idle"] = round(role.idle_fraction, 4)
            row[f"{role.role}_top_cause"] = role.top_cause if role.idle_s > 0 else ""
    return {**row, "error": error, "run_dir": str(run_dir)}


def write_csv(path: Path, rows: Sequence[Row]) -> None:
    with open(path, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _idle(row: Row, role: str) -> str:
    share = row[f"{role}_idle"]
    return "" if share is None else f"{share:.0%} {row[f'{role}_top_cause']}".strip()


def _number(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def print_table(rows: Sequence[Row], keys: Sequence[str], title: str) -> None:
    """The figures of every trial, then each failed trial's error on a line of its own."""
    names = [key.partition(".")[2] for key in keys]
    if len(set(names)) < len(names):  # e.g. run.seed and task.seed: keep the sections
        names = list(keys)
    table = Table(title=title, caption="idle: share of the run and its top cause; drops: "
                  "groups dropped as too stale; to target: time to run.target_accuracy")
    for column in (*names, "groups/s", "tokens/s", "step s", "wait/train/sync s",
                   "trainer idle", "rollout idle",
                   "mean stale", "drops", "final acc", "to target", "status"):
        table.add_column(column, justify="left" if column in names else "right", no_wrap=True)
    for row in rows:
        target = row["time_to_target_s"]
        table.add_row(
            *(str(row[key]) for key in keys),
            _number(row["groups_per_s"], ".2f"), _number(row["tokens_per_s"], ".0f"),
            _number(row["step_s"], ".2f"),
            "/".join(_number(row[k], ".2f") for k in ("wait_s", "train_s", "sync_s"))
            if row["step_s"] is not None else "",
            _idle(row, "trainer"), _idle(row, "rollout"),
            _number(row["staleness_mean"], ".2f"), _number(row["dropped_stale"], "d"),
            _number(row["accuracy_end"], ".3f"),
            f"{target:.1f}s" if target is not None else
            ("not reached" if row["groups_per_s"] is not None else ""),
            row["status"].replace("finished_earlier", "earlier run"),
        )
    out = wide_console()
    out.print(table)
    for row in rows:
        if row["error"]:
            out.print(f"failed: {Path(row['run_dir']).name}: {row['error']}", markup=False,
                      highlight=False)


def write_plot(path: Path, rows: Sequence[Row], grid: dict[str, tuple[str, ...]]) -> None:
    """One panel per swept key: groups/s (left axis) and final accuracy (right axis) of
    every finished trial at each of the key's values, with the mean over the other keys
    and repeats as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [row for row in rows if row["groups_per_s"] is not None]
    fig, axes = plt.subplots(1, len(grid), figsize=(4.5 * len(grid), 4), squeeze=False)
    for ax, (key, values) in zip(axes[0], grid.items(), strict=True):
        accuracy_ax = ax.twinx()
        for figure, axis, colour, marker in (("groups_per_s", ax, "#1565c0", "o"),
                                             ("accuracy_end", accuracy_ax, "#ef6c00", "x")):
            points = [(values.index(row[key]), row[figure]) for row in done
                      if row[figure] is not None]
            axis.scatter([x for x, _ in points], [y for _, y in points], color=colour,
                         marker=marker, alpha=0.6)
            means = [(x, sum(ys) / len(ys)) for x in range(len(values))
                     if (ys := [y for px, y in points if px == x])]
            axis.plot([x for x, _ in means], [m for _, m in means], color=colour)
        ax.set_xticks(range(len(values)), values)
        ax.set_xlim(-0.5, len(values) - 0.5)
        ax.set_xlabel(key)
        ax.set_ylabel("groups/s", color="#1565c0")
        accuracy_ax.set_ylabel("final accuracy", color="#ef6c00")
    fig.suptitle("sweep: each point a finished trial; lines: mean over the other keys",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
