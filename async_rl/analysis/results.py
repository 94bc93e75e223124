"""A run's result at a glance: what `async-rl simulate` prints, and the sweep's columns.

Owns: ``StepSplit`` (from metrics.jsonl: the mean step time split into waiting for
generation, training and the weight snapshot, over the steps after the pipeline fills,
with the mean delivery of a version into the engines beside it), ``fill_steps`` (the
steps counted as filling it: the first max_staleness + 1, when there are more),
``StalenessSplit`` (the run's staleness in flight and in queue, over its trained tokens)
and ``result_table``: throughput, the split, idle by role and cause, staleness, and what
the simulator
counted of its own (sim.json: requests queued for KV-cache room, time-shared releases,
what a stop at simulate.preemption_step costs: ``StopCost``),
in at most ``RESULT_LINES`` lines whatever the cluster size. Knows nothing about how the
run was executed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from rich.table import Table

from async_rl.analysis.idle import Breakdown
from async_rl.analysis.tables import pct
from async_rl.run.run_dir import METRICS, SUMMARY, read_metrics, read_summary

RESULT_LINES = 30
"""The most lines ``result_table`` prints (a test holds it to that)."""
SIM_STATS = "sim.json"
"""What a simulated run counted besides a real run's record (``SimStats``)."""


class StopCost(msgspec.Struct, frozen=True, kw_only=True):
    """What a stop at the end of simulate.preemption_step would keep and lose
    (``async_rl.sim.preemption``). Tokens are completion tokens; seconds, those tokens
    at the run's mean generation rate until then, all engines together."""

    step: int
    version: int
    """The checkpoint's version: the resumed run's first."""
    at_s: float
    """When (virtual seconds)."""
    generated_tokens: int
    """Every rollout's tokens generated until then (evaluations not counted)."""
    tokens_per_s: float
    """Their mean rate: generated_tokens over the seconds since the first request."""
    kept_groups: int
    """The replay queue's groups, which the checkpoint keeps."""
    kept_tokens: int
    kept_s: float
    stale_groups: int
    """Of the kept groups, those too stale to train at the checkpoint's version
    (version - oldest token's version > the queue's max_staleness): dropped on resume,
    their prompts generated again."""
    stale_tokens: int
    owed_prompts: int
    """Prompts admitted, not trained and not queued: the rollouts in flight a stop hands
    back, and those a resume generates again."""
    lost_rollouts: int
    """Of those, the ones with tokens generated and generated again on resume (finished
    and not yet in the queue; in flight, where the task is multi-turn)."""
    lost_tokens: int
    lost_s: float
    done_tokens: int
    """Tokens of groups trained or dropped before the stop: generated_tokens =
    done_tokens + kept_tokens + handed_back_tokens + lost_tokens."""
    engine_lost_tokens: tuple[int, ...] = ()
    """Each engine's tokens of the owed prompts: what that engine's death then loses (a
    clean stop of it hands its rollouts in flight to another engine)."""
    handed_back_rollouts: int = 0
    """Of the owed prompts, the rollouts in flight a clean stop hands back: a resume
    continues each from its tokens."""
    handed_back_tokens: int = 0
    handed_back_s: float = 0.0

    @property
    def regenerated(self) -> float:
        """Of the work not yet trained (kept, handed back and lost), the fraction a resume
        generates again (the lost, and the kept groups too stale to train)."""
        pending = self.kept_tokens + self.handed_back_tokens + self.lost_tokens
        return (self.lost_tokens + self.stale_tokens) / pending if pending else 0.0


def stop_cost_line(cost: StopCost) -> str:
    """One line of the result: what a stop at the end of its step costs."""
    worst = max(cost.engine_lost_tokens, default=0)
    return (f"after step {cost.step} (version {cost.version}): checkpoint keeps "
            f"{cost.kept_groups} queued groups, {cost.kept_tokens:,} tokens "
            f"({cost.kept_s:.1f} s of generation; {cost.stale_groups} too stale on "
            f"resume), hands back {cost.handed_back_rollouts} in-flight rollouts, "
            f"{cost.handed_back_tokens:,} tokens ({cost.handed_back_s:.1f} s); loses "
            f"{cost.lost_rollouts} rollouts, {cost.lost_tokens:,} tokens "
            f"({cost.lost_s:.1f} s), generated again; {cost.regenerated:.0%} of the "
            f"untrained work regenerated; an engine's death loses at most {worst:,} tokens")


