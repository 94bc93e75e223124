"""Calibration: fitting a machine's hardware file to one real run's spans and metrics.

Owns: ``calibrate`` (``async-rl simulate --calibrate RUN_DIR``) and what it measures of a
real run (``Measured``). The physical figures (peak FLOP/s, memory bandwidth) stay those
of the base hardware file; fitted are

- the trainer: each step's ``train_s`` against its tokens and the rollout engines
  generating beside it (least squares: a fixed part per update, the rest per token,
  which gives the training MFU, and how much each busy engine slows it: the
  contention; a CPU run's machine is laid out with this machine's cores);
- the weight path: the median snapshot, transfer and load times of its broadcasts
  (the interconnect bandwidth is the bytes a pipelined broadcast to the engines a
  version went to puts on its last link, over the transfer time: ``Costs.transfer``);
- rollout: the engine's fixed seconds per step and its decode MFU, by simulating the
  run's own config (its own generated lengths, from its ledger) until the simulated
  engine is busy as long per group as the real one was and a group takes as long from
  admission to its return: for each decode MFU on a grid, bisection on the step time
  (keeping the step time whose busy time came closest), then the MFU whose group
  latency is closest.

Knows nothing about the orchestrator: it runs ``async_rl.sim.run.simulate``.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np

from async_rl.analysis.report import idle_of, read_spans
from async_rl.config import Config
from async_rl.config_io import load_config
from async_rl.run.run_dir import CONFIG, read_ledger, read_metrics, read_summary
from async_rl.sim.costs import Costs
from async_rl.sim.hardware_file import Hardware, hardware_toml
from async_rl.sim.roles import step_passes
from async_rl.sim.run import simulate, simulation_costs
from buffers.common.reports import LedgerEntry
from workers.common.spans import Span

DECODE_MFUS = (0.01, 0.03, 0.1, 0.3, 1.0)
"""The decode MFUs tried (a CPU engine's small batches are far from peak)."""
BISECTIONS = 8


class Measured(msgspec.Struct, frozen=True, kw_only=True):
    """What a run shows of its rollout engines (real or simulated)."""

    groups_per_s: float
    rollout_busy_per_group: float
    """Generating seconds of all engines per group generated."""
    group_latency_s: float
    """Mean seconds from a prompt's admission to its group's return."""


def measure(run_dir: str | Path) -> Measured:
    path = Path(run_dir)
    summary = read_summary(path)
    idle, _ = idle_of(read_spans(path))
    rollout = next(r for r in idle.roles if r.role == "rollout")
    admitted: dict[tuple[str, int], float] = {}
    latencies = []
    for entry in read_ledger(path):
        key = (entry.prompt_id, entry.attempt)
        if entry.event == "admitted":
            admitted[key] = entry.time
        elif entry.event == "generated" and key in admitted:
            latencies.append(entry.time - admitted.pop(key))
    generated = summary.groups_generated or summary.groups_trained
    return Measured(groups_per_s=summary.groups_per_s,
                    rollout_busy_per_group=rollout.busy_s / max(generated, 1),
                    group_latency_s=statistics.fmean(latencies) if latencies else 0.0)


class Fit(msgspec.Struct, frozen=True, kw_only=True):
    hardware: Hardware
    real: Measured
    simulated: Measured

    def describe(self) -> str:
        h, real, sim = self.hardware, self.real, self.simulated
        return "\n".join([
            f"trainer: {h.update_s * 1e3:.1f} ms per update + tokens at train_mfu "
            f"{h.train_mfu:.4f} of {h.peak_flops:.3g} FLOP/s, {h.contention:.2f} slower "
            f"per engine busy beside it ({h.cores or 'no'} cores laid out)",
            f"weights: publish {h.publish_s * 1e3:.1f} ms, interconnect "
            f"{h.interconnect_bandwidth:.3g} B/s, load pause {h.weight_load_s * 1e3:.1f} ms",
            f"rollout: {h.decode_step_s * 1e3:.2f} ms per engine step, decode_mfu "
            f"{h.decode_mfu:.4f}",
            f"real vs simulated: groups/s {real.groups_per_s:.2f} vs {sim.groups_per_s:.2f}; "
            f"rollout busy per group {real.rollout_busy_per_group * 1e3:.1f} vs "
            f"{sim.rollout_busy_per_group * 1e3:.1f} ms; group latency "
            f"{real.group_latency_s:.3f} vs {sim.group_latency_s:.3f} s",
        ])


def generating_beside(spans: Sequence[Span]) -> dict[int, float]:
    """Per step, how many rollout engines were generating, on average, while trainer
    shard 0 computed it (its forward and backward spans; a step's spans carry the
    version it trains from, one less than the step)."""
    computing: dict[int, list[tuple[float, float]]] = {}
    for span in spans:
        if span.worker == "trainer-0" and span.cause in ("forward", "backward"):
            computing.setdefault(span.version + 1, []).append((span.start, span.end))
    generating = [(s.start, s.end) for s in spans
                  if s.role == "rollout" and s.cause == "generate"]
    beside = {}
    for step, stretches in computing.items():
        busy = sum(end - start for start, end in stretches)
        both = sum(max(0.0, min(end, g_end) - max(start, g_start))
                   for start, end in stretches for g_start, g_end in generating)
        beside[step] = both / busy if busy > 0 else 0.0
    return beside


def trained_lengths(rows: Sequence[dict[str, object]],
                    ledger: Sequence[LedgerEntry]) -> list[int]:
    """The run's sequences as the trainer saw them, near enough for attention's share:
    each generated completion (ledger) after the mean prompt (metrics: a step's members'
    tokens less their completions)."""
    samples = tokens = completions = 0.0
    for row in rows:
        count = float(row["samples"])  # type: ignore[arg-type]
        mean = row["completion_tokens"] or {"mean": 0.0}
        samples += count
        tokens += float(row["tokens"])  # type: ignore[arg-type]
        completions += count * float(mean["mean"])  # type: ignore[index]
    prompt = (tokens - completions) / max(samples, 1.0)
    return [round(prompt) + n for e in ledger if e.event == "generated" for n in e.lengths]


def _fit_trainer(config: Config, rows: Sequence[dict[str, object]], base: Hardware,
                 parameters: float, beside: dict[int, float]) -> Hardware:
    """Least squares of ``train_s`` on a fixed part (when the tokens vary enough to tell
    it apart), tokens, and tokens times the engines generating beside (when some steps
    had them and some did not: the contention)."""
    steps = rows[2:] if len(rows) > 4 else rows  # the first steps run cold
    train = np.array([float(r["train_s"]) for r in steps])  # type: ignore[arg-type]
    tokens = np.array([float(r["tokens_trained"]) for r in steps])  # type: ignore[arg-type]
    engines = np.array([beside.get(int(r["step"]), 0.0) for r in steps])  # type: ignore[call-overload]
    updates = config.trainer.mini_batches * config.trainer.epochs
    # The base file's contention, when it has one, is the machine's: kept, not fitted.
    contention = base.contention
    work = tokens * (1 + contention * engines)
    per_token, fixed = float(np.median(train / work)), 0.0
    columns = {"tokens": work}
    if tokens.std() > 0.1 * tokens.mean():  # enough spread to split fixed from per-token
        columns["fixed"] = np.ones_like(tokens)
    if engines.std() > 0.1 and not contention:
        columns["beside"] = tokens * engines
    while len(columns) > 1:
        fit = dict(zip(columns, np.linalg.lstsq(np.column_stack(list(columns.values())),
                                                train, rcond=None)[0], strict=True))
        if fit["tokens"] > 0 and fit.get("fixed", 0.0) >= 0 and fit.get("beside", 0.0) >= 0:
            per_token, fixed = float(fit["tokens"]), float(fit.get("fixed", 0.0))
            contention = float(fit["beside"]) / per_token if "beside" in fit else contention
            break
        # A negative part means the columns could not be told apart: one fewer.
        columns.pop("fixed" if "fixed" in columns else "beside")
    # parameters: the model's, grown by attention's share of the run's training FLOPs.
    mfu = 6 * parameters / (per_token * base.peak_flops * base.devices_per_trainer_shard)
    return msgspec.structs.replace(base, train_mfu=mfu, micro_batch_s=0.0,
                                   update_s=max(fixed / updates - base.call_s, 0.0),
                                   contention=contention)


def _fit_weights(rows: Sequence[dict[str, object]], base: Hardware,
                 weight_bytes: float, bucket_bytes: float) -> Hardware:
    timings = [t for r in rows for t in r["broadcast"]]  # type: ignore[attr-defined]
    if not timings:
        return base
    def median(key: str) -> float:
        return statistics.median(float(t[key]) for t in timings)

    copy = weight_bytes / (base.memory_bandwidth * base.memory_efficiency)
    # A version is one pipelined broadcast to its engines (Costs.transfer, inverted).
    receivers = statistics.median(Counter(t["version"] for t in timings).values())
    wire = weight_bytes + (receivers - 1) * min(bucket_bytes, weight_bytes)
    on_wire = median("transfer_s") - receivers * base.weight_member_s
    return msgspec.structs.replace(
        base, publish_s=max(median("publish_s") - copy, 0.0),
        interconnect_bandwidth=wire / max(on_wire, 1e-6),
        weight_load_s=median("load_s") + median("pause_s"))


def calibrate(run_dir: str | Path, out: str | Path, overrides: Sequence[str] = (), *,
              mfus: Sequence[float] = DECODE_MFUS, bisections: int = BISECTIONS) -> Fit:
    """Fits the hardware file to the real run in ``run_dir`` (its config, with
    ``overrides``: simulate.hardware names the base file) and writes it to ``out``;
    ``mfus``, ``bisections``: the search's grid of decode MFUs and its steps on each."""
    path = Path(run_dir)
    has_lengths = any(e.lengths for e in read_ledger(path) if e.event == "generated")
    lengths = [f"simulate.lengths={msgspec.json.encode(str(path)).decode()}"] if has_lengths else []
    scratch = tempfile.mkdtemp(prefix="calibrate-")
    config = load_config(path / CONFIG, [*lengths, *overrides, "run.progress=false",
                                         f"run.output_dir={msgspec.json.encode(scratch).decode()}"])
    costs = simulation_costs(config)
    base, shape = costs.hardware, costs.model
    rows = read_metrics(path)
    spans = read_spans(path)
    if any(span.device.startswith("cpu:") for span in spans if span.role == "trainer"):
        # Laid out on this machine's cores: the simulation lays them out the same way.
        base = msgspec.structs.replace(base, cores=len(os.sched_getaffinity(0)))
    attention = costs.attention_share(trained_lengths(rows, read_ledger(path)))
    # A PPO run's steps hold the reference's and the critic's passes too (step_passes).
    hardware = _fit_trainer(config, rows, base,
                            shape.parameters * (1 + attention) * step_passes(config),
                            generating_beside(spans))
    hardware = _fit_weights(rows, hardware, Costs(hardware, shape).version_bytes,
                            config.weights.bucket_mb << 20)
    real = measure(path)

    def run(candidate: Hardware) -> Measured:
        quiet = logging.getLogger("async_rl.control")
        level = quiet.level
        quiet.setLevel(logging.WARNING)  # each trial's evaluation lines
        try:
            simulate(config, Costs(candidate, shape))
        finally:
            quiet.setLevel(level)
        return measure(scratch)

    def miss(got: float, want: float) -> float:
        return abs(math.log(max(got, 1e-9) / max(want, 1e-9)))

    best: tuple[float, Hardware, Measured] | None = None
    for mfu in mfus:
        low, high = 0.0, 0.1  # seconds per engine step
        # The closest step time tried, not the last midpoint: the last midpoint is only
        # somewhere in the last interval, and the simulated busy time is not monotone in
        # the step time (it changes how many sequences share an engine step).
        closest: tuple[float, Hardware, Measured] | None = None
        for _ in range(bisections):
            step = (low + high) / 2
            trial = msgspec.structs.replace(hardware, decode_mfu=mfu, decode_step_s=step)
            got = run(trial)
            busy_miss = miss(got.rollout_busy_per_group, real.rollout_busy_per_group)
            if closest is None or busy_miss < closest[0]:
                closest = (busy_miss, trial, got)
            if got.rollout_busy_per_group > real.rollout_busy_per_group:
                high = step
            else:
                low = step
        assert closest is not None, "bisections >= 1"
        _, trial, got = closest
        latency_miss = miss(got.group_latency_s, real.group_latency_s)
        if best is None or latency_miss < best[0]:
            best = (latency_miss, trial, got)
    assert best is not None
    fitted = msgspec.structs.replace(best[1], sources=(
        f"calibrated by async-rl simulate --calibrate {path} on "
        f"{read_summary(path).steps} steps of {config.task.kind}",
        *(s for s in base.sources if not s.startswith("calibrated by"))))
    Path(out).write_text(hardware_toml(fitted))
    return Fit(hardware=fitted, real=real, simulated=best[2])
