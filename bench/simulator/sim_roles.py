"""The PPO roles and LoRA at GPU scale, simulated: GRPO, GRPO + KL, PPO (a critic with
GAE, the KL in the reward) and GRPO with LoRA side by side on one layout.

Each arm is ``async-rl simulate`` of the same config (default the shipped 7B job on 32
H100 engines and 32 H100 trainer shards, ``examples/sim_h100_7b.toml``) with the arm's
overrides, one after another in this process. The reference and the critic sit on the
trainer shards' devices (placement "trainer"); the critic has the policy's shape. LoRA's
adapters are counted from Qwen2.5-7B's config.json numbers (``QWEN25_7B``: the example
gives the model's size, not its folder), so each version carries rank x their in + out
features. Per arm it prints groups/s and the step time after the pipeline fills, the
trainer's idle share by cause (``wait_data``: waiting for rollout; ``critic``: the device
lent to the critic), the critic's busy share and the bytes of one weight version.

    python -m bench.simulator.sim_roles
    python -m bench.simulator.sim_roles --set rollout.num_workers=48 --set trainer.num_shards=16
    python -m bench.simulator.sim_roles --json
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

from async_rl.analysis.report import idle_of, read_spans
from async_rl.analysis.results import run_split
from async_rl.api import simulate
from async_rl.config_io import load_config
from async_rl.run.run_dir import read_metrics
from bench.common.quiet_stdout import show, stdout_to_stderr
from buffers.common.config import ConfigError
from workers.model_config import LORA_TARGETS, lora_features

QWEN25_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
             "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064}
"""Qwen2.5-7B's config.json numbers (what the adapters' count needs)."""
LORA_PER_RANK = sum(lora_features(QWEN25_7B)[name] for name in LORA_TARGETS)
"""Adapter parameters per unit of rank on every linear layer of its decoder."""
ARMS: list[tuple[str, tuple[str, ...]]] = [
    ("grpo", ()),
    ("grpo+kl", ("trainer.kl_coef=0.05",)),
    ("ppo", ("algorithm.advantage=gae", "trainer.kl_coef=0.01", "trainer.kl_estimator=k1",
             "trainer.kl_in_reward=true")),
    ("grpo+lora", ("model.lora.rank=8", f"simulate.lora_parameters_per_rank={LORA_PER_RANK}")),
]
"""(name, overrides) per arm, in the order they run (bench/algorithms/roles.py's arms)."""


class ArmFigures(msgspec.Struct, frozen=True, kw_only=True):
    arm: str
    overrides: tuple[str, ...]
    groups_per_s: float
    """After the pipeline fill."""
    step_s: float
    train_s: float
    trainer_idle: dict[str, float]
    """Cause -> share of the trainer shards' wall time."""
    critic_busy: float | None
    bytes_per_version: int


class Result(msgspec.Struct, frozen=True, kw_only=True):
    config: str
    arms: tuple[ArmFigures, ...]


def measure(config_path: str, arm: str, overrides: Sequence[str], common: Sequence[str],
            out: Path) -> ArmFigures:
    shards = load_config(Path(config_path), common).trainer.num_shards
    # A critic shard beside each trainer shard (placement "trainer").
    config = load_config(Path(config_path), [
        *common, f"critic.num_shards={shards}", *overrides, "run.progress=false",
        "run.record_spans=true", f"run.output_dir={out / arm}"])
    simulate(config, overwrite=True)
    split = run_split(out / arm)
    assert split is not None
    idle, _ = idle_of(read_spans(out / arm))
    roles = {role.role: role for role in idle.roles}
    trainer, critic = roles["trainer"], roles.get("critic")
    sent = [entry["bytes"] for row in read_metrics(out / arm)
            for entry in row.get("broadcast", ())]
    return ArmFigures(
        arm=arm, overrides=tuple(overrides), groups_per_s=split.groups_per_s,
        step_s=split.step_s, train_s=split.train_s,
        trainer_idle={cause: seconds / trainer.wall_s
                      for cause, seconds in trainer.idle_by_cause.items()},
        critic_busy=critic.busy_s / critic.wall_s if critic else None,
        bytes_per_version=max(sent, default=0))


def print_result(result: Result, console: Console) -> None:
    table = Table(title=f"simulated roles: {result.config}")
    for column in ("arm", "groups/s", "step s", "training s", "trainer idle: wait_data",
                   "trainer idle: critic", "critic busy", "MB per version"):
        table.add_column(column, justify="right")
    for a in result.arms:
        table.add_row(a.arm, f"{a.groups_per_s:.2f}", f"{a.step_s:.1f}", f"{a.train_s:.1f}",
                      f"{100 * a.trainer_idle.get('wait_data', 0.0):.1f}%",
                      f"{100 * a.trainer_idle.get('critic', 0.0):.1f}%",
                      "-" if a.critic_busy is None else f"{100 * a.critic_busy:.1f}%",
                      f"{a.bytes_per_version / 2**20:,.1f}")
    console.print(table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--config", default="examples/sim_h100_7b.toml")
    parser.add_argument("--arms", nargs="+", choices=[name for name, _ in ARMS],
                        default=[name for name, _ in ARMS])
    parser.add_argument("--set", dest="common", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override for every arm")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    with stdout_to_stderr(args.json), tempfile.TemporaryDirectory() as scratch:
        try:
            figures = [measure(args.config, name, overrides, args.common, Path(scratch))
                       for name, overrides in ARMS if name in args.arms]
        except ConfigError as err:
            print(err, file=sys.stderr)
            return 2
    show(Result(config=args.config, arms=tuple(figures)), args.json, print_result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
