"""The `async-rl` command line's grammar: every command, its arguments and their help.

Owns: ``parser`` (the argparse tree of config show, make-model, train, simulate, tune,
report, sweep, compare) and the argument types it shares (``positive_int``,
``add_overrides``: ``--set``). Knows nothing about what a command does
(``async_rl.cli``).
"""

from __future__ import annotations

import argparse


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="async-rl", description="Asynchronous, pipelined, off-policy GRPO for LLMs."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    config = commands.add_parser("config", help="inspect a config")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser("show", help="print the resolved config as TOML")
    show.add_argument("config", help="TOML config file")
    add_overrides(show)

    make = commands.add_parser("make-model", help="build a local model (no hub)")
    make.add_argument("--out", required=True, help="output directory")
    make.add_argument(
        "--size", choices=["tiny", "small", "0.5b"], default=None,
        help="small: 4M parameters (arithmetic's default); tiny: 0.5M (longtail's and "
             "calculator's default); 0.5b: Qwen2.5-0.5B's shape, 358M, randomly "
             "initialised (no warm start: for speed and memory figures, not learning)",
    )
    make.add_argument(
        "--task", choices=["arithmetic", "longtail", "calculator"], default="arithmetic",
        help="built-in task of the warm start and base accuracy (the RL config's task.kind)",
    )
    make.add_argument(
        "--threads", type=positive_int, default=None,
        help="torch threads for the warm start (same seed and threads: same weights); "
             "default 1 for tiny, min(2, cores) for small",
    )
    make.add_argument(
        "--arch", default=None, metavar="ARCH",
        help="instead: a tiny randomly initialised model of this Hugging Face architecture "
             "(llama, qwen3_moe, mixtral, gemma2, ...: the families docs/models.md lists), "
             "fp32, with the byte tokenizer; no warm start",
    )
    make.add_argument("--seed", type=int, default=0, help="seed of weights and warm start")
    make.add_argument(
        "--sft-steps", type=int, default=None, help="supervised warm-start steps (default: tuned)"
    )

    train = commands.add_parser("train", help="run async GRPO")
    train.add_argument("config", nargs="?", help="TOML config file (not with --resume)")
    add_overrides(train)
    train.add_argument(
        "--verbose", action="store_true",
        help="show every line the workers print (default: RUN_DIR/workers.log holds them, "
             "the console shows their warnings and errors)",
    )
    existing = train.add_mutually_exclusive_group()
    existing.add_argument("--resume", metavar="RUN_DIR",
                          help="continue RUN_DIR from its newest good checkpoint, with its "
                               "config (and any --set)")
    existing.add_argument("--overwrite", action="store_true",
                          help="replace an existing run directory")

    simulate = commands.add_parser(
        "simulate", help="the run a config describes, on simulated workers and a virtual "
                         "clock (seconds for a cluster), written as a run directory; or "
                         "--calibrate a hardware file from a real run")
    simulate.add_argument("config", nargs="?", help="TOML config file (not with --calibrate)")
    add_overrides(simulate)
    simulate.add_argument("--hardware", metavar="FILE",
                          help="hardware file or shipped name (simulate.hardware)")
    simulate.add_argument("--lengths", metavar="SOURCE",
                          help="task, lognormal, empirical or a run directory "
                               "(simulate.lengths)")
    simulate.add_argument("--overwrite", action="store_true",
                          help="replace an existing run directory")
    simulate.add_argument("--calibrate", metavar="RUN_DIR",
                          help="fit this machine's hardware file to a real run's spans and "
                               "metrics (its config is the one simulated)")
    simulate.add_argument("--out", metavar="FILE",
                          help="where --calibrate writes the hardware file "
                               "(default RUN_DIR/hardware.toml)")

    tune = commands.add_parser(
        "tune", help="search the tunable keys on the simulator (calibrated by a short real "
                     "run, the best candidates checked by short real runs) and write the "
                     "tuned config, each changed key with its cause and gain")
    tune.add_argument("config", help="TOML config file")
    tune.add_argument("--budget-s", type=float, default=900.0,
                      help="seconds the whole command may take (default 900)")
    tune.add_argument("--out", default="tuned.toml",
                      help="the tuned config file (default tuned.toml)")
    tune.add_argument("--allow", action="append", default=[],
                      metavar="KEY[=LO..HI]",
                      help="also search this key (guarded keys, split, staleness above the "
                           "config's own), or search it within LO..HI (repeatable)")
    tune.add_argument("--simulate-only", action="store_true",
                      help="no real run: search on the simulator of simulate.hardware alone "
                           "(a cluster not at hand)")
    add_overrides(tune)

    report = commands.add_parser(
        "report", help="a run's record (run.json), idle table, trace and timeline; for two "
                       "runs what differs in config and record, then their figures side by side"
    )
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="one or more run directories")
    report.add_argument("--all", action="store_true", dest="every",
                        help="list every worker in the idle table (default: past 16, the "
                             "per-role rows and the most idle few of each role)")

    sweep = commands.add_parser(
        "sweep", help="train once per point of a grid of config values, one run after another"
    )
    sweep.add_argument("config", help="TOML config file")
    sweep.add_argument(
        "--grid", action="append", required=True, metavar="SECTION.KEY=V1,V2",
        help="values of one key to sweep (repeatable: every combination runs); "
             "commas inside [...] belong to a list value",
    )
    sweep.add_argument("--steps", type=positive_int, default=None,
                       help="run.num_steps of every trial")
    sweep.add_argument("--repeat", type=positive_int, default=1,
                       help="runs of each grid point (to see timing noise)")
    sweep.add_argument("--simulate", action="store_true",
                       help="simulate each trial (async-rl simulate) instead of training it")
    sweep.add_argument("--out", default=None,
                       help="sweep directory, one run directory per trial "
                            "(default: the config's run.output_dir + '-sweep')")
    add_overrides(sweep)

    compare = commands.add_parser(
        "compare", allow_abbrev=False,
        help="the same fixed batch through two or more trainer setups (--a KEY=V,KEY=V "
             "--b KEY=V ...: config keys over the base config), one table: step time, "
             "peak memory per shard, losses, grad norms, parameter difference, agreement",
    )
    compare.add_argument("config", nargs="?",
                         help="TOML config file (default: the built-in defaults)")
    add_overrides(compare)
    compare.add_argument("--model", metavar="PATH", help="model.path")
    compare.add_argument("--shards", type=positive_int, default=None,
                         help="trainer.num_shards of every setup (default: the config's)")
    compare.add_argument("--steps", type=positive_int, default=3,
                         help="timed steps per setup, after one warm-up step; the step "
                              "time is their median")
    compare.add_argument("--seed", type=int, default=0, help="seed of the batch and model")
    compare.add_argument("--tolerance", type=float, default=1e-4,
                         help="agreement: losses and grad norms within it (relative "
                              "above 1), parameters within it")
    compare.add_argument("--json", action="store_true",
                         help="one JSON object on the last line of stdout")
    return parser


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable)",
    )
