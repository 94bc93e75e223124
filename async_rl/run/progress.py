"""The run's progress bar: step, reward, staleness and throughput, drawn with rich.

Owns: presentation only. Knows nothing about the run but the metrics rows it is handed.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from async_rl.run.summary import describe_failures


class RunProgress:
    """A context manager around a rich progress bar; silent when ``enabled`` is False."""

    def __init__(self, num_steps: int, *, enabled: bool) -> None:
        self.enabled = enabled
        self.progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            disable=not enabled,
        )
        self.task = self.progress.add_task("train", total=num_steps, status="waiting for data")

    def __enter__(self) -> RunProgress:
        self.progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.progress.stop()

    def update(self, row: dict[str, Any]) -> None:
        status = (
            f"reward {row['reward_mean']:.2f}  acc {row['accuracy']:.2f}  "
            f"stale<= {row['staleness_max']}  {row['tokens_per_s']:.0f} tok/s"
        )
        if failures := describe_failures(row.get("failures", {})):  # the classes so far
            status += f"  [{failures}]"
        self.progress.update(self.task, advance=1, status=status)
