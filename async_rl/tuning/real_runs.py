"""The real runs of ``async-rl tune``: the short calibration run and the checks.

Owns: running the user's config for a few steps on this machine (each run its own
``async-rl train`` process, as a sweep's trial is), fitting this machine's hardware file
to that run (``simulate --calibrate``), and measuring a candidate's groups/s with a run
of the same length. A run's groups/s is counted after the pipeline's fill (the first
``max_staleness + 1`` steps), as the simulator's prediction is, so that a short check
compares with it. Knows nothing about searching.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from async_rl.analysis.results import run_split
from async_rl.analysis.sweep import Trial, run_trial
from async_rl.analysis.sweep_report import run_idle
from async_rl.knobs import Value, as_overrides
from async_rl.sim.calibrate import calibrate

CALIBRATION = "calibration"
"""The calibration run's directory, and its hardware file's stem, in the tune's folder."""


class Measurement(msgspec.Struct, frozen=True, kw_only=True):
    """One short real run."""

    run_dir: Path
    groups_per_s: float | None
    """After the fill; None: the run failed (``error``)."""
    seconds: float
    """Its wall time, starting the workers included."""
    causes: dict[str, str] = {}
    """Per role, its top idle cause and share ("wait_data 41%")."""
    error: str = ""


class Calibration(msgspec.Struct, frozen=True, kw_only=True):
    """The calibration run and the hardware file fitted to it."""

    run: Measurement
    hardware: Path | None
    """None: the run failed."""
    description: str = ""
    """What the fit found, as ``simulate --calibrate`` prints it."""


def short_run(config_path: str, sets: Sequence[str], run_dir: Path,
              steps: int) -> Measurement:
    """``config_path`` with ``sets`` for ``steps`` steps in its own process."""
    began = time.perf_counter()
    result = run_trial(config_path, Trial(name=run_dir.name, values=(), repeat=0), run_dir,
                       list(sets), steps)
    seconds = time.perf_counter() - began
    if result.status == "failed":
        return Measurement(run_dir=run_dir, groups_per_s=None, seconds=seconds,
                           error=result.error)
    split = run_split(run_dir)
    return Measurement(run_dir=run_dir, groups_per_s=split.groups_per_s if split else None,
                       seconds=seconds, causes=top_causes(run_dir),
                       error="" if split else "no step finished")


def top_causes(run_dir: Path) -> dict[str, str]:
    """Each role's top idle cause and its share of the role's time, from its spans."""
    idle = run_idle(run_dir)
    return {role.role: f"{role.top_cause} {role.idle_by_cause[role.top_cause] / role.wall_s:.0%}"
            for role in (idle.roles if idle else ()) if role.idle_s > 0 and role.wall_s > 0}


def calibration_run(config_path: str, sets: Sequence[str], folder: Path,
                    steps: int) -> Calibration:
    """The config as it is for ``steps`` steps, and this machine's hardware file fitted
    to it (``folder``/calibration.toml)."""
    run = short_run(config_path, sets, folder / CALIBRATION, steps)
    if run.groups_per_s is None:
        return Calibration(run=run, hardware=None)
    hardware = folder / f"{CALIBRATION}.toml"
    fit = calibrate(run.run_dir, hardware, sets)
    return Calibration(run=run, hardware=hardware, description=fit.describe())


def check_runs(config_path: str, sets: Sequence[str], folder: Path, steps: int,
               candidates: Sequence[dict[str, Value]]) -> list[Measurement]:
    """Each candidate's changed keys (real config keys) over ``sets``, one short run
    each, in ``folder``/check-N, one after another."""
    return [short_run(config_path, [*sets, *as_overrides(values)], folder / f"check-{n}",
                      steps)
            for n, values in enumerate(candidates, 1)]