class LendRecord(msgspec.Struct, frozen=True, kw_only=True):
    """simulate.lend: trainer devices lent to generation while the run trained."""

    arm: str
    """"starvation" or "autopilot"."""
    engines: int
    """Engines the lendable devices make at most."""
    devices_per_engine: int
    trainer_devices: int
    spare_devices: int = 0
    """simulate.spare_devices: where the engines came from instead of the trainer."""
    lends: int = 0
    """Switches of devices to generation (engines moved at one instant: one)."""
    returns: int = 0
    """Switches back to the trainer."""
    engines_lent: int = 0
    """Engines started on lent devices, over every lend."""
    device_s: float = 0.0
    """Device-seconds away from the trainer (from each lend's start to its return's end)."""
    lend_s: float = 0.0
    """Seconds of one lend (a colocated refit's reload of the devices moved)."""
    return_s: float = 0.0
    """Seconds of one return (a refit's release)."""
    switch_s: float = 0.0
    """Seconds the trainer waited on switches in all."""
    moved: int = 0
    """Requests a return ended unfinished, resumed on a standing engine."""
    moved_tokens: int = 0
    """Completion tokens they had made (prefilled again where they resumed)."""


class SimStats(msgspec.Struct, frozen=True, kw_only=True):
    """A simulated run's own counts (sim.json)."""

    hardware: str
    kv_limit_tokens: float | None = None
    """Tokens of KV cache one engine holds (None: not bounded, no device_memory)."""
    requests: int = 0
    """Requests the engines admitted."""
    kv_queued: int = 0
    """Requests that waited in an engine's queue for KV-cache room."""
    kv_wait_s: float = 0.0
    """Their summed seconds of waiting."""
    peak_kv_tokens: float = 0.0
    """The most KV-cache tokens any engine held at once (its running sequences' context
    plus what their lengths will add)."""
    time_shared: bool = False
    """run.colocate = "time": engines released their devices for every training step."""
    releases: int = 0
    """Times an engine released its devices to a training step and reloaded after."""
    weights_path: str = ""
    """simulate.weights_path: "direct", "gathered", "host", "p2p", "stage_heads" or
    "host_replica" ("": not recorded)."""
    version_stages: dict[str, float] = {}
    """Seconds of each stage of one version into every engine (gather, convert, stage,
    transfer, load)."""
    refit: dict[str, float] = {}
    """Time-shared: seconds of one turn, ``release`` and ``reload``, and the parts of a
    derived one (engine_offload, trainer_onload; trainer_offload, reshard, engine_onload;
    copy: async_rl.sim.refit)."""
    recompute_s: float = 0.0
    """Time-shared: seconds the engines spent recomputing the KV cache a release freed."""
    stop: StopCost | None = None
    """simulate.preemption_step: what a stop at the end of that step costs (None: off)."""
    lend: LendRecord | None = None
    """simulate.lend: the devices lent and what the switches cost (None: off)."""


class StepSplit(msgspec.Struct, frozen=True, kw_only=True):
    """Means over ``first``..``last`` (the steps after the pipeline fills)."""

    first: int
    last: int
    steps: int
    step_s: float
    wait_s: float
    """Waiting for a step's groups (generation)."""
    train_s: float
    sync_s: float
    """The weight snapshot after the step (the trainer's part of a weight sync)."""
    delivery_s: float
    """A version's delivery into the engines, from the ask to the last engine loaded
    (beside the next step)."""
    version_bytes: int = 0
    """What a version carries (the whole policy, or with LoRA its adapters); 0: not
    recorded."""
    groups_per_s: float
    tokens_per_s: float
    fill_s: float
    """Mean seconds of a pipeline-fill step (0 without any)."""


def fill_steps(steps: int, max_staleness: int) -> int:
    """Steps counted as filling the pipeline: the first max_staleness + 1 (their groups
    started before the first weight versions), while at least one step is left."""
    return max(0, min(max_staleness + 1, steps - 1))


