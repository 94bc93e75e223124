"""The run directory: resolved config, experiment record, per-step metrics, the prompt
ledger, evaluations, the summary.

Owns: file names and formats of a run's outputs (TOML, JSONL of msgspec records, JSON),
and handing metrics, evaluations and the summary on to the optional loggers of
``run.loggers`` (metrics.jsonl is always written and stays the source of truth).
Knows nothing about how the figures are produced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import msgspec

from async_rl.config import Config
from async_rl.config_io import to_toml
from async_rl.run.loggers import open_loggers, scalars, summary_scalars
from async_rl.run.run_record import AutopilotChange, RunRecord, collect, now
from async_rl.run.summary import EvalPoint, RunSummary
from buffers.common.reports import LedgerEntry
from workers.common.spans import SessionSpan, Span
from workers.layout import WorkerIdentity

CONFIG = "config.toml"
METRICS = "metrics.jsonl"
LEDGER = "ledger.jsonl"
SUMMARY = "summary.json"
EVALS = "eval.jsonl"
SPANS = "spans.jsonl"
SESSIONS = "sessions.jsonl"
USAGE = "usage.json"
WORKERS = "workers.json"
RUN_RECORD = "run.json"
WORKERS_LOG = "workers.log"
FINAL_MODEL = "final_model"


class FilePositions(msgspec.Struct, frozen=True, kw_only=True):
    """Lines in each of a run's JSONL files at one moment (a checkpoint's)."""

    metrics: int
    ledger: int
    evals: int


class RunWriter:
    """Appends a run's records to its directory as they happen (crash-safe: line-flushed,
    unless ``line_flushed=False``).

    Writes run.json (the experiment record) when created and again, with the end time,
    when closed.
    """

    def __init__(self, out_dir: str | Path, config: Config,
                 positions: FilePositions | None = None, simulated: str = "", *,
                 line_flushed: bool = True,
                 on_metrics: Callable[[dict[str, Any]], None] | None = None) -> None:
        """A new run directory, or with ``positions`` an existing one continued from a
        checkpoint: each JSONL file cut back to the lines it had then, appended after.
        ``simulated``: the hardware of a simulated run, recorded in run.json.
        ``line_flushed=False``: the JSONL files are written in blocks, complete once
        closed (a simulation: it is rerun rather than resumed, and a flush per ledger
        event is a system call per event). ``on_metrics``: called with each step's row once
        it is written, on the thread that wrote it (the orchestrator's event loop): how a
        benchmark times steps as they land."""
        self.path = Path(out_dir)
        self._on_metrics = on_metrics
        self._line_flushed = line_flushed
        self.path.mkdir(parents=True, exist_ok=True)
        start = positions or FilePositions(metrics=0, ledger=0, evals=0)
        # Lines written to each JSONL file so far: plain counters on the per-event path.
        self._lines = {"metrics": start.metrics, "ledger": start.ledger, "evals": start.evals}
        self._metrics = self._open(METRICS, start.metrics, positions is not None)
        self._ledger = self._open(LEDGER, start.ledger, positions is not None)
        self._evals = self._open(EVALS, start.evals, positions is not None)
        (self.path / CONFIG).write_text(to_toml(config))
        self._encoder = msgspec.json.Encoder()
        self.record = msgspec.structs.replace(collect(config), simulated=simulated)
        self._write_record()
        self._loggers = open_loggers(config.run.loggers, self.path, config)

    def _open(self, name: str, keep: int, resume: bool) -> IO[bytes]:
        path = self.path / name
        if resume:
            path.write_bytes(b"".join(path.read_bytes().splitlines(keepends=True)[:keep]))
        return open(path, "ab" if resume else "wb")

    @property
    def positions(self) -> FilePositions:
        """Lines written to each JSONL file so far (what a checkpoint records)."""
        return FilePositions(**self._lines)

    def _write_record(self) -> None:
        (self.path / RUN_RECORD).write_bytes(msgspec.json.format(self._encoder.encode(self.record)))

    def _append(self, file: IO[bytes], name: str, record: Any) -> None:
        file.write(self._encoder.encode(record) + b"\n")
        if self._line_flushed:
            file.flush()
        self._lines[name] += 1

    def metrics(self, row: dict[str, Any]) -> None:
        self._append(self._metrics, "metrics", row)
        if self._loggers:
            values = scalars(row, "train")
            for logger in self._loggers:
                logger.metrics(row["step"], values)
        if self._on_metrics is not None:
            self._on_metrics(row)

    def autopilot(self, changes: Sequence[AutopilotChange]) -> None:
        """run.json again, with the autopilot's changes so far (a crashed run keeps them)."""
        self.record = msgspec.structs.replace(self.record, autopilot=tuple(changes))
        self._write_record()

    def ledger(self, entry: LedgerEntry) -> None:
        self._append(self._ledger, "ledger", entry)

    def eval(self, point: EvalPoint) -> None:
        self._append(self._evals, "evals", point)
        for logger in self._loggers:
            logger.eval(point)

    def spans(self, spans: list[Span]) -> None:
        (self.path / SPANS).write_bytes(b"".join(self._encoder.encode(s) + b"\n" for s in spans))

    def sessions(self, sessions: list[SessionSpan]) -> None:
        """The agent sessions the rollout workers kept for the trace (an agent task's;
        no file without any)."""
        if sessions:
            (self.path / SESSIONS).write_bytes(
                b"".join(self._encoder.encode(s) + b"\n" for s in sessions))

    def workers(self, registry: Sequence[Any]) -> None:
        """Who ran where: one record per worker (role, rank, node, devices, pid), written
        at the start and again when ``[autopilot]`` adds or removes an engine (each
        engine it added has a row of its own, marked added and removed after a step)."""
        (self.path / WORKERS).write_bytes(msgspec.json.format(self._encoder.encode(registry)))

    def usage(self, usage: dict[str, Any]) -> None:
        """Per-worker OS/driver counters at the start and end of training."""
        (self.path / USAGE).write_bytes(msgspec.json.format(self._encoder.encode(usage)))

    def summary(self, summary: RunSummary) -> None:
        (self.path / SUMMARY).write_bytes(msgspec.json.format(self._encoder.encode(summary)))
        if self._loggers:
            values = summary_scalars(summary)
            for logger in self._loggers:
                logger.summary(values)

    def close(self) -> None:
        self._metrics.close()
        self._ledger.close()
        self._evals.close()
        for logger in self._loggers:
            logger.close()
        self.record = msgspec.structs.replace(self.record, ended=now())
        self._write_record()


def read_ledger(run_dir: str | Path) -> list[LedgerEntry]:
    decoder = msgspec.json.Decoder(LedgerEntry)
    lines = (Path(run_dir) / LEDGER).read_bytes().splitlines()
    return [decoder.decode(line) for line in lines if line]


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    lines = (Path(run_dir) / METRICS).read_bytes().splitlines()
    return [msgspec.json.decode(line) for line in lines if line]


def read_evals(run_dir: str | Path) -> list[EvalPoint]:
    decoder = msgspec.json.Decoder(EvalPoint)
    lines = (Path(run_dir) / EVALS).read_bytes().splitlines()
    return [decoder.decode(line) for line in lines if line]


def read_workers(run_dir: str | Path) -> list[WorkerIdentity]:
    """The run's worker registry (workers.json); empty when it has none."""
    path = Path(run_dir) / WORKERS
    if not path.exists():
        return []
    return msgspec.json.decode(path.read_bytes(), type=list[WorkerIdentity])


def read_sessions(run_dir: str | Path) -> list[SessionSpan]:
    """The agent sessions kept for the trace (sessions.jsonl); empty when it has none."""
    path = Path(run_dir) / SESSIONS
    if not path.exists():
        return []
    return msgspec.json.Decoder(SessionSpan).decode_lines(path.read_bytes())


def read_summary(run_dir: str | Path) -> RunSummary:
    return msgspec.json.decode((Path(run_dir) / SUMMARY).read_bytes(), type=RunSummary)


def read_record(run_dir: str | Path) -> RunRecord | None:
    """The run's experiment record; None for runs written before run.json existed."""
    path = Path(run_dir) / RUN_RECORD
    return msgspec.json.decode(path.read_bytes(), type=RunRecord) if path.exists() else None
