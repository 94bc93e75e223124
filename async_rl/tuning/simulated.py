"""A candidate config judged on the simulator: its groups/s and each role's idle causes.

Owns: ``Evaluation`` (what a search needs to know of a candidate) and ``simulated`` (one
simulation of a candidate over its fill and ``STEADY_STEPS`` steps, into a scratch directory
removed afterwards, with no progress bar, no loggers but metrics.jsonl, and nothing drawn:
its spans are accounted in memory). Knows nothing about which candidates to try.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import msgspec

from async_rl.analysis.idle import Breakdown
from async_rl.analysis.report import idle_of, read_spans
from async_rl.analysis.results import run_split
from async_rl.config import Config
from async_rl.sim.run import simulate

STEADY_STEPS = 10
"""Steps a candidate is simulated for after the pipeline's fill (fewer when the config
runs fewer): its groups/s after the fill settles within a percent by then (the
1,024-device 7B example: 15.45 groups/s over 9 steps after its fill, 15.39 over 27, 21.3
over 5), at a third of the cost of 30 steps."""


class Evaluation(msgspec.Struct, frozen=True, kw_only=True):
    """One candidate, simulated."""

    groups_per_s: float
    """After the pipeline's fill (the first ``max_staleness + 1`` steps), as the short
    real runs that check a prediction count it."""
    steps: int
    idle: dict[str, dict[str, float]]
    """Per role: its idle seconds by cause as a fraction of its wall time."""

    def causes(self) -> list[tuple[str, str, float]]:
        """(role, cause, fraction of the role's time), the largest first."""
        found = [(role, cause, share) for role, causes in self.idle.items()
                 for cause, share in causes.items() if share > 0]
        return sorted(found, key=lambda item: (-item[2], item[0], item[1]))


def idle_shares(roles: Sequence[Breakdown]) -> dict[str, dict[str, float]]:
    return {role.role: {cause: seconds / role.wall_s if role.wall_s else 0.0
                        for cause, seconds in role.idle_by_cause.items()}
            for role in roles}


def search_steps(config: Config) -> int:
    """Steps a search simulates ``config`` for: its fill and ``STEADY_STEPS``."""
    return min(config.run.num_steps, config.staleness.max_staleness + 1 + STEADY_STEPS)


def simulated(config: Config, steps: int | None = None) -> Evaluation:
    """Simulates ``config`` over ``steps`` steps (default: ``search_steps``; a
    ConfigError names a key the simulator refuses)."""
    scratch = Path(tempfile.mkdtemp(prefix="async-rl-tune-"))
    run = msgspec.structs.replace(
        config.run, num_steps=steps or search_steps(config), output_dir=str(scratch),
        progress=False, record_spans=True, loggers=("jsonl",))
    try:
        summary = simulate(msgspec.structs.replace(config, run=run))
        split = run_split(scratch)
        spans = read_spans(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    idle, _ = idle_of(spans)
    return Evaluation(groups_per_s=split.groups_per_s if split else summary.groups_per_s,
                      steps=run.num_steps,
                      idle=idle_shares(idle.roles))
