"""Benchmark: the algorithms' roles side by side at equal samples. GRPO, GRPO with a KL
term, PPO with a critic and GAE (its roles beside the trainer, and on workers of their
own), GRPO with LoRA, on the CPU default and the long-tail task.

Each arm is a (name, config overrides) pair on top of a task's example config; every arm
of a task trains the same steps of the same groups per step (equal samples), with the
same seeds, one run after another in this process. Per run it prints:

- held-out greedy accuracy at the start and the end (``RunSummary``);
- groups trained per second over the training window;
- the mean KL to the initial policy over the last steps (``kl/mean``; the arms without
  a KL term measure it too, through a reference.path set with kl_coef = 0);
- the trainer's and the critic's idle share by cause (``async_rl.analysis.report``):
  with the critic co-located, the trainer's ``critic`` is the device lent to it, the
  critic's ``policy`` the device lent back; with the reference and the critic on
  workers of their own (the ``ppo-own`` arm), the trainer's ``wait_reference`` and
  ``wait_critic`` are its waits for them (on this 2-core machine their workers share
  the rollout's and the trainer's cores: "own" cores here are time-shared);
- bytes per weight version: the tensors one published version carries (the final
  model's, as the engines load them).

Adding an arm is one line in ``ARMS``. Timings on a shared 2-core machine are noisy:
compare arms of the same invocation.

    python -m bench.algorithms.roles                              # both tasks, 60 steps each
    python -m bench.algorithms.roles --tasks cpu_default --steps 30
    python -m bench.algorithms.roles --tasks longtail --steps 30 --set task.eval_size=100
    python -m bench.algorithms.roles --json
    python -m bench.algorithms.roles --tasks cpu_default --arms grpo grpo+kl --kl-coefs 0.5 1.0

``--kl-coefs`` replaces the one GRPO + KL arm (kl_coef 0.05) with one arm per
coefficient (``grpo+kl0.5``, ...), each with the k3 estimator, so a stronger pull can be
set beside the same run at kl_coef = 0 (the ``grpo`` arm, which measures the KL
through its reference).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from async_rl.analysis.report import idle_of, read_spans
from async_rl.config import Config
from async_rl.config_io import load_config
from async_rl.run.inputs import check_inputs
from async_rl.run.run_dir import read_metrics
from bench.common.quiet_stdout import show, stdout_to_stderr
from buffers.common.config import ConfigError

KL_ARM = "grpo+kl"
KL_COEF = 0.05
"""The GRPO + KL arm's coefficient unless ``--kl-coefs`` gives others."""
PPO = ("algorithm.advantage=gae", "critic.lr=1e-4", "critic.warmup_steps=5",
       "trainer.kl_coef=0.01", "trainer.kl_estimator=k1", "trainer.kl_in_reward=true")
ARMS: list[tuple[str, tuple[str, ...]]] = [
    ("grpo", ()),
    (KL_ARM, (f"trainer.kl_coef={KL_COEF}",)),
    ("ppo", PPO),
    ("ppo-own", (*PPO, "reference.placement=own", "critic.placement=own")),
    ("grpo+lora", ("model.lora.rank=8", "trainer.lr=1e-3")),
]
"""(name, overrides) per arm, in the order they run."""

TASKS = {"cpu_default": "examples/cpu_default.toml",
         "longtail": "examples/cpu_longtail.toml"}
ROLES = ("trainer", "critic")
KL_TAIL = 10
"""``kl/mean`` is averaged over this many last steps."""


class ArmFigures(msgspec.Struct, frozen=True, kw_only=True):
    task: str
    arm: str
    overrides: tuple[str, ...]
    run_dir: str
    steps: int
    samples: int
    wall_s: float
    accuracy_start: float | None
    accuracy_end: float | None
    groups_per_s: float
    kl_mean: float | None
    """Mean kl/mean over the last ``KL_TAIL`` steps."""
    idle: dict[str, dict[str, float]]
    """role -> cause (and "busy") -> fraction of the role's wall time."""
    bytes_per_version: int


class Result(msgspec.Struct, frozen=True, kw_only=True):
    steps: int
    arms: tuple[ArmFigures, ...]


def kl_arms(coefs: Sequence[float]) -> list[tuple[str, tuple[str, ...]]]:
    """The GRPO + KL arm once per coefficient, with the k3 estimator (verl's
    low_var_kl)."""
    return [(f"{KL_ARM}{coef:g}", (f"trainer.kl_coef={coef:g}", "trainer.kl_estimator=k3"))
            for coef in coefs]


