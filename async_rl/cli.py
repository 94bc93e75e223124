"""The `async-rl` command line: config show, make-model, train, simulate, tune, report,
sweep, compare.

Owns: each command's handler (its grammar is ``async_rl.cli_parser``) and turning user
errors into exit status 2 with one line. Knows nothing about how a run works; each
command calls one function of the library (`train` is the Python API's
``async_rl.api.train``), imported late so that `async-rl config show` does not pay for
importing torch, Ray or vLLM.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from async_rl import cli_parser
from async_rl.api import train
from async_rl.config import Config
from async_rl.config_io import load_config, to_toml
from async_rl.run.run_dir import CONFIG, SPANS
from buffers.common.config import ConfigError

if TYPE_CHECKING:
    from async_rl.compare import Setup


def _make_real_size(args: argparse.Namespace) -> int:
    from async_rl.models.real_size import REAL_SIZES, make_random_model

    threads = args.threads or min(2, os.cpu_count() or 1)
    if args.sft_steps:
        raise ConfigError(f"usage error: --size {args.size} is randomly initialised: "
                          "it takes no --sft-steps")
    made = make_random_model(args.out, size=REAL_SIZES[args.size], seed=args.seed,
                             num_threads=threads)
    print(f"model written to {made.path}: {made.num_parameters:,} parameters, "
          f"random weights, {made.seconds:.1f}s")
    return 0


def _make_family(args: argparse.Namespace) -> int:
    from async_rl.models.families import ARCHITECTURES, build_family_model

    if args.arch not in ARCHITECTURES:
        raise ConfigError(f"usage error: --arch {args.arch}: not an architecture make-model "
                          f"builds ({', '.join(ARCHITECTURES)})")
    if args.size or args.sft_steps:
        raise ConfigError(f"usage error: --arch {args.arch} is randomly initialised: it takes "
                          "no --size or --sft-steps")
    start = time.perf_counter()
    out = build_family_model(args.arch, args.out, seed=args.seed)
    print(f"model written to {out}: a tiny {args.arch}, {_stored_parameters(out):,} "
          f"parameters, random weights, {time.perf_counter() - start:.1f}s")
    return 0


def _stored_parameters(model_dir: Path) -> int:
    """Parameters in a model folder's safetensors files."""
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as stored:
            total += sum(math.prod(stored.get_slice(name).get_shape())
                         for name in stored.keys())  # noqa: SIM118 (not a dict)
    return total


def stop_exit(stopped_by: str) -> int:
    """Exit status of a run stopped by the signal named: 128 + its number, as shells do
    (SIGINT 130, SIGTERM 143, SIGUSR1 138); 1 for any other stop."""
    member = signal.Signals.__members__.get(stopped_by)
    return 128 + member.value if member is not None else 1


def _train_config(args: argparse.Namespace) -> Config:
    """The run's config: the file's, or with --resume the run directory's own."""
    if args.resume:
        if args.config:
            raise ConfigError("usage error: give a config file or --resume RUN_DIR, not both")
        saved = Path(args.resume) / CONFIG
        if not saved.is_file():
            raise ConfigError(f"resume error: {args.resume}: no {CONFIG} (not a run directory)")
        return load_config(saved, [*args.overrides, f"run.output_dir={args.resume}"])
    if not args.config:
        raise ConfigError("usage error: async-rl train needs a config file or --resume RUN_DIR")
    return load_config(args.config, args.overrides)


def _train(args: argparse.Namespace) -> int:
    config = _train_config(args)
    out = config.run.output_dir
    try:
        summary = train(config, overwrite=args.overwrite, resume=bool(args.resume),
                        verbose=args.verbose)
    except ConfigError:
        raise
    except Exception as err:
        # Imported only now: train checks its inputs before it imports torch, Ray or vLLM.
        from async_rl.control.checkpoint_files import CheckpointError
        from async_rl.control.failures import RunFailed
        from async_rl.shell.ray_shell import RunInterrupted

        if isinstance(err, CheckpointError):
            print(f"resume error: {err}", file=sys.stderr)
            return 2
        if isinstance(err, RunFailed):
            print(f"run failed: {err}; async-rl train --resume {out} continues from the "
                  f"last checkpoint", file=sys.stderr)
            return 1
        if isinstance(err, RunInterrupted):
            print(f"stopped at once by {err}: no checkpoint of the step in progress; "
                  f"async-rl train --resume {out} continues from the last one, if any",
                  file=sys.stderr)
            return stop_exit(str(err))
        raise
    from async_rl.analysis.report import print_report

    if config.run.record_spans:
        print_report(out)
    print(f"accuracy {summary.accuracy_start} -> {summary.accuracy_end}; run directory {out}")
    if summary.stopped:
        print(f"stopped by {summary.stopped} after step {summary.steps}: "
              f"async-rl train --resume {out} continues it", file=sys.stderr)
        return stop_exit(summary.stopped)
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from async_rl.sim.calibrate import calibrate

    sets = [*args.overrides, *([f"simulate.hardware={_toml_string(args.hardware)}"]
                               if args.hardware else []),
            *([f"simulate.lengths={_toml_string(args.lengths)}"] if args.lengths else [])]
    if args.calibrate:
        if args.config:
            raise ConfigError("usage error: give a config file or --calibrate RUN_DIR, not both")
        out = args.out or str(Path(args.calibrate) / "hardware.toml")
        fit = calibrate(args.calibrate, out, sets)
        print(fit.describe())
        print(f"hardware file written: {out}")
        return 0
    if not args.config:
        raise ConfigError("usage error: async-rl simulate needs a config file or --calibrate")
    from async_rl.analysis.report import print_report
    from async_rl.analysis.results import result_table
    from async_rl.analysis.tables import wide_console
    from async_rl.api import simulate

    config = load_config(args.config, sets)
    summary = simulate(config, overwrite=args.overwrite)
    if config.run.record_spans:
        print_report(config.run.output_dir)
    else:  # no spans: no idle accounting, the rest of the result
        wide_console().print(result_table(Path(config.run.output_dir), ()))
    print(f"simulated on {config.simulate.hardware}: accuracy is not simulated; "
          f"run directory {config.run.output_dir}")
    return 0 if not summary.stopped else 1


