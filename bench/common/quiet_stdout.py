"""Keeps a benchmark's stdout for its one JSON object, or its tables.

Owns ``stdout_to_stderr``: while it is open, file descriptor 1 points at stderr, so the
output of everything running meanwhile (vLLM engine processes, Ray workers' forwarded
logs, the controller's tables) goes to stderr, and ``--json`` output stays parseable.
Also the options every benchmark of whole runs takes (``add_run_options``) and how it
shows its result (``show``: the JSON object, or the tables at a width that does not
fold them).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
from rich.console import Console


@contextmanager
def stdout_to_stderr(enabled: bool = True) -> Iterator[None]:
    """Points fd 1 at stderr for the block (a no-op when ``enabled`` is false)."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def add_run_options(parser: argparse.ArgumentParser, *, config: str, steps: int,
                    out_dir: str) -> None:
    """--config, --steps, --set, --out-dir and --json, with these defaults."""
    parser.add_argument("--config", default=config)
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps per run")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="config override (repeatable)")
    parser.add_argument("--out-dir", default=out_dir)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")


def show(result: Any, as_json: bool, tables: Callable[[Any, Console], None]) -> None:
    """One JSON object on stdout, or ``tables`` printed to the console."""
    if as_json:
        print(msgspec.json.encode(result).decode())
        return
    console = Console()
    # Piped to a file rich assumes 80 columns, which folds the tables: widen it.
    tables(result, console if console.is_terminal else Console(width=160))
