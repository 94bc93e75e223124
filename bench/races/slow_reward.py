"""Benchmark: what a slow reward costs, and how much of it asynchrony hides.

The CPU default (``examples/cpu_default.toml``) scored by one of the rewards in
``bench/races/slow_rewards.py``: ``instant`` (the zero-cost baseline, same machinery),
``sleeps_20ms`` and ``sleeps_100ms`` (``async def``, I/O-bound: they run concurrently on
the rollout worker's reward event loop) and ``computes_2ms`` (sync pure Python: it runs
in the rollout worker's reward processes). Each at every ``--staleness`` bound, side by
side in one process, evaluation off. Per run it prints groups/s, the ratio against
``instant`` at the same bound, the rollout and trainer idle split by cause, and the CPU
seconds each worker's process tree used over the training window (the reward processes
are the rollout worker's children, on its cores: that is the core that pays for a
CPU-bound reward).

    python -m bench.races.slow_reward                        # 20 steps, staleness 0 and 2
    python -m bench.races.slow_reward --steps 10 --rewards instant sleeps_100ms
    python -m bench.races.slow_reward --json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from async_rl.config import Config
from async_rl.config_io import decode_config, load_config
from async_rl.run.inputs import check_inputs
from async_rl.run.run_dir import USAGE
from bench.common.quiet_stdout import add_run_options, show, stdout_to_stderr
from bench.races.sync_vs_async import RoleFigures, measure, role_figures
from buffers.common.config import ConfigError
from workers.common.spans import IDLE

REWARDS = ("instant", "sleeps_20ms", "sleeps_100ms", "computes_2ms")
FUNCTIONS = Path(__file__).with_name("slow_rewards.py")


class RunFigures(msgspec.Struct, frozen=True, kw_only=True):
    reward: str
    max_staleness: int
    run_dir: str
    groups_per_s: float
    vs_instant: float | None
    """groups/s over the ``instant`` run's at the same bound."""
    reward_timeouts: int
    rollout: RoleFigures | None
    trainer: RoleFigures | None
    cpu_s: dict[str, float]
    """CPU seconds of each worker's process tree over the training window."""


def run_config(base: Config, reward: str, eta: int, steps: int, out_dir: Path) -> Config:
    raw = msgspec.to_builtins(base)
    raw["staleness"]["max_staleness"] = eta
    raw["task"].update(eval_size=0, rewards=[{"function": f"{FUNCTIONS}:{reward}"}])
    raw["run"].update(num_steps=steps, output_dir=str(out_dir / f"{reward}-eta{eta}"),
                      progress=False, record_spans=True)
    return decode_config(raw)


def window_cpu(run_dir: str) -> dict[str, float]:
    usage = msgspec.json.decode((Path(run_dir) / USAGE).read_bytes())
    return {name: u["last"]["cpu_s"] - u["first"]["cpu_s"] for name, u in usage.items()}


def run_all(base: Config, rewards: Sequence[str], etas: Sequence[int], steps: int,
            out_dir: Path) -> list[RunFigures]:
    figures: list[RunFigures] = []
    for eta in etas:
        baseline: float | None = None
        for reward in rewards:
            config = run_config(base, reward, eta, steps, out_dir)
            summary, idle = measure(config)
            if reward == "instant":
                baseline = summary.groups_per_s
            figures.append(RunFigures(
                reward=reward, max_staleness=eta, run_dir=config.run.output_dir,
                groups_per_s=summary.groups_per_s,
                vs_instant=summary.groups_per_s / baseline if baseline else None,
                reward_timeouts=summary.failures.get("reward_timeouts", 0),
                rollout=role_figures(idle, "rollout"), trainer=role_figures(idle, "trainer"),
                cpu_s=window_cpu(config.run.output_dir)))
    return figures


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def print_figures(figures: Sequence[RunFigures], console: Console) -> None:
    causes = list(dict.fromkeys(c for role in ("rollout", "trainer") for c in IDLE[role]))
    table = Table(title="slow rewards: groups/s against the zero-cost reward at the same bound")
    for column in ("reward", "max_staleness", "groups/s", "vs instant", "timeouts",
                   "rollout cpu s", "trainer cpu s", "rollout idle", "trainer idle"):
        table.add_column(column, justify="right")
    for run in figures:
        cpu = {name.split("-")[0]: s for name, s in run.cpu_s.items()}
        table.add_row(run.reward, str(run.max_staleness), f"{run.groups_per_s:.2f}",
                      "-" if run.vs_instant is None else f"{run.vs_instant:.2f}x",
                      str(run.reward_timeouts), f"{cpu.get('rollout', 0.0):.1f}",
                      f"{cpu.get('trainer', 0.0):.1f}",
                      _pct(run.rollout.idle_fraction if run.rollout else None),
                      _pct(run.trainer.idle_fraction if run.trainer else None))
    console.print(table)
    idle = Table(title="idle by cause (% of the role's wall time)")
    for column in ("reward", "max_staleness", "role", *causes):
        idle.add_column(column, justify="right")
    for run in figures:
        for name, role in (("rollout", run.rollout), ("trainer", run.trainer)):
            if role is not None:
                idle.add_row(run.reward, str(run.max_staleness), name,
                             *(_pct(role.idle_by_cause.get(c)) if c in role.idle_by_cause
                               else "" for c in causes))
    console.print(idle)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    add_run_options(parser, config="examples/cpu_default.toml", steps=20,
                    out_dir="runs/bench-slow-reward")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--rewards", nargs="+", default=list(REWARDS), choices=REWARDS,
                        help="in this order at each bound; instant is the baseline")
    args = parser.parse_args(argv)
    with stdout_to_stderr(args.json):
        try:
            base = check_inputs(load_config(args.config, args.overrides))
            for eta in args.staleness:  # every config is checked before the first run
                run_config(base, args.rewards[0], eta, args.steps, Path(args.out_dir))
        except ConfigError as err:
            print(str(err), file=sys.stderr)
            return 2
        figures = run_all(base, args.rewards, args.staleness, args.steps, Path(args.out_dir))
    show(figures, args.json, print_figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
