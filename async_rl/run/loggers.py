"""Metric loggers beside metrics.jsonl: TensorBoard and Weights & Biases (``run.loggers``).

Owns: which package each optional logger needs, turning a metrics row into flat scalars,
and writing the rows, evaluations and summary of a run to a TensorBoard event file
(``RUN_DIR/tensorboard/``) or a W&B run (``RUN_DIR/wandb/``; ``WANDB_MODE=offline``
works with no network). metrics.jsonl stays the source of truth: ``async_rl.run.run_dir``
always writes it and fans each record out to the loggers opened here. Knows nothing
about how the figures are produced.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from async_rl.config import Config
from buffers.common.config import ConfigError

if TYPE_CHECKING:  # run_dir imports this module to fan its records out
    from async_rl.run.summary import EvalPoint, RunSummary

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""Optional logger -> the package it needs (the ``loggers`` extra installs both)."""
TENSORBOARD_DIR = "tensorboard"


class Logger(Protocol):
    def metrics(self, step: int, scalars: Mapping[str, float]) -> None: ...
    def eval(self, point: EvalPoint) -> None: ...
    def summary(self, scalars: Mapping[str, float]) -> None: ...
    def close(self) -> None: ...


def check_installed(loggers: Sequence[str]) -> None:
    """A one-line ConfigError naming run.loggers when a chosen logger's package is missing."""
    for name in loggers:
        package = PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"config error: run.loggers = {list(loggers)!r}: {name!r} needs the "
                f"{package} package (pip install 'async-rl[loggers]')"
            )


def scalars(values: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """Numbers (and booleans) of a nested mapping as ``prefix/key/subkey`` -> float.

    Lists (staleness histogram, per-shard times, broadcast timings, bucket counts) are
    left out: a scalar chart cannot show them, and metrics.jsonl keeps them.
    """
    flat: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}/{key}"
        if isinstance(value, bool | int | float):
            flat[name] = float(value)
        elif isinstance(value, Mapping):
            flat.update(scalars(value, name))
    return flat


def summary_scalars(summary: RunSummary) -> dict[str, float]:
    values = msgspec.to_builtins(summary)
    values.pop("evals")  # already logged one by one
    return scalars(values, "summary")


class TensorBoardLogger:
    """Scalars in an event file under RUN_DIR/tensorboard (torch's SummaryWriter)."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR))
        self.last_step = 0

    def metrics(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.last_step = step

    def eval(self, point: EvalPoint) -> None:
        # Plotted against the policy version it scored: the optimizer step that made it.
        self.writer.add_scalar("eval/accuracy", point.accuracy, point.version)

    def summary(self, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, self.last_step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A W&B run in RUN_DIR/wandb; project from WANDB_PROJECT, else "async-rl"."""

    def __init__(self, run_dir: Path, config: Config) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "async-rl"), dir=str(run_dir),
            name=run_dir.name, config=msgspec.to_builtins(config),
            # The console belongs to the progress bar; W&B must not capture it.
            settings=wandb.Settings(console="off", silent=True),
        )
        # Training rows and evaluations have their own x-axes: evaluations finish after
        # later steps were logged, and W&B's own step may only grow.
        self.run.define_metric("train/step")
        self.run.define_metric("train/*", step_metric="train/step")
        self.run.define_metric("eval/version")
        self.run.define_metric("eval/*", step_metric="eval/version")

    def metrics(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars))

    def eval(self, point: EvalPoint) -> None:
        self.run.log({"eval/accuracy": point.accuracy, "eval/version": point.version,
                      "eval/wall_s": point.wall_s,
                      "eval/samples_trained": point.samples_trained})

    def summary(self, scalars: Mapping[str, float]) -> None:
        self.run.summary.update(dict(scalars))

    def close(self) -> None:
        self.run.finish()


def open_loggers(names: Sequence[str], run_dir: Path, config: Config) -> list[Logger]:
    """The loggers of ``run.loggers`` other than jsonl (which run_dir writes itself)."""
    opened: list[Logger] = []
    if "tensorboard" in names:
        opened.append(TensorBoardLogger(run_dir))
    if "wandb" in names:
        opened.append(WandbLogger(run_dir, config))
    return opened
