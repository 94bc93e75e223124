"""Devices lent between the roles, simulated: no lending, verl's starvation switch and the
autopilot's engine count side by side, on setups where generation is the bottleneck.

Each arm is ``async-rl simulate`` of the setup's config with the arm's overrides, one
after another in this process:

- ``off``: the split as configured;
- ``starvation``: ``simulate.lend = "starvation"`` (the trainer's devices generate while
  it waits for a step's groups, back before it trains);
- ``ap-engines`` (ap: the autopilot): ``simulate.lend = "autopilot"`` with
  ``autopilot.keys = []``: the autopilot turns the engine count alone, each engine
  taken from the trainer;
- ``ap-keys``: the autopilot on its live keys, no lending;
- ``ap-both``: the live keys and the engine count.

Setups, 40 steps each: ``7b-16+48`` and ``7b-32+32`` (``examples/sim_h100_7b.toml``,
7B on 64 H100s split 16 engines + 48 trainer devices, or as shipped 32 + 32, both with
staleness 4 and 4 prompts in flight an engine, so the engines' slots bound generation:
the trainer waits about 70% and 25% of its time), and ``moe-1024``
(``examples/sim_h100_moe_1024.toml``: 235B-A22B on 512 + 512 H100s at staleness 1,
where the staleness gate bounds the prompts in flight). Per arm: groups/s over the run,
its ratio to ``off``, and over the run's second half (steps 21-40: each step's groups
over its wait, training and weight snapshot; a switch between steps is in the run's
figure, not this one), the lending (lends and returns, engines started, device-seconds
lent and their share of the trainer's, the seconds the trainer waited on switches,
requests resumed on standing engines) and the engine count at the end. Last line:
``sim_lending: starvation/off R1, ap-engines/off R2 (setup)`` per setup.

    python -m bench.simulator.sim_lending
    python -m bench.simulator.sim_lending --setups 7b-64 --json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from async_rl.analysis.results import SIM_STATS, LendRecord, SimStats
from async_rl.api import simulate
from async_rl.config_io import load_config
from async_rl.run.run_dir import read_metrics
from bench.common.quiet_stdout import show, stdout_to_stderr
from buffers.common.config import ConfigError

ENGINES = "autopilot/rollout.num_workers"
LOOSE = ("staleness.max_staleness=4", "rollout.max_inflight_prompts=4", "run.num_steps=40")
SETUPS: list[tuple[str, str, tuple[str, ...]]] = [
    ("7b-16+48", "examples/sim_h100_7b.toml",
     (*LOOSE, "rollout.num_workers=16", "trainer.num_shards=48")),
    ("7b-32+32", "examples/sim_h100_7b.toml", LOOSE),
    ("moe-1024", "examples/sim_h100_moe_1024.toml", ("run.num_steps=40",)),
]
"""(name, config, overrides) per setup."""
AUTOPILOT = "autopilot.enabled=true"
ARMS: list[tuple[str, tuple[str, ...]]] = [
    ("off", ()),
    ("starvation", ('simulate.lend="starvation"',)),
    ("ap-engines", ('simulate.lend="autopilot"', AUTOPILOT, "autopilot.keys=[]")),
    ("ap-keys", (AUTOPILOT,)),
    ("ap-both", ('simulate.lend="autopilot"', AUTOPILOT)),
]
"""(name, overrides) per arm, in the order they run."""


class ArmFigures(msgspec.Struct, frozen=True, kw_only=True):
    setup: str
    arm: str
    groups_per_s: float
    """Over the whole run (the lending's switches and the autopilot's windows in it)."""
    wall_s: float
    second_half: float
    """Groups/s over steps 21-40 (each step's wait, training and snapshot)."""
    engines: int
    """Rollout engines at the end (the autopilot's count; the config's otherwise)."""
    lend: LendRecord | None


class Result(msgspec.Struct, frozen=True, kw_only=True):
    arms: tuple[ArmFigures, ...]

    def ratio(self, setup: str, arm: str) -> float:
        by = {(a.setup, a.arm): a.groups_per_s for a in self.arms}
        return by.get((setup, arm), 0.0) / by[(setup, "off")]


def measure(setup: str, config_path: str, common: Sequence[str], arm: str,
            overrides: Sequence[str], out: Path) -> ArmFigures:
    run_dir = out / setup / arm.replace(" ", "-")
    config = load_config(Path(config_path), [*common, *overrides, "run.progress=false",
                                             f"run.output_dir={run_dir}"])
    summary = simulate(config, overwrite=True)
    stats = msgspec.json.decode((run_dir / SIM_STATS).read_bytes(), type=SimStats)
    rows = read_metrics(run_dir)
    half = rows[len(rows) // 2:]
    last = rows[-1]
    return ArmFigures(setup=setup, arm=arm, groups_per_s=summary.groups_per_s,
                      wall_s=summary.wall_s, second_half=sum(r["groups"] for r in half) / sum(
                          r["wait_s"] + r["train_s"] + r["sync_s"] for r in half),
                      engines=int(last.get(ENGINES, config.rollout.num_workers)),
                      lend=stats.lend)


def print_result(result: Result, console: Console) -> None:
    table = Table(title="simulated lending: groups/s of each arm, and what it lent")
    for column in ("setup", "arm", "groups/s", "x off", "2nd half", "lends/returns",
                   "engines started", "device-s lent", "of trainer's", "switch wait s", "resumed",
                   "engines at end"):
        table.add_column(column, justify="right")
    for a in result.arms:
        lend = a.lend
        lent = lend and lend.engines
        share = (lend.device_s / (lend.trainer_devices * a.wall_s)
                 if lend and lent and a.wall_s > 0 else 0.0)
        table.add_row(
            a.setup, a.arm, f"{a.groups_per_s:.3f}",
            f"{result.ratio(a.setup, a.arm):.2f}", f"{a.second_half:.3f}",
            f"{lend.lends}/{lend.returns}" if lend else "-",
            f"{lend.engines_lent} of {lend.engines}" if lend else "-",
            f"{lend.device_s:,.0f}" if lend else "-", f"{share:.0%}" if lend else "-",
            f"{lend.switch_s:.1f}" if lend else "-", f"{lend.moved}" if lend else "-",
            str(a.engines))
    console.print(table)
    setups = dict.fromkeys(a.setup for a in result.arms)
    console.print("sim_lending: " + "; ".join(
        f"starvation/off {result.ratio(s, 'starvation'):.2f}, ap-engines/off "
        f"{result.ratio(s, 'ap-engines'):.2f} ({s})" for s in setups))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--setups", nargs="+", choices=[name for name, _, _ in SETUPS],
                        default=[name for name, _, _ in SETUPS])
    parser.add_argument("--arms", nargs="+", choices=[name for name, _ in ARMS],
                        default=[name for name, _ in ARMS])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    arms = [(name, overrides) for name, overrides in ARMS
            if name in args.arms or name == "off"]
    with stdout_to_stderr(args.json), tempfile.TemporaryDirectory() as scratch:
        try:
            figures = [measure(setup, path, common, name, overrides, Path(scratch))
                       for setup, path, common in SETUPS if setup in args.setups
                       for name, overrides in arms]
        except ConfigError as err:
            print(err, file=sys.stderr)
            return 2
    show(Result(arms=tuple(figures)), args.json, print_result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