def arm_config(task_config: str, task: str, arm: str, overrides: Sequence[str],
               steps: int, out_dir: Path, common: Sequence[str] = ()) -> Config:
    """The task's example with the arm's overrides: its own run dir, evaluations at the
    ends only, spans on; the KL measured in every arm (a reference at kl_coef = 0);
    ``common``: overrides of every arm (``--set``)."""
    base = load_config(Path(task_config))
    measured = () if any(o.startswith("trainer.kl_coef") for o in overrides) else (
        f"reference.path={base.model.path}",)
    return load_config(Path(task_config), [
        *measured, *common, *overrides, f"run.num_steps={steps}", "run.eval_every=0",
        f"run.output_dir={out_dir / task / arm}", "run.progress=false",
        "run.record_spans=true"])


def version_bytes(run_dir: Path) -> int:
    """Bytes of one weight version as the broadcasts sent it (metrics.jsonl's broadcast
    entries: a full version, or with LoRA the adapters only); 0 if none was sent."""
    sent = [entry["bytes"] for row in read_metrics(run_dir)
            for entry in row.get("broadcast", ()) if entry.get("bytes")]
    return max(sent, default=0)


def measure(task: str, arm: str, config: Config) -> ArmFigures:
    from async_rl.shell.ray_shell import run_training

    summary = run_training(check_inputs(config))
    run_dir = Path(config.run.output_dir)
    idle, _ = idle_of(read_spans(run_dir))
    roles = {}
    for item in idle.roles:
        if item.role in ROLES and item.wall_s:
            roles[item.role] = {"busy": item.busy_s / item.wall_s} | {
                cause: seconds / item.wall_s for cause, seconds in item.idle_by_cause.items()}
    kls = [row["kl/mean"] for row in read_metrics(run_dir) if "kl/mean" in row][-KL_TAIL:]
    return ArmFigures(
        task=task, arm=arm, overrides=(), run_dir=str(run_dir), steps=summary.steps,
        samples=summary.samples_trained, wall_s=summary.wall_s,
        accuracy_start=summary.accuracy_start, accuracy_end=summary.accuracy_end,
        groups_per_s=summary.groups_per_s, kl_mean=sum(kls) / len(kls) if kls else None,
        idle=roles, bytes_per_version=version_bytes(run_dir))


def _acc(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_result(result: Result, console: Console) -> None:
    table = Table(title=f"roles at equal samples: {result.steps} steps per arm")
    for column in ("task", "arm", "samples", "accuracy start -> end", "groups/s",
                   "kl/mean (last steps)", "trainer busy", "trainer idle: wait_data",
                   "trainer idle: critic", "trainer idle: wait_reference, wait_critic",
                   "critic busy", "critic idle: policy", "MB per version"):
        table.add_column(column, justify="right")
    for a in result.arms:
        trainer, critic = a.idle.get("trainer", {}), a.idle.get("critic", {})

        def pct(role: dict[str, float], key: str) -> str:
            return f"{100 * role[key]:.0f}%" if key in role else "-"

        table.add_row(a.task, a.arm, str(a.samples),
                      f"{_acc(a.accuracy_start)} -> {_acc(a.accuracy_end)}",
                      f"{a.groups_per_s:.2f}",
                      "-" if a.kl_mean is None else f"{a.kl_mean:.4f}",
                      pct(trainer, "busy"), pct(trainer, "wait_data"), pct(trainer, "critic"),
                      f"{pct(trainer, 'wait_reference')}, {pct(trainer, 'wait_critic')}",
                      pct(critic, "busy"), pct(critic, "policy"),
                      f"{a.bytes_per_version / 2**20:.2f}")
    console.print(table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=list(TASKS))
    parser.add_argument("--arms", nargs="+", choices=[name for name, _ in ARMS],
                        default=[name for name, _ in ARMS])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per arm")
    parser.add_argument("--out-dir", default="runs/bench-roles")
    parser.add_argument("--kl-coefs", nargs="+", type=float, default=[], metavar="COEF",
                        help=f"the {KL_ARM} arm once per coefficient (k3 estimator) "
                             f"instead of once at {KL_COEF}")
    parser.add_argument("--set", dest="common", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override for every arm")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    arms = [(name, overrides) for name, overrides in ARMS if name in args.arms]
    if args.kl_coefs and KL_ARM in args.arms:
        at = [name for name, _ in arms].index(KL_ARM)
        arms[at:at + 1] = kl_arms(args.kl_coefs)
    with stdout_to_stderr(args.json):
        try:
            configs = [(task, name, overrides,
                        arm_config(TASKS[task], task, name, overrides, args.steps,
                                   Path(args.out_dir), args.common))
                       for task in args.tasks for name, overrides in arms]
        except ConfigError as err:
            print(err, file=sys.stderr)
            return 2
        figures = [msgspec.structs.replace(measure(task, name, config), overrides=overrides)
                   for task, name, overrides, config in configs]
    show(Result(steps=args.steps, arms=tuple(figures)), args.json, print_result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
