"""`async-rl compare`: the same fixed batch through two or more trainer setups, side by side.

Owns: reading the setups (``--NAME key=value,key=value`` groups of config keys over one
base config: ``split_setups``, ``setup_configs``), the fixed batch (``fixed_batch``: the
base config's ``trainer.groups_per_step`` groups of ``rollout.group_size`` long-tail
shaped sequences from ``--seed``, the same sequences in the same order for every
setup, each setup planning them for its own shards), whether the setups agree
(``agreement``: with the first, within a stated tolerance), and the table and JSON
object it prints. Each setup runs in processes of its own
(``workers.trainer.compare.run_setup``: a ``TrainerShard`` per process, no Ray). Knows
nothing about how a shard trains.
"""

from __future__ import annotations

import re
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from async_rl.config import Config
from async_rl.config_io import apply_overrides, decode_config, load_config
from async_rl.control.loss_stats import merge_stats
from async_rl.tasks.synthetic import long_tail_groups
from buffers.common.config import ConfigError
from buffers.common.records import Group
from buffers.plan.batching import shard_batches
from workers.trainer.compare import ShardFigures, run_setup

if TYPE_CHECKING:
    from rich.table import Table

SETUP_SECTIONS = ("trainer", "model")
"""Sections a setup may change; model.path is the same for every setup."""
_NAME = re.compile(r"[A-Za-z][\w-]*")
_NEXT_KEY = re.compile(r",(?=\s*[A-Za-z_]\w*\.[\w.]+\s*=)")
"""A comma that starts the next ``section.key=`` of a group (not one inside a value)."""


