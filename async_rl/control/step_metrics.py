"""Per-step metrics rows and whole-run totals.

Owns: what one metrics.jsonl row holds (reward, accuracy, loss statistics, staleness
histogram and its split into in flight and in queue, queue state, throughput, broadcast
timings, balance) and the running totals
that become the run summary. Knows nothing about where the figures come from.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec

from async_rl.control.evaluation import first_at_target
from async_rl.control.loss_stats import merge_stats, summarise
from async_rl.run.summary import BucketDrops, EvalPoint, RunSummary
from buffers.common.config import bucket_index
from buffers.common.records import Group
from buffers.common.reports import BroadcastTiming
from buffers.common.train_records import ShardStepResult
from buffers.plan.balance import StepPlan
from buffers.plan.batching import TrainerRules, trained_sample
from buffers.queue.queue_records import ReplayQueueStatistics, TakenGroups


class Counters(msgspec.Struct, frozen=True, kw_only=True):
    """``StepTotals`` as saved: every failure class and throughput counter."""

    groups_trained: int
    samples_trained: int
    tokens_trained: int
    dropped_stale: int
    rollout_failures: int
    reward_failures: int
    nonfinite_steps: int
    retired_workers: int
    lost_steps: int
    restarts: int
    staleness: dict[int, int]
    # Defaults: checkpoints written before these existed still read.
    out_of_memory: int = 0
    rollout_stalls: int = 0
    restore_failures: int = 0
    timeouts: int = 0
    stale_drops_by_length: tuple[BucketDrops, ...] = ()
    reward_timeouts: int = 0
    groups_generated: int = 0
    filtered_groups: int = 0
    env_timeouts: int = 0
    env_errors: int = 0
    excluded_members: dict[str, int] = {}
    too_few_members: int = 0
    readmissions_exhausted: int = 0
    reward_pool_saturated: int = 0
    failed_restarts: int = 0
    gateway_refused: int = 0


class StepTotals:
    """Counters the orchestrator bumps during a run; ``bucket_edges``: queue.bucket_edges,
    the token-length buckets stale drops are counted by."""

    def __init__(self, bucket_edges: Sequence[int] = ()) -> None:
        self.groups_trained = 0
        self.samples_trained = 0
        """Group members that carried a loss (no excluded sample, none that
        trainer.overlong = "mask" left out)."""
        self.tokens_trained = 0
        """Their prompt plus completion tokens (each trained sequence once)."""
        self.dropped_stale = 0
        self.rollout_failures = 0
        self.reward_failures = 0
        self.nonfinite_steps = 0
        self.retired_workers = 0
        self.lost_steps = 0
        self.restarts = 0
        self.out_of_memory = 0
        self.rollout_stalls = 0
        self.restore_failures = 0
        self.timeouts = 0
        self.reward_timeouts = 0
        self.groups_generated = 0
        self.filtered_groups = 0
        """Groups dropped by rollout.filter_groups (no signal): done, not trained."""
        self.env_timeouts = 0
        """Trajectories ended by an environment call past task.environment.turn_timeout_s."""
        self.env_errors = 0
        """Trajectories ended by an environment that raised."""
        self.excluded_members: Counter[str] = Counter()
        """Samples that were no group member, by reason (``Group.excluded``)."""
        self.too_few_members = 0
        """Groups dropped with fewer than two members left (their prompts ran again)."""
        self.readmissions_exhausted = 0
        """Prompts dropped for good after run.max_readmissions re-admissions."""
        self.reward_pool_saturated = 0
        """Of reward_timeouts, scores refused at once: every reward thread was stuck."""
        self.gateway_refused = 0
        """Requests of agent sessions the gateway refused (4xx)."""
        self.failed_restarts = 0
        """Of restarts, replacements that did not start or join in time (or were
        cancelled at the run's end)."""
        self.row_mark = (0, 0)
        """(groups_generated, filtered_groups) at the last metrics row."""
        self.nonfinite_in_a_row = 0
        """Non-finite steps since the last good one (trainer.max_nonfinite_steps)."""
        self.staleness: Counter[int] = Counter()
        self.bucket_edges = tuple(bucket_edges)
        self.generated_by_bucket = [0] * (len(self.bucket_edges) + 1)
        self.dropped_by_bucket = [0] * (len(self.bucket_edges) + 1)

    def generated(self, group: Group) -> None:
        """A group came back from a rollout worker (before it is queued)."""
        self.reward_failures += group.reward_failures
        self.reward_timeouts += group.reward_timeouts
        self.reward_pool_saturated += group.reward_pool_saturated
        self.env_timeouts += group.env_timeouts
        self.env_errors += group.env_errors
        self.gateway_refused += group.gateway_refused
        self.excluded_members.update(why for why in group.excluded if why)
        self.groups_generated += 1
        self.generated_by_bucket[bucket_index(self.bucket_edges, group.num_tokens)] += 1

    def dropped(self, group: Group) -> None:
        """The queue dropped a group as stale."""
        self.dropped_tokens(group.num_tokens)

    def dropped_tokens(self, num_tokens: int) -> None:
        """A group of ``num_tokens`` dropped as stale (a partial rollout too stale to
        continue on resume counts its kept tokens)."""
        self.dropped_stale += 1
        self.dropped_by_bucket[bucket_index(self.bucket_edges, num_tokens)] += 1

    def by_length(self) -> tuple[BucketDrops, ...]:
        lows = (0, *self.bucket_edges)
        highs: tuple[int | None, ...] = (*self.bucket_edges, None)
        return tuple(BucketDrops(low=lo, high=hi, groups=g, dropped=d) for lo, hi, g, d in
                     zip(lows, highs, self.generated_by_bucket, self.dropped_by_bucket,
                         strict=True))

    def counters(self) -> Counters:
        """The totals as a checkpoint keeps them."""
        return Counters(
            groups_trained=self.groups_trained, samples_trained=self.samples_trained,
            tokens_trained=self.tokens_trained, dropped_stale=self.dropped_stale,
            rollout_failures=self.rollout_failures, reward_failures=self.reward_failures,
            nonfinite_steps=self.nonfinite_steps, retired_workers=self.retired_workers,
            lost_steps=self.lost_steps, restarts=self.restarts,
            staleness=dict(self.staleness), out_of_memory=self.out_of_memory,
            rollout_stalls=self.rollout_stalls, restore_failures=self.restore_failures,
            timeouts=self.timeouts, stale_drops_by_length=self.by_length(),
            reward_timeouts=self.reward_timeouts, groups_generated=self.groups_generated,
            filtered_groups=self.filtered_groups, env_timeouts=self.env_timeouts,
            env_errors=self.env_errors, excluded_members=dict(self.excluded_members),
            too_few_members=self.too_few_members,
            readmissions_exhausted=self.readmissions_exhausted,
            reward_pool_saturated=self.reward_pool_saturated,
            failed_restarts=self.failed_restarts, gateway_refused=self.gateway_refused)

    def restore(self, counters: Counters) -> None:
        for name in Counters.__struct_fields__:
            if name not in ("staleness", "stale_drops_by_length", "excluded_members"):
                setattr(self, name, getattr(counters, name))
        self.staleness = Counter(counters.staleness)
        self.excluded_members = Counter(counters.excluded_members)
        self.row_mark = (self.groups_generated, self.filtered_groups)
        saved = counters.stale_drops_by_length
        # Counts by other bucket edges (changed on resume) would be mislabelled here.
        if [(b.low, b.high) for b in saved] == [(b.low, b.high) for b in self.by_length()]:
            self.generated_by_bucket = [b.groups for b in saved]
            self.dropped_by_bucket = [b.dropped for b in saved]

    def filtered_since_row(self) -> float:
        """Filtered / generated groups since the last call (the last metrics row)."""
        generated = self.groups_generated - self.row_mark[0]
        filtered = self.filtered_groups - self.row_mark[1]
        self.row_mark = (self.groups_generated, self.filtered_groups)
        return filtered / generated if generated else 0.0

    def failures(self) -> dict[str, int]:
        """Every failure class with its count, as summary.json, the progress line and
        the exit message name them."""
        return {
            "out_of_memory": self.out_of_memory,
            "rollout_stall": self.rollout_stalls,
            "worker_restarts": self.restarts,
            "failed_restarts": self.failed_restarts,
            "rollout_errors": self.rollout_failures,
            "timeouts": self.timeouts,
            "restore_failures": self.restore_failures,
            "nonfinite_steps": self.nonfinite_steps,
            "lost_steps": self.lost_steps,
            "reward_errors": self.reward_failures,
            "reward_timeouts": self.reward_timeouts,
            "env_timeouts": self.env_timeouts,
            "env_errors": self.env_errors,
            "gateway_refused": self.gateway_refused,
            "stale_drops": self.dropped_stale,
            # Samples that were no group member, by reason (env_too_long, reward_failed...).
            **{f"excluded_{why}": n for why, n in sorted(self.excluded_members.items())},
            "too_few_members": self.too_few_members,
            "readmissions_exhausted": self.readmissions_exhausted,
            "reward_pool_saturated": self.reward_pool_saturated,
        }

    def summary(self, *, wall_s: float, final_version: int, accuracy_start: float | None,
                accuracy_end: float | None, max_staleness: int, rollout_version: int,
                evals: Sequence[EvalPoint] = (), target_accuracy: float = 0.8,
                stopped: str = "") -> RunSummary:
        top = max(self.staleness, default=0)
        reached = first_at_target(evals, target_accuracy)
        return RunSummary(
            steps=final_version,
            final_version=final_version,
            rollout_version=rollout_version,
            wall_s=wall_s,
            groups_trained=self.groups_trained,
            tokens_trained=self.tokens_trained,
            groups_per_s=self.groups_trained / wall_s if wall_s else 0.0,
            tokens_per_s=self.tokens_trained / wall_s if wall_s else 0.0,
            accuracy_start=accuracy_start,
            accuracy_end=accuracy_end,
            staleness_histogram=tuple(self.staleness[s] for s in range(top + 1)),
            dropped_stale=self.dropped_stale,
            rollout_failures=self.rollout_failures,
            reward_failures=self.reward_failures,
            nonfinite_steps=self.nonfinite_steps,
            retired_workers=self.retired_workers,
            lost_steps=self.lost_steps,
            restarts=self.restarts,
            stopped=stopped,
            failures=self.failures(),
            max_staleness=max_staleness,
            samples_trained=self.samples_trained,
            target_accuracy=target_accuracy,
            time_to_target_s=reached.wall_s if reached else None,
            samples_to_target=reached.samples_trained if reached else None,
            evals=tuple(evals),
            stale_drops_by_length=self.by_length(),
            groups_generated=self.groups_generated,
            filtered_groups=self.filtered_groups,
        )


def _padding_ratio(results: Sequence[ShardStepResult]) -> float:
    """Positions the trainer computed / real tokens over all shards (1.0: no padding)."""
    real = sum(r.input_tokens for r in results)
    return sum(r.computed_positions for r in results) / real if real else 1.0


def staleness_split(taken: TakenGroups[Group], trained_tokens: Sequence[int]
                    ) -> dict[str, float | int]:
    """The step's staleness in flight (versions published while a group was generated)
    and in queue (while it waited), over its trained tokens: means weighted by each
    group's ``trained_tokens``, maxima over the groups with any (0: a step without)."""
    total = sum(trained_tokens)
    row: dict[str, float | int] = {}
    for part, values in (("in_flight", taken.in_flight()), ("in_queue", taken.in_queue())):
        weighted = list(zip(values, trained_tokens, strict=True))
        row[f"staleness_{part}_mean"] = (sum(v * w for v, w in weighted) / total
                                         if total else 0.0)
        row[f"staleness_{part}_max"] = max((v for v, w in weighted if w), default=0)
    return row


def step_row(
    *,
    step: int,
    version: int,
    taken: TakenGroups[Group],
    results: Sequence[ShardStepResult],
    plan: StepPlan,
    wait_s: float,
    train_s: float,
    sync_s: float,
    timings: Sequence[BroadcastTiming],
    queue: ReplayQueueStatistics,
    totals: StepTotals,
    trainer: TrainerRules,
) -> dict[str, Any]:
    """One metrics row of the step that trained ``taken``; also folds the step into
    ``totals``. ``trainer``: the rules that say which members carried a loss
    (``buffers.plan.batching.trained_sample``).

    Every statistic is the groups' members' (``Group.members``): rewards, accuracy,
    reward/<name> (each reward's member values that are not lost), finish reasons,
    lengths, and ``tokens`` (the members' prompt plus completion tokens, each member's
    sequence once, trained or not; ``tokens_per_s`` is it over the step's seconds).
    ``samples_trained`` and ``tokens_trained`` are the members that carried a loss and
    their sequences' tokens: not those trainer.overlong = "mask" left out. The excluded
    samples are counted apart: ``samples_excluded``, ``tokens_excluded`` and
    ``excluded`` (by reason). A group's staleness is ``taken.at_version - min_version``;
    ``staleness_split`` adds its parts."""
    groups = taken.groups
    members = [(g, k) for g in groups for k in g.members]
    trained_by_group = [[k for k in g.members if trained_sample(g, k, trainer)]
                        for g in groups]
    trained = [(g, k) for g, ks in zip(groups, trained_by_group, strict=True) for k in ks]
    trained_tokens = [sum(g.sequence_lengths[k] for k in ks)
                      for g, ks in zip(groups, trained_by_group, strict=True)]
    staleness = [taken.at_version - g.min_version for g in groups]
    excluded = [(g, k, why) for g in groups for k, why in enumerate(g.excluded) if why]
    rewards = [g.rewards[k] for g, k in members]
    finishes = [g.finish_reasons[k] for g, k in members]
    tokens = sum(g.sequence_lengths[k] for g, k in members)
    tokens_trained = sum(trained_tokens)
    totals.groups_trained += len(groups)
    totals.samples_trained += len(trained)
    totals.tokens_trained += tokens_trained
    totals.staleness.update(staleness)
    histogram = Counter(staleness)
    step_s = wait_s + train_s + sync_s
    lengths = sorted(g.completion_lengths[k] for g, k in members)
    by_reward: dict[str, list[float]] = {}
    for g, k in members:
        for name, values in g.reward_scores.items():
            if (value := values[k]) is not None:
                by_reward.setdefault(name, []).append(value)
    return {
        "step": step,
        "version": version,
        "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else 0.0,
        # Each of the task's own rewards (task.rewards), unweighted, over the members it
        # scored: reward/<name> (none when it scored no member this step).
        **{f"reward/{name}": sum(v) / len(v) for name, v in by_reward.items()},
        **summarise(merge_stats([r.loss for r in results])),
        "grad_norm": results[0].grad_norm if results else 0.0,
        # Cumulative counts of the failure classes so far (the progress line shows them).
        "failures": {k: v for k, v in totals.failures().items() if v},
        # DAPO's dynamic sampling (rollout.filter_groups): groups dropped for want of
        # signal / groups generated since the last row.
        "filtered_fraction": totals.filtered_since_row(),
        # Completions cut at rollout.max_new_tokens (what trainer.overlong acts on).
        "truncated_fraction": finishes.count("length") / len(finishes) if finishes else 0.0,
        "staleness_histogram": [histogram[s] for s in range(max(histogram, default=0) + 1)],
        "staleness_max": max(staleness, default=0),
        # Its parts: versions published while generating / while queued (per token).
        **staleness_split(taken, trained_tokens),
        "groups": len(groups),
        "samples": len(members),
        "tokens": tokens,
        "tokens_per_s": tokens / step_s if step_s else 0.0,
        "samples_trained": len(trained),
        "tokens_trained": tokens_trained,
        # Samples that were no group member (``Group.excluded``), apart from the above.
        "samples_excluded": len(excluded),
        "tokens_excluded": sum(g.sequence_lengths[k] for g, k, _ in excluded),
        "excluded": dict(Counter(why for *_, why in excluded)),
        # The long tail the buckets and the balancer exist for.
        "completion_tokens": {"mean": sum(lengths) / len(lengths),
                              "p50": lengths[len(lengths) // 2],
                              "max": lengths[-1]} if lengths else {},
        "wait_s": wait_s,
        "train_s": train_s,
        "sync_s": sync_s,
        "imbalance": plan.imbalance,
        "micro_batches_per_shard": len(plan.shards[0].micro_batches) if plan.shards else 0,
        "padding_ratio": _padding_ratio(results),
        "shards": [
            {"rank": r.rank, "tokens": r.loss.tokens, "forward_s": r.forward_s,
             "backward_s": r.backward_s, "optimizer_s": r.optimizer_s,
             "barrier_s": r.barrier_s}
            for r in results
        ],
        "broadcast": [msgspec.to_builtins(t) for t in timings],
        "queue": {"groups": queue.groups, "tokens": queue.tokens, "drops": queue.drops,
                  "put_wait_s": queue.put_waits.seconds,
                  "take_wait_s": queue.take_waits.seconds,
                  # Groups per token-length bucket after the take, smallest bucket first.
                  "bucket_groups": [b.groups for b in queue.buckets],
                  # Stale drops per bucket so far (this process's queue).
                  "bucket_drops": [b.dropped for b in queue.buckets]},
    }
