"""The tuning benchmarks' real runs: one ``async-rl train`` process per run, each alone
on the machine when a lock file is given (``flock``: other jobs taking the same lock run
between the runs, never beside them), its wall time counting only the run."""

from __future__ import annotations

import argparse
import fcntl
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import msgspec


@contextmanager
def machine(lock: str) -> Iterator[None]:
    """The machine to one run alone: a flock on ``lock`` ("": none)."""
    if not lock:
        yield
        return
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def train(config: str, run_dir: Path, steps: int, sets: Sequence[str], lock: str) -> float:
    """``async-rl train config`` for ``steps`` steps into ``run_dir``; its wall seconds."""
    command = [sys.executable, "-m", "async_rl.cli", "train", config, "--overwrite",
               "--set", f"run.num_steps={steps}",
               "--set", f"run.output_dir={msgspec.json.encode(str(run_dir)).decode()}"]
    command += [arg for item in sets for arg in ("--set", item)]
    with machine(lock):
        began = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        return time.perf_counter() - began


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """``--set`` (``sets``: overrides of every run) and ``--lock`` (see ``machine``)."""
    parser.add_argument("--set", action="append", default=[], dest="sets",
                        metavar="KEY=VALUE", help="override for every run")
    parser.add_argument("--lock", default="", help="run each run under flock FILE")


def add_order_options(parser: argparse.ArgumentParser) -> None:
    """``--once`` (each setup once: A B) and ``--reverse`` (with it, B A: a second call
    completes an A B B A)."""
    parser.add_argument("--once", action="store_true", help="each setup once: A B")
    parser.add_argument("--reverse", action="store_true",
                        help="with --once: B A (a second call completes an A B B A)")


def ordered_runs(setups: Sequence[str], out: str, once: bool, reverse: bool
                 ) -> list[tuple[str, Path]]:
    """Each run's setup and folder in order: A B B A, or A B / B A with ``once``; the
    folders numbered so that the two halves of an A B B A do not overwrite each other."""
    order = list(setups) if once else [*setups, *reversed(setups)]
    if once and reverse:
        order.reverse()
    return [(name, Path(out) / f"{index + 2 * reverse}-{name.replace(' ', '-')}")
            for index, name in enumerate(order)]
