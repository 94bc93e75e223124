"""Async GRPO on the long-tail (remainder) task with [autopilot]: real Ray, the real vLLM
CPU build and a tiny model warm-started on the task. One run serves both:

- the long-tail run: completions of very different lengths; the run finishes, trains
  every group once, packs its micro-batches without padding, and what metrics.jsonl, the
  ledger, eval.jsonl and summary.json say adds up;
- the autopilot: from one prompt in flight the trainer waits for data, and the autopilot
  raises rollout.max_inflight_prompts on the live rollout pool (past what the run
  started with, within the ceiling its rollout actor was made for) and says so in every
  place: the console, metrics.jsonl, run.json and the report.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path

import pytest

from async_rl.analysis.report import print_report
from async_rl.analysis.tables import wide_console
from async_rl.config import Config
from async_rl.config_io import decode_config
from async_rl.run.run_dir import (
    FINAL_MODEL,
    read_evals,
    read_ledger,
    read_metrics,
    read_record,
    read_summary,
)
from async_rl.run.summary import RunSummary
from async_rl.shell.ray_shell import run_training
from async_rl.tasks.longtail import MAX_NEW_TOKENS, RemainderTask

pytestmark = pytest.mark.ray

GROUP_SIZE = 4
GROUPS_PER_STEP = 4
STEPS = 7
EVAL_SIZE = 8
INFLIGHT = "rollout.max_inflight_prompts"


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_longtail_run_trains_varied_lengths_packed_and_the_autopilot_feeds_the_trainer(
        longtail_model_dir: Path, tmp_path: Path, ray_shutdown: None) -> None:
    run_dir = tmp_path / "run"
    config = decode_config({
        "model": {"path": str(longtail_model_dir)},
        "task": {"kind": "longtail", "eval_size": EVAL_SIZE},
        "rollout": {"group_size": GROUP_SIZE, "max_new_tokens": MAX_NEW_TOKENS,
                    "max_inflight_prompts": 1},
        "queue": {"max_groups": 8},
        "trainer": {"groups_per_step": GROUPS_PER_STEP, "micro_batch_tokens": 512},
        "run": {"num_steps": STEPS, "output_dir": str(run_dir), "progress": False,
                "eval_every": 0},
        "autopilot": {"enabled": True, "every_steps": 2, "keys": [INFLIGHT]},
    })
    lines = Lines()
    logger = logging.getLogger("async_rl.control.live_tuning")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        summary = run_training(config)
    finally:
        logger.removeHandler(lines)
    check_longtail_run(run_dir, config, summary)

    record = read_record(run_dir)
    assert record is not None and len(record.autopilot) >= 1
    first = record.autopilot[0]
    # The first step (the fill) is in no window: steps 2-3 make the first.
    assert (first.key, first.old, first.step) == (INFLIGHT, 1, 3) and first.new > 1
    assert "trainer waited" in first.cause and "for data" in first.cause

    columns = [row[f"autopilot/{INFLIGHT}"] for row in read_metrics(run_dir)]
    assert len(columns) == STEPS
    assert columns[:3] == [1, 1, 1] and columns[3] == first.new

    change = f"{INFLIGHT} 1 -> {first.new}"
    assert any(line.startswith(f"autopilot after step 3: {change}: trainer waited")
               for line in lines.lines), lines.lines

    console = wide_console()
    with console.capture() as captured:
        print_report(run_dir, console)
    assert f"after step 3: {change}" in captured.get()


def check_longtail_run(run_dir: Path, config: Config, summary: RunSummary) -> None:
    """The run finished, trained every step's groups once, packed, and its files agree."""

    # The run finished, and trained every step's groups once.
    groups = STEPS * GROUPS_PER_STEP
    samples_per_step = GROUPS_PER_STEP * GROUP_SIZE
    assert summary.steps == summary.final_version == summary.rollout_version == STEPS
    assert summary.groups_trained == groups
    assert summary.samples_trained == groups * GROUP_SIZE
    assert sum(summary.staleness_histogram) == groups
    assert len(summary.staleness_histogram) <= config.staleness.max_staleness + 1
    assert summary.rollout_failures == summary.reward_failures == summary.nonfinite_steps == 0
    assert summary == read_summary(run_dir)
    assert (run_dir / FINAL_MODEL / "config.json").exists()

    # Per-step rows: packed micro-batches (no padding) and a balancing plan.
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert [row["version"] for row in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert row["groups"] == GROUPS_PER_STEP
        assert row["padding_ratio"] == 1.0, row
        assert row["imbalance"] == 1.0, row  # one shard: its cost is the mean
        assert row["micro_batches_per_shard"] >= 1, row
        lengths = row["completion_tokens"]
        assert 1 <= lengths["p50"] <= lengths["max"] <= config.rollout.max_new_tokens, row
        assert len(row["queue"]["bucket_groups"]) == len(config.queue.bucket_edges) + 1, row
        assert sum(row["queue"]["bucket_groups"]) == row["queue"]["groups"], row
        assert 0.0 <= row["reward_mean"] <= 1.0 and 0.0 <= row["accuracy"] <= 1.0
    assert sum(row["tokens_trained"] for row in rows) == summary.tokens_trained
    assert sum(row["staleness_histogram"][0] for row in rows) == summary.staleness_histogram[0]

    # The ledger: each trained prompt once, at the version it was trained at.
    events: dict[str, list[str]] = defaultdict(list)
    trained_at: dict[int, list[str]] = defaultdict(list)
    for entry in read_ledger(run_dir):
        events[entry.prompt_id].append(entry.event)
        if entry.event == "trained":
            trained_at[entry.version].append(entry.prompt_id)
    assert all(evs[0] == "admitted" and evs.count("trained") <= 1 for evs in events.values())
    assert {v: len(ids) for v, ids in trained_at.items()} == dict.fromkeys(
        range(STEPS), GROUPS_PER_STEP)

    # Completion tokens per step: the loss's token count (every sample is trained) is what
    # the step's groups hold beyond their prompts, which the ledger names.
    task = RemainderTask(seed=config.task.seed)
    completion_tokens = []
    for row in rows:
        completion = sum(shard["tokens"] for shard in row["shards"])
        prompts = [task.prompt_at(int(pid.rsplit("-", 1)[1]))
                   for pid in trained_at[row["version"] - 1]]
        assert row["tokens"] - completion == GROUP_SIZE * sum(len(p.text) for p in prompts)
        # At least one token (EOS) and at most max_new_tokens per sample.
        assert samples_per_step <= completion <= samples_per_step * MAX_NEW_TOKENS, row
        completion_tokens.append(completion)
    # Lengths vary: were every completion L tokens long, every step would hold exactly
    # samples_per_step * L of them (every one cut at max_new_tokens included).
    same_length = (len(set(completion_tokens)) == 1
                   and completion_tokens[0] % samples_per_step == 0)
    assert not same_length, completion_tokens
    assert min(completion_tokens) < samples_per_step * MAX_NEW_TOKENS  # some stop at EOS

    # Evaluated at the start and the end only (eval_every = 0), on the held-out set.
    evals = read_evals(run_dir)
    assert [e.step for e in evals] == [0, STEPS]
    assert all(e.num_prompts == EVAL_SIZE and 0.0 <= e.accuracy <= 1.0 for e in evals)
    assert (summary.accuracy_start, summary.accuracy_end) == (evals[0].accuracy,
                                                              evals[-1].accuracy)
    assert evals[-1].version == STEPS and evals[-1].groups_trained == groups
    assert evals[-1].tokens_trained == summary.tokens_trained