def _toml_string(text: str) -> str:
    """A path or name as a TOML string value of ``--set``."""
    import json

    return json.dumps(text)


class ConsoleLines(logging.Handler):
    """The library's log records as the plain lines the command prints (``sys.stdout``
    looked up at each line, so the progress bar's redirection of it applies)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), flush=True)
        except Exception:
            self.handleError(record)


def console_logging() -> None:
    """The ``async_rl`` loggers' INFO and above on the console, as plain lines."""
    logger = logging.getLogger("async_rl")
    if not any(isinstance(h, ConsoleLines) for h in logger.handlers):
        logger.addHandler(ConsoleLines())
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _compare(args: argparse.Namespace, setups: list[Setup]) -> int:
    from async_rl.compare import base_config, compare, comparison_table, to_json
    from workers.trainer.compare import SetupFailed

    sets = [*args.overrides, *([f"model.path={_toml_string(args.model)}"] if args.model
                               else []),
            *([f"trainer.num_shards={args.shards}"] if args.shards else [])]
    base = base_config(args.config, sets)
    try:
        result = compare(base, setups, steps=args.steps, seed=args.seed,
                         tolerance=args.tolerance)
    except SetupFailed as err:
        print(f"compare failed: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(to_json(result))
    else:
        from rich.console import Console

        console = Console()
        (console if console.is_terminal else Console(width=200)).print(
            comparison_table(result, base.trainer.num_shards))
        print(f"agree: {'yes' if result.agree else 'no'}")
    return 0


def _option_strings(parser: argparse.ArgumentParser, command: str) -> set[str]:
    """The option strings of one subcommand (``async-rl compare``'s: the rest of its
    ``--NAME`` arguments are setups)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {s for a in action.choices[command]._actions for s in a.option_strings}
    raise AssertionError(f"no subcommand {command}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli_parser.parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        setups: list[Setup] = []
        if argv[:1] == ["compare"]:
            from async_rl.compare import split_setups

            argv, setups = split_setups(argv, _option_strings(parser, "compare"))
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    console_logging()
    try:
        if args.command == "compare":
            return _compare(args, setups)
        if args.command == "config":
            print(to_toml(load_config(args.config, args.overrides)), end="")
            return 0
        if args.command == "make-model":
            if args.arch is not None:
                return _make_family(args)
            if args.size == "0.5b":
                return _make_real_size(args)
            from async_rl.models.tiny_model import MODEL_SIZES, TASK_RECIPES, make_model

            recipe = TASK_RECIPES[args.task]
            size = MODEL_SIZES[args.size or recipe.default_size]
            threads = args.threads or (1 if size.name == "tiny" else min(2, os.cpu_count() or 1))
            made = make_model(args.out, size=size, task=recipe, seed=args.seed,
                              sft_steps=args.sft_steps, num_threads=threads)
            print(
                f"model written to {made.path}: {made.num_parameters:,} parameters, "
                f"base accuracy {made.base_accuracy:.3f}, {made.seconds:.1f}s"
            )
            return 0
        if args.command == "train":
            return _train(args)
        if args.command == "simulate":
            return _simulate(args)
        if args.command == "tune":
            from async_rl.analysis.tables import wide_console
            from async_rl.tuning.tune import tune

            if args.budget_s <= 0:
                raise ConfigError(f"usage error: --budget-s {args.budget_s:g}: must be "
                                  "positive")
            tuned = tune(args.config, out=args.out, allow=args.allow, sets=args.overrides,
                         budget_s=args.budget_s, simulate_only=args.simulate_only,
                         console=wide_console())
            print(f"tuned config written: {tuned.out} ({tuned.seconds:.0f} s)")
            return 0
        if args.command == "report":
            from async_rl.analysis.report import compare, print_record, print_report

            missing = [r for r in args.runs if not (Path(r) / SPANS).exists()]
            if missing:
                print(f"report error: {missing[0]}: no {SPANS} (not a run directory)",
                      file=sys.stderr)
                return 2
            if len(args.runs) == 1:
                print_record(args.runs[0])
                print_report(args.runs[0], every=args.every)
            else:
                compare(args.runs)
            return 0
        if args.command == "sweep":
            from async_rl.analysis.sweep import parse_grid, run_sweep

            config = load_config(args.config, args.overrides)
            out = args.out or f"{config.run.output_dir}-sweep"
            run_sweep(args.config, parse_grid(args.grid), out=out, steps=args.steps,
                      repeat=args.repeat, overrides=args.overrides, simulate=args.simulate)
            return 0
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return 2
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
