"""End-to-end async GRPO on real Ray, the real vLLM CPU build and the tiny local model.

Checks the staleness contract (every trained group within max_staleness; with 0 it is
synchronous: test_stop_resume.py's straight run, ``check_synchronous``), the prompt
ledger (nothing lost, nothing trained twice) and that the run directory holds what users
read: metrics, spans, the report, the evaluations beside training (eval.jsonl, time-to-
target in the summary) and the final model.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path

import pytest

from async_rl.analysis.report import build_report
from async_rl.config import Config
from async_rl.config_io import decode_config
from async_rl.run.run_dir import FINAL_MODEL, read_evals, read_ledger, read_metrics
from async_rl.run.summary import RunSummary
from async_rl.shell.ray_shell import run_training

pytestmark = pytest.mark.ray


def small_config(model_dir: Path, out: Path, max_staleness: int, **extra: dict[str, object]
                 ) -> Config:
    raw: dict[str, dict[str, object]] = {
        "model": {"path": str(model_dir)},
        "task": {"eval_size": 0},
        "rollout": {"group_size": 4, "max_new_tokens": 6, "max_inflight_prompts": 8},
        "queue": {"max_groups": 32},
        "staleness": {"max_staleness": max_staleness},
        "trainer": {"groups_per_step": 4, "micro_batch_tokens": 512},
        "run": {"num_steps": 6, "output_dir": str(out), "progress": False},
    }
    for section, values in extra.items():
        raw.setdefault(section, {}).update(values)
    return decode_config(raw)


def check_ledger(run_dir: Path, groups_trained: int, filtered_groups: int = 0) -> None:
    """Every admitted prompt is trained once, dropped for good (as filtered,
    rollout.filter_groups, or past run.max_readmissions), or re-queued/unfinished with a
    reason."""
    events: dict[str, list[str]] = defaultdict(list)
    for entry in read_ledger(run_dir):
        final_drop = (entry.event, entry.reason) == ("dropped", "filtered")
        given_up = (entry.event, entry.reason) == ("dropped", "readmissions_exhausted")
        events[entry.prompt_id].append("filtered" if final_drop else "given_up" if given_up
                                       else entry.event)
        if entry.event in ("dropped", "failed", "requeued", "unfinished"):
            assert entry.reason, entry
    trained = [pid for pid, evs in events.items() if "trained" in evs]
    assert len(trained) == groups_trained
    assert sum(evs.count("filtered") for evs in events.values()) == filtered_groups
    for pid, evs in events.items():
        assert evs.count("trained") + evs.count("filtered") + evs.count("given_up") <= 1, (
            pid, evs)
        assert evs[0] == "admitted", (pid, evs)
        # Each admission ends trained, filtered, re-queued (then admitted again) or
        # unfinished; a resume re-queues what the stop left unfinished, or restores its
        # queued group (one ending, two events). A prompt already waiting in the re-queue
        # line at the stop (a multi-turn trajectory handed back, say) is owed as well:
        # the resume re-queues it again, one ending, two "requeued" events.
        reissued = sum(1 for a, b in itertools.pairwise(evs)
                       if (a, b) in (("unfinished", "requeued"), ("unfinished", "restored"),
                                     ("requeued", "requeued")))
        assert evs.count("admitted") == (
            evs.count("trained") + evs.count("filtered") + evs.count("requeued")
            + evs.count("unfinished") + evs.count("given_up") - reissued
        ), (pid, evs)


def check_evals(run_dir: Path, summary: RunSummary, steps: list[int], group_size: int,
                groups_per_step: int) -> None:
    """eval.jsonl has one row per planned evaluation, charged at the version it scored."""
    rows = read_evals(run_dir)
    assert len(rows) == len(steps), [r.step for r in rows]
    assert [r.step for r in rows] == steps
    assert rows[0].version == rows[0].version_min == 0 and rows[0].wall_s == 0.0
    assert rows[-1].version == rows[-1].version_min == summary.final_version
    for row in rows:
        # Evaluated once delivered: never an older version than the one due.
        assert row.step <= row.version_min <= row.version <= summary.final_version
        assert row.groups_trained == groups_per_step * row.version
        assert row.samples_trained == group_size * row.groups_trained
        assert 0.0 <= row.accuracy <= 1.0 and row.num_prompts > 0 and row.eval_s > 0
    for before, after in itertools.pairwise(rows):
        assert before.version <= after.version
        # Same scored version (an evaluation that lagged behind training): same charge.
        assert (before.wall_s < after.wall_s if before.version < after.version
                else before.wall_s == after.wall_s)
        assert before.tokens_trained <= after.tokens_trained
    assert rows[-1].wall_s <= summary.wall_s
    assert rows[-1].samples_trained == summary.samples_trained
    assert summary.evals == tuple(rows)
    assert (summary.accuracy_start, summary.accuracy_end) == (rows[0].accuracy,
                                                              rows[-1].accuracy)
    reached = [r for r in rows if r.accuracy >= summary.target_accuracy]
    assert summary.time_to_target_s == (reached[0].wall_s if reached else None)
    assert summary.samples_to_target == (reached[0].samples_trained if reached else None)


def test_staleness_bound_two_is_kept_and_used(
    tiny_model_dir: Path, tmp_path: Path, ray_shutdown: None
) -> None:
    # Homogeneous takes may skip past older groups: the bound must hold regardless.
    # Held-out evaluation every 2 steps runs beside training on the rollout engine.
    config = small_config(tiny_model_dir, tmp_path / "run", max_staleness=2,
                          queue={"homogeneous_take": True}, task={"eval_size": 16},
                          run={"eval_every": 2, "target_accuracy": 0.05})
    summary = run_training(config)
    check_evals(tmp_path / "run", summary, steps=[0, 2, 4, 6], group_size=4,
                groups_per_step=4)
    assert summary.steps == 6
    hist = summary.staleness_histogram
    assert sum(hist) == summary.groups_trained == 6 * 4
    assert len(hist) <= 3, f"a group was trained with staleness > 2: {hist}"
    assert sum(hist[1:]) > 0, f"async run never trained off-policy: {hist}"
    rows = read_metrics(tmp_path / "run")
    assert all(row["staleness_max"] <= 2 for row in rows)
    # Each step's staleness split: versions published while its groups were generated
    # and while they waited in the queue, whose maxima cover the histogram's.
    for row in rows:
        flying, queued = row["staleness_in_flight_max"], row["staleness_in_queue_max"]
        top = len(row["staleness_histogram"]) - 1
        assert top == row["staleness_max"]
        assert 0 <= flying <= top and 0 <= queued <= top and flying + queued >= top, row
        assert 0 <= row["staleness_in_flight_mean"] <= flying
        assert 0 <= row["staleness_in_queue_mean"] <= queued
    # Deliveries overlap later steps, so a row logs those finished by then: in order,
    # none skipped, and the last one has landed by the end of the run.
    delivered = [t["version"] for row in rows for t in row["broadcast"]]
    assert delivered == list(range(1, len(delivered) + 1))
    assert summary.rollout_version == summary.final_version == 6
    check_ledger(tmp_path / "run", summary.groups_trained)
    assert (tmp_path / "run" / FINAL_MODEL / "config.json").exists()
    idle = build_report(tmp_path / "run")
    for role in idle.roles:
        assert role.busy_s + role.idle_s == pytest.approx(role.wall_s, rel=0.01)
    assert {r.role for r in idle.roles} == {"rollout", "trainer"}
