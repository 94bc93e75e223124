"""The run directory: resolved config, per-step metrics, the prompt ledger, the summary.

Owns: file names and formats of a run's outputs (TOML, JSONL of msgspec records, JSON).
Knows nothing about how the figures are produced.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

import msgspec

from async_rl.config import Config, to_toml
from async_rl.records import LedgerEntry
from async_rl.spans import Span

CONFIG = "config.toml"
METRICS = "metrics.jsonl"
LEDGER = "ledger.jsonl"
SUMMARY = "summary.json"
SPANS = "spans.jsonl"
USAGE = "usage.json"
FINAL_MODEL = "final_model"


class RunSummary(msgspec.Struct, frozen=True, kw_only=True):
    """The figures of a whole run, written to summary.json and returned to the caller."""

    steps: int
    final_version: int
    rollout_version: int
    """Oldest policy version a live rollout worker runs at the end (= final_version once
    the last broadcast has landed)."""
    wall_s: float
    groups_trained: int
    tokens_trained: int
    groups_per_s: float
    tokens_per_s: float
    accuracy_start: float | None
    accuracy_end: float | None
    staleness_histogram: tuple[int, ...]
    dropped_stale: int
    rollout_failures: int
    reward_failures: int
    nonfinite_steps: int
    retired_workers: int
    max_staleness: int


class RunWriter:
    """Appends a run's records to its directory as they happen (crash-safe: line-flushed)."""

    def __init__(self, out_dir: str | Path, config: Config) -> None:
        self.path = Path(out_dir)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / CONFIG).write_text(to_toml(config))
        self._encoder = msgspec.json.Encoder()
        self._metrics: IO[bytes] = open(self.path / METRICS, "wb")  # noqa: SIM115
        self._ledger: IO[bytes] = open(self.path / LEDGER, "wb")  # noqa: SIM115

    def metrics(self, row: dict[str, Any]) -> None:
        self._metrics.write(self._encoder.encode(row) + b"\n")
        self._metrics.flush()

    def ledger(self, entry: LedgerEntry) -> None:
        self._ledger.write(self._encoder.encode(entry) + b"\n")
        self._ledger.flush()

    def spans(self, spans: list[Span]) -> None:
        (self.path / SPANS).write_bytes(b"".join(self._encoder.encode(s) + b"\n" for s in spans))

    def usage(self, usage: dict[str, Any]) -> None:
        """Per-worker OS/driver counters at the start and end of training."""
        (self.path / USAGE).write_bytes(msgspec.json.format(self._encoder.encode(usage)))

    def summary(self, summary: RunSummary) -> None:
        (self.path / SUMMARY).write_bytes(msgspec.json.format(self._encoder.encode(summary)))

    def close(self) -> None:
        self._metrics.close()
        self._ledger.close()


def read_ledger(run_dir: str | Path) -> list[LedgerEntry]:
    decoder = msgspec.json.Decoder(LedgerEntry)
    lines = (Path(run_dir) / LEDGER).read_bytes().splitlines()
    return [decoder.decode(line) for line in lines if line]


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    lines = (Path(run_dir) / METRICS).read_bytes().splitlines()
    return [msgspec.json.decode(line) for line in lines if line]


def read_summary(run_dir: str | Path) -> RunSummary:
    return msgspec.json.decode((Path(run_dir) / SUMMARY).read_bytes(), type=RunSummary)