def step_split(rows: Sequence[dict[str, Any]], max_staleness: int) -> StepSplit | None:
    """The split of metrics rows ``rows`` (None: no step)."""
    if not rows:
        return None
    fill = fill_steps(len(rows), max_staleness)
    kept = rows[fill:]

    def mean(values: Sequence[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    step_s = [r["wait_s"] + r["train_s"] + r["sync_s"] for r in kept]
    deliveries = [max(b["transfer_s"] + b["pause_s"] + b["load_s"] for b in r["broadcast"])
                  for r in kept if r.get("broadcast")]
    seconds = sum(step_s)
    return StepSplit(
        first=kept[0]["step"], last=kept[-1]["step"], steps=len(kept),
        step_s=mean(step_s), wait_s=mean([r["wait_s"] for r in kept]),
        train_s=mean([r["train_s"] for r in kept]), sync_s=mean([r["sync_s"] for r in kept]),
        delivery_s=mean(deliveries),
        version_bytes=max((b.get("bytes", 0) for r in kept for b in r.get("broadcast", ())),
                          default=0),
        groups_per_s=sum(r["groups"] for r in kept) / seconds if seconds else 0.0,
        tokens_per_s=sum(r["tokens"] for r in kept) / seconds if seconds else 0.0,
        fill_s=mean([r["wait_s"] + r["train_s"] + r["sync_s"] for r in rows[:fill]]))


class StalenessSplit(msgspec.Struct, frozen=True, kw_only=True):
    """A run's staleness split over its trained tokens: versions published while a group
    was generated (in flight) and while it waited in the queue (in queue)."""

    in_flight_mean: float
    in_flight_max: int
    in_queue_mean: float
    in_queue_max: int


def staleness_split(rows: Sequence[dict[str, Any]]) -> StalenessSplit | None:
    """Over every step of metrics rows ``rows`` (each step's means weighted by its
    ``tokens_trained``); None without a step that has the split (runs made before it)."""
    rows = [r for r in rows if "staleness_in_flight_mean" in r]
    if not rows:
        return None
    tokens = sum(r["tokens_trained"] for r in rows)

    def mean(key: str) -> float:
        return sum(r[key] * r["tokens_trained"] for r in rows) / tokens if tokens else 0.0

    return StalenessSplit(
        in_flight_mean=mean("staleness_in_flight_mean"),
        in_flight_max=max(r["staleness_in_flight_max"] for r in rows),
        in_queue_mean=mean("staleness_in_queue_mean"),
        in_queue_max=max(r["staleness_in_queue_max"] for r in rows))


def run_split(run_dir: Path) -> StepSplit | None:
    """``step_split`` of a run directory (None without metrics or a summary)."""
    if not (run_dir / METRICS).exists() or not (run_dir / SUMMARY).exists():
        return None
    return step_split(read_metrics(run_dir), read_summary(run_dir).max_staleness)


def _idle_line(role: Breakdown) -> str:
    causes = sorted(((s, c) for c, s in role.idle_by_cause.items()
                     if s >= 0.0005 * role.wall_s), reverse=True)  # shown as at least 0.1%
    return (f"{pct(role.idle_s, role.wall_s)} of {role.device}: "
            + (", ".join(f"{c} {pct(s, role.wall_s)}" for s, c in causes) or "none"))


def _turn(refit: dict[str, float], recompute_s: float) -> str:
    """One time-shared turn: its release and reload, each split into the parts sim.json
    keeps that moved anything ("given": the hardware's fixed cost)."""
    def side(name: str, parts: Sequence[tuple[str, str]]) -> str:
        shown = ["given"] if parts[0][0] not in refit else []
        shown += [f"{label} {refit[key]:.2f}" for key, label in parts if refit.get(key)]
        return f"{name} {refit.get(name, 0.0):.2f} s ({', '.join(shown) or 'nothing moved'})"
    return (side("release", (("engine_offload", "engine out"),
                             ("trainer_onload", "trainer in")))
            + " + " + side("reload", (("trainer_offload", "trainer out"),
                                      ("reshard", "reshard"),
                                      ("engine_onload", "engine in"), ("copy", "copy")))
            + (f"; KV recomputed {recompute_s:.2f} s in all" if recompute_s else ""))


def lend_line(lend: LendRecord, wall_s: float) -> str:
    """One line of the result: what was lent, how often, and what switching cost."""
    pool = lend.spare_devices or lend.trainer_devices
    whose = "spare" if lend.spare_devices else "trainer's"
    if not lend.engines:
        return (f"{lend.arm}: nothing to lend (the {whose} {pool} device(s) make no "
                f"engine of {lend.devices_per_engine} to spare)")
    share = lend.device_s / (pool * wall_s) if wall_s > 0 else 0.0
    return (f"{lend.arm}: {lend.lends} lends, {lend.returns} returns, "
            f"{lend.engines_lent} engines of {lend.devices_per_engine} device(s) started in "
            f"all (at most {lend.engines}); {lend.device_s:,.0f} device-s lent "
            f"({share:.0%} of the {whose}); a switch {lend.lend_s:.2f} s out, "
            f"{lend.return_s:.2f} s back, the trainer waited {lend.switch_s:.1f} s on them; "
            f"{lend.moved} requests resumed on standing engines with "
            f"{lend.moved_tokens:,} tokens made")


def result_table(run_dir: Path, roles: Sequence[Breakdown]) -> Table:
    """The run's result (see the module docstring): at most ``RESULT_LINES`` lines."""
    s = read_summary(run_dir)
    split = run_split(run_dir)
    stats = (msgspec.json.decode((run_dir / SIM_STATS).read_bytes(), type=SimStats)
             if (run_dir / SIM_STATS).exists() else None)
    title = f"result: {run_dir}" + (f" (simulated on {stats.hardware})" if stats else "")
    table = Table(title=title, box=None, show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    table.add_row("steps", f"{s.steps} in {s.wall_s:.1f} s"
                  + (f"; means below over steps {split.first}-{split.last} (before: "
                     f"pipeline fill, {split.fill_s:.1f} s a step)"
                     if split and split.first > 1 else ""))
    after = (f"; {split.groups_per_s:.2f} and {split.tokens_per_s:,.0f} after the fill"
             if split and split.first > 1 else "")
    table.add_row("groups/s, tokens/s",
                  f"{s.groups_per_s:.2f} and {s.tokens_per_s:,.0f} over the run{after}")
    if split:
        stages = stats.version_stages if stats and not stats.time_shared else {}

        def part(*names: str) -> str:
            return " + ".join(f"{name} {stages[name]:.2f}" for name in names) + " s"
        table.add_row("step time", f"{split.step_s:.2f} s")
        for label, seconds in (("  generation wait", split.wait_s),
                               ("  training", split.train_s),
                               ("  weight sync", split.sync_s)):
            table.add_row(label, f"{seconds:.2f} s ({pct(seconds, split.step_s)})"
                          + (f"; {stats.weights_path if stats else ''} version: "
                             + part("gather", "convert", "stage")
                             if stages and label == "  weight sync" else ""))
        if split.delivery_s:
            size = f" of {split.version_bytes / 2**20:,.1f} MiB" if split.version_bytes else ""
            table.add_row("  weight delivery", f"{split.delivery_s:.2f} s a version{size} "
                          "into every engine, beside the next step"
                          + (f"; {part('transfer', 'load')}" if stages else ""))
    for role in roles:
        table.add_row(f"{role.role} idle", _idle_line(role))
    parts = (staleness_split(read_metrics(run_dir)) if (run_dir / METRICS).exists()
             else None)
    table.add_row("staleness", f"histogram {list(s.staleness_histogram)}; "
                  + (f"in flight {parts.in_flight_mean:.2f} (max {parts.in_flight_max}), "
                     f"in queue {parts.in_queue_mean:.2f} (max {parts.in_queue_max}); "
                     if parts else "")
                  + f"{s.dropped_stale} groups dropped as too stale")
    if stats and stats.kv_limit_tokens is not None:
        table.add_row("KV cache", f"{stats.kv_limit_tokens:,.0f} tokens an engine (peak "
                      f"held {stats.peak_kv_tokens:,.0f}); {stats.kv_queued} of "
                      f"{stats.requests} requests waited for room "
                      f"({pct(stats.kv_queued, stats.requests)}), "
                      f"{stats.kv_wait_s:.0f} s in all")
    if stats and stats.stop:
        table.add_row("a stop", stop_cost_line(stats.stop))
    if stats and stats.time_shared:
        table.add_row("time-shared", f"engines released their devices {stats.releases} "
                      "times for training (no weight bytes over the network)")
        if stats.refit:
            table.add_row("  a turn", _turn(stats.refit, stats.recompute_s))
    if stats and stats.lend:
        table.add_row("lent devices", lend_line(stats.lend, s.wall_s))
    if not stats:
        table.add_row("accuracy", f"{s.accuracy_start} -> {s.accuracy_end}")
    return table