class Setup(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    overrides: tuple[str, ...]
    """The group's ``section.key=value`` items, as given."""


class SetupFigures(msgspec.Struct, frozen=True, kw_only=True):
    """One setup's row of the comparison."""

    name: str
    overrides: tuple[str, ...]
    step_s: float
    """Median over the timed steps of the slowest shard's step time."""
    peak_rss_mb: float
    """The largest shard's peak RSS."""
    peak_rss_mb_per_shard: list[float]
    rss_setup_mb: list[float]
    losses: list[float]
    """Each step's loss (every shard's loss sum / their tokens), the warm-up's first."""
    grad_norms: list[float]
    max_param_diff: float
    """Largest absolute parameter difference to the first setup after every step."""
    agree: bool
    """Losses, gradient norms and parameters within the tolerance of the first setup's."""


class Comparison(msgspec.Struct, frozen=True, kw_only=True):
    agree: bool
    tolerance: float
    parameters: int
    sequences: int
    tokens: int
    steps: int
    """Timed steps (after one warm-up step)."""
    setups: list[SetupFigures]


def split_setups(argv: Sequence[str], options: set[str]) -> tuple[list[str], list[Setup]]:
    """Takes the ``--NAME GROUP`` (or ``--NAME=GROUP``) pairs out of ``argv``: every
    ``--NAME`` that is not one of ``options``. Returns the rest and the setups, in order."""
    rest: list[str] = []
    setups: list[Setup] = []
    items = iter(argv)
    for item in items:
        flag, eq, inline = item.partition("=")
        if not flag.startswith("--") or flag in options or item == "--":
            rest.append(item)
            continue
        name = flag[2:]
        text = inline if eq else next(items, "")
        if not _NAME.fullmatch(name):
            raise ConfigError(f"usage error: {flag}: a setup's name is a word (--a, --ddp)")
        if any(s.name == name for s in setups):
            raise ConfigError(f"usage error: {flag}: setup given twice")
        group = tuple(part.strip() for part in _NEXT_KEY.split(text))
        if not text or text.startswith("--"):
            raise ConfigError(f"usage error: {flag}: expected section.key=value[,...] after it")
        setups.append(Setup(name=name, overrides=group))
    return rest, setups


def base_config(config_path: str | None, overrides: Sequence[str]) -> Config:
    """The config every setup starts from: the file's, or the built-in defaults."""
    if config_path:
        return load_config(config_path, overrides)
    return decode_config(apply_overrides({}, overrides))


def setup_configs(base: Config, setups: Sequence[Setup]) -> list[Config]:
    """Each setup's config: its group applied over ``base``; a ConfigError (one line
    naming the key) for a key outside ``SETUP_SECTIONS``, model.path, an unknown key or
    a value its section refuses, or fewer than two setups."""
    if len(setups) < 2:
        raise ConfigError(f"usage error: async-rl compare needs two or more setups "
                          f"(--a trainer.backend=ddp --b trainer.backend=fsdp2), "
                          f"got {len(setups)}")
    raw = msgspec.to_builtins(base)
    configs = []
    for setup in setups:
        for item in setup.overrides:
            key = item.partition("=")[0].strip()
            if "=" in item and (key.split(".")[0] not in SETUP_SECTIONS
                                or key == "model.path"):
                raise ConfigError(f"config error: {key}: a setup (--{setup.name}) may set "
                                  f"only {' and '.join(SETUP_SECTIONS)} keys, "
                                  "not model.path")
        configs.append(decode_config(apply_overrides(raw, setup.overrides)))
    return configs


def fixed_batch(base: Config, seed: int) -> list[Group]:
    """The batch every setup trains: ``trainer.groups_per_step`` groups of
    ``rollout.group_size`` long-tail-shaped sequences."""
    size = base.rollout.group_size
    return long_tail_groups(base.trainer.groups_per_step * size, seed=seed, group_size=size)


def within(a: float, b: float, tolerance: float) -> bool:
    """``|a - b| <= tolerance * max(1, |b|)``: relative above 1, absolute below."""
    return abs(a - b) <= tolerance * max(1.0, abs(b))


def agreement(setup: SetupFigures, first: SetupFigures, tolerance: float) -> bool:
    """Every step's loss and gradient norm within ``tolerance`` of the first setup's,
    and every parameter within it after the steps."""
    pairs = [*zip(setup.losses, first.losses, strict=True),
             *zip(setup.grad_norms, first.grad_norms, strict=True)]
    return (all(within(a, b, tolerance) for a, b in pairs)
            and setup.max_param_diff <= tolerance)


def summarise_setup(setup: Setup, shards: Sequence[ShardFigures], first: SetupFigures | None,
                    tolerance: float) -> SetupFigures:
    """One setup's row from its shards' figures (``first``: the first setup's row, or
    None for the first setup itself)."""
    steps = list(zip(*(s.results for s in shards), strict=True))
    figures = SetupFigures(
        name=setup.name, overrides=setup.overrides,
        step_s=statistics.median(max(t) for t in zip(*(s.step_s for s in shards),
                                                     strict=True)),
        peak_rss_mb=max(s.peak_rss_mb for s in shards),
        peak_rss_mb_per_shard=[s.peak_rss_mb for s in shards],
        rss_setup_mb=[s.rss_setup_mb for s in shards],
        losses=[_loss(merge_stats([r.loss for r in step])) for step in steps],
        grad_norms=[step[0].grad_norm for step in steps],
        max_param_diff=shards[0].max_param_diff or 0.0, agree=True)
    if first is None:
        return figures
    return msgspec.structs.replace(figures, agree=agreement(figures, first, tolerance))


def _loss(stats: Any) -> float:
    return float(stats.loss_sum / max(stats.tokens, 1))


def compare(base: Config, setups: Sequence[Setup], *, steps: int, seed: int,
            tolerance: float) -> Comparison:
    """Runs every setup on the same fixed batch, one after another."""
    configs = setup_configs(base, setups)
    groups = fixed_batch(base, seed)
    rows: list[SetupFigures] = []
    parameters = 0
    with tempfile.TemporaryDirectory(prefix="async-rl-compare-") as root:
        for setup, config in zip(setups, configs, strict=True):
            batches, _ = shard_batches(groups, config.trainer.num_shards, config.trainer,
                                       step=1, max_new_tokens=config.rollout.max_new_tokens)
            shards = run_setup(model=config.model, trainer=config.trainer,
                               rollout=config.rollout, seed=seed, batches=batches,
                               steps=steps, reference=Path(root) / "reference.pt",
                               timeout_s=config.trainer.step_timeout_s * (steps + 2))
            parameters = shards[0].parameters
            rows.append(summarise_setup(setup, shards, rows[0] if rows else None, tolerance))
    lengths = [n for g in groups for n in g.sequence_lengths]
    return Comparison(agree=all(r.agree for r in rows), tolerance=tolerance,
                      parameters=parameters, sequences=len(lengths), tokens=sum(lengths),
                      steps=steps, setups=rows)


def comparison_table(result: Comparison, shards: int) -> Table:
    """The comparison as one table, ratios to the first setup (the CLI prints it)."""
    from rich.table import Table

    first = result.setups[0]
    table = Table(title=(
        f"the same {result.sequences} sequences ({result.tokens} tokens), 1 warm-up + "
        f"{result.steps} timed steps, {result.parameters / 1e6:.1f}M parameters, "
        f"{shards} shards; agree: losses and grad norms within {result.tolerance:g} of "
        f"{first.name}'s (relative above 1), parameters within {result.tolerance:g}"))
    for column in ("setup", "keys", "step s", "x", "peak RSS MB/shard", "x",
                   "RSS after setup MB", "loss per step", "grad norm per step",
                   "max |dparam|", "agree"):
        table.add_column(column, justify="right")
    for r in result.setups:
        table.add_row(
            r.name, " ".join(r.overrides), f"{r.step_s:.3f}", f"{r.step_s / first.step_s:.2f}",
            "/".join(f"{m:.0f}" for m in r.peak_rss_mb_per_shard),
            f"{r.peak_rss_mb / first.peak_rss_mb:.2f}",
            "/".join(f"{m:.0f}" for m in r.rss_setup_mb),
            " ".join(f"{v:.6g}" for v in r.losses), " ".join(f"{v:.5g}" for v in r.grad_norms),
            f"{r.max_param_diff:.2g}", "yes" if r.agree else "NO")
    return table


def to_json(result: Comparison) -> str:
    """The comparison as one line of JSON (``agree``, ``setups``: ``name``, ``step_s``,
    ``peak_rss_mb``, ``losses``, ...)."""
    return msgspec.json.encode(result).decode()
