"""The records of a run's results: each held-out evaluation and the whole run's summary.

Owns: ``EvalPoint`` (a line of eval.jsonl), ``RunSummary`` (summary.json, also returned
to the caller) with its stale drops per length bucket (``BucketDrops``), and the one way
the failure counts are said (``describe_failures``). Knows nothing about files: writing
and reading them is ``async_rl.run.run_dir``'s.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec


class EvalPoint(msgspec.Struct, frozen=True, kw_only=True):
    """One greedy held-out evaluation of a run: a line of eval.jsonl.

    The training figures are those at the moment ``version`` was produced, so
    accuracy-vs-time and accuracy-vs-samples curves do not depend on how long the
    evaluation itself took or how far training ran meanwhile.
    """

    step: int
    """Optimizer step the evaluation was due at: 0 at the start, run.num_steps at the end,
    multiples of run.eval_every in between."""
    version: int
    """Policy version scored: the newest that produced any scored token."""
    version_min: int
    """The oldest such version; below ``version`` when a weight update landed during the
    evaluation (it runs beside training and does not hold updates off)."""
    accuracy: float
    """Mean reward of one greedy completion per held-out prompt."""
    wall_s: float
    """Seconds from the start of training until ``version`` was produced (0 for version 0)."""
    samples_trained: int
    groups_trained: int
    tokens_trained: int
    """Trained when ``version`` was produced."""
    eval_s: float
    """How long the evaluation took on the rollout worker."""
    num_prompts: int


class BucketDrops(msgspec.Struct, frozen=True, kw_only=True):
    """Stale drops among the generated groups of one token-length bucket
    (queue.bucket_edges: groups with ``low <= num_tokens < high``)."""

    low: int
    high: int | None
    """None for the last, open-ended bucket."""
    groups: int
    """Groups generated in this bucket; a prompt that ran again counts again."""
    dropped: int
    """Of those, dropped as stale (and run again)."""


def describe_failures(counts: Mapping[str, int]) -> str:
    """The failure classes that happened, e.g. "worker_restarts 2, stale_drops 5" (the
    progress line, the report and a failed run's last line all say it this way)."""
    return ", ".join(f"{name} {count}" for name, count in counts.items() if count)


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
    """Prompt plus completion tokens of the samples that carried a loss (group members
    that trainer.overlong = "mask" did not leave out)."""
    groups_per_s: float
    tokens_per_s: float
    """``tokens_trained`` over ``wall_s``."""
    accuracy_start: float | None
    accuracy_end: float | None
    staleness_histogram: tuple[int, ...]
    dropped_stale: int
    rollout_failures: int
    reward_failures: int
    nonfinite_steps: int
    retired_workers: int
    lost_steps: int = 0
    """Steps taken again because a shard could not fetch its groups (their rollout
    worker died); their prompts ran again."""
    restarts: int = 0
    """Rollout workers started again after dying or breaking."""
    stopped: str = ""
    """Why the run stopped before ``run.num_steps`` (e.g. "SIGINT", or "failed: ..."
    with the one-line reason); "" when it finished."""
    failures: dict[str, int] = {}
    """Count of each failure class (``StepTotals.failures``): out_of_memory,
    rollout_stall, worker_restarts, failed_restarts (of those, replacements that did not
    start or join in time), rollout_errors, timeouts, restore_failures,
    nonfinite_steps, lost_steps, reward_errors, reward_timeouts, env_timeouts (multi-turn
    trajectories ended by an environment call past task.environment.turn_timeout_s),
    env_errors (ended by an environment that raised; an agent's timeouts and errors
    count here too), gateway_refused (requests of agent sessions the gateway refused),
    stale_drops,
    reward_pool_saturated (of reward_timeouts, the scores refused at once because every
    reward thread was stuck in an earlier call: task.reward_threads)."""
    max_staleness: int
    # Defaults: summaries written before periodic evaluation existed still read.
    samples_trained: int = 0
    """Group members that carried a loss (an excluded sample never does)."""
    target_accuracy: float = 0.8
    """run.target_accuracy: what time_to_target_s and samples_to_target measure against."""
    time_to_target_s: float | None = None
    """wall_s of the first evaluation with accuracy >= target_accuracy; None if none reached it."""
    samples_to_target: int | None = None
    """samples_trained of that evaluation; None if none reached it."""
    evals: tuple[EvalPoint, ...] = ()
    """Every evaluation of the run, as in eval.jsonl."""
    stale_drops_by_length: tuple[BucketDrops, ...] = ()
    """``dropped_stale`` split by token-length bucket, beside the groups generated there:
    drops fall on the slowest groups, which are the longest."""
    groups_generated: int = 0
    """Groups that came back from the rollout workers (a prompt that ran again counts
    again), trained or not."""
    filtered_groups: int = 0
    """Of those, dropped by rollout.filter_groups (rewards all equal: no GRPO signal);
    their prompts are done, neither trained nor run again."""

