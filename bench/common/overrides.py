"""The config overrides the benchmarks' real runs share."""

from __future__ import annotations

from typing import Any


def bench_run(model: str, steps: int, **more: Any) -> dict[str, Any]:
    """Overrides for one benchmark run of ``steps`` steps on ``model``: no evaluation (it
    would take the runs' time unevenly), no progress bar; and ``more`` (dotted keys,
    passed as ``**{"section.key": value}``)."""
    return {"model.path": model, "run.num_steps": steps, "run.eval_every": 0,
            "task.eval_size": 0, "run.progress": False, **more}
