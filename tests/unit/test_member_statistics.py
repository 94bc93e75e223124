"""A step's statistics are its groups' members': rewards, reward/<name>, tokens and
tokens_per_s; samples_trained and tokens_trained are the members that carried a loss
(not those trainer.overlong = "mask" left out). Excluded samples are counted apart
(samples_excluded, tokens_excluded, excluded by reason), and the ledger's trained and
filtered events carry the members' rewards only. Groups mixing members, excluded samples
and over-long masked ones; fake workers (no Ray)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from async_rl.config import Config
from async_rl.control.step_metrics import StepTotals, step_row
from buffers.common.records import Group, Prompt, Sample, make_group
from buffers.plan.batching import shard_batches, with_reward_failures
from buffers.queue.queue_records import TakenGroups
from buffers.queue.replay_queue import ReplayQueue
from tests.unit.orchestrator_fakes import FakeRollout, FakeTrainer, config, ledger, run
from workers.trainer.config import TrainerConfig

PROMPT = Prompt(prompt_id="p0", text="2+2=", answer="4")
PROMPT_IDS = (1, 2)
MASK = TrainerConfig(overlong="mask")


def sample(reward: float, tokens: int, *, finish: str = "stop", excluded: str = "",
           failed: bool = False) -> Sample:
    return Sample(token_ids=(5,) * tokens, logprobs=(-0.5,) * tokens,
                  versions=(0,) * tokens, finish_reason=finish, text="x", reward=reward,
                  reward_failed=failed, excluded=excluded,
                  env_outcome="error" if excluded == "env_error" else "")


def mixed_samples() -> list[Sample]:
    """Three members (one cut at max_new_tokens), an excluded environment failure with a
    stray reward of 1 and a lost score: sequences of 5, 6, 4 | 7, 8 tokens."""
    return [sample(1.0, 3), sample(0.0, 4, finish="length"), sample(0.0, 2),
            sample(1.0, 5, excluded="env_error"), sample(0.0, 6, failed=True)]


def mixed(**scores: tuple[float | None, ...]) -> Group:
    """``mixed_samples`` with each reward's per-sample ``scores``."""
    return make_group(PROMPT, PROMPT_IDS, mixed_samples(), reward_scores=scores)


def row_of(groups: list[Group], trainer: TrainerConfig = MASK,
           totals: StepTotals | None = None) -> dict[str, Any]:
    _, plan = shard_batches(groups, 1, trainer, step=1)
    queue: ReplayQueue[Group] = ReplayQueue(max_groups=4, max_tokens=10**6,
                                            max_staleness=0)
    taken = TakenGroups(groups=tuple(groups), at_version=0,
                        entered_versions=(0,) * len(groups))
    return step_row(step=1, version=1, taken=taken, results=[], plan=plan,
                    wait_s=1.0, train_s=0.5, sync_s=0.5,
                    timings=[], queue=queue.statistics(), totals=totals or StepTotals(),
                    trainer=trainer)


def test_every_statistic_of_a_mixed_group_is_its_members() -> None:
    group = mixed(digits=(1.0, 0.0, 1.0, None, None),
                  **{"verl/length": (3.0, 4.0, 2.0, None, None)})
    assert group.members == (0, 1, 2)
    totals = StepTotals()
    row = row_of([group], totals=totals)
    assert row["reward_mean"] == pytest.approx(1 / 3)
    assert row["accuracy"] == pytest.approx(1 / 3)
    assert row["reward/digits"] == pytest.approx(2 / 3)  # not over 5 samples
    assert row["reward/verl/length"] == pytest.approx(3.0)
    assert row["truncated_fraction"] == pytest.approx(1 / 3)
    # Members: 5 + 6 + 4 tokens (today all five samples: 30), over a 2 s step.
    assert (row["samples"], row["tokens"], row["tokens_per_s"]) == (3, 15, 7.5)
    # Trained: the members but the one cut at max_new_tokens (today 3 samples, 30 tokens).
    assert (row["samples_trained"], row["tokens_trained"]) == (2, 9)
    assert (totals.samples_trained, totals.tokens_trained) == (2, 9)
    assert (row["samples_excluded"], row["tokens_excluded"]) == (2, 15)
    assert row["excluded"] == {"env_error": 1, "reward_failed": 1}


def test_a_lost_score_taken_back_as_a_zero_member_stays_out_of_reward_name() -> None:
    # task.on_reward_failure = "zero": the lost score's sample is a member with reward 0,
    # but its digits verdict is unknown, not 0.
    group = with_reward_failures(mixed(digits=(1.0, 0.0, 1.0, None, None)))
    assert group.members == (0, 1, 2, 4)
    row = row_of([group], trainer=TrainerConfig())
    assert row["reward_mean"] == pytest.approx(1 / 4)
    assert row["reward/digits"] == pytest.approx(2 / 3)
    assert (row["samples"], row["tokens"]) == (4, 23)
    assert (row["samples_trained"], row["tokens_trained"]) == (4, 23)  # "keep": all four
    assert (row["samples_excluded"], row["excluded"]) == (1, {"env_error": 1})


def test_degenerate_groups_one_member_zero_variance_and_no_member() -> None:
    one = make_group(PROMPT, PROMPT_IDS, [sample(1.0, 3),
                                         sample(0.0, 9, excluded="env_error")],
                     reward_scores={"digits": (1.0, None)})
    flat = make_group(PROMPT, PROMPT_IDS, [sample(1.0, 2), sample(1.0, 2)],
                      reward_scores={"digits": (1.0, 1.0)})
    nobody = make_group(PROMPT, PROMPT_IDS, [sample(1.0, 4, excluded="env_error")] * 3,
                        reward_scores={"digits": (None,) * 3})
    assert (one.members, flat.members, nobody.members) == ((0,), (0, 1), ())
    row = row_of([one, flat, nobody])
    assert row["reward_mean"] == 1.0 and row["reward/digits"] == 1.0
    assert (row["samples"], row["tokens"]) == (3, 5 + 4 + 4)
    assert (row["samples_trained"], row["tokens_trained"]) == (3, 13)
    assert (row["samples_excluded"], row["tokens_excluded"]) == (4, 11 + 3 * 6)
    assert row["excluded"] == {"env_error": 4}
    alone = row_of([nobody])
    assert (alone["reward_mean"], alone["samples"], alone["tokens"], alone["tokens_per_s"],
            alone["samples_trained"], alone["tokens_trained"]) == (0.0, 0, 0, 0.0, 0, 0)
    assert "reward/digits" not in alone  # no member scored: no figure, not a 0
    assert (alone["samples_excluded"], alone["tokens_excluded"]) == (3, 18)
    every_cut = make_group(PROMPT, PROMPT_IDS, [sample(1.0, 3, finish="length")] * 2)
    masked = row_of([every_cut])
    assert (masked["samples"], masked["tokens"]) == (2, 10)
    assert (masked["samples_trained"], masked["tokens_trained"]) == (0, 0)


# ---- a run: the rows, the summary and the ledger ------------------------------------------


class MixedRollout(FakeRollout):
    """Each group: three members (rewards 1, 0, 0; the second cut at max_new_tokens), an
    excluded environment failure rewarded 1 and a lost score; with ``flat_odd``, the
    odd-numbered prompts' members all score 1 (no signal) while their excluded one
    scores 0."""

    def __init__(self, rank: int, flat_odd: bool = False) -> None:
        super().__init__(rank)
        self.flat_odd = flat_odd

    async def generate(self, prompt: Prompt) -> Group:
        group = make_group(prompt, PROMPT_IDS, mixed_samples())
        if self.flat_odd and int(prompt.prompt_id.rsplit("-", 1)[-1]) % 2:
            group = msgspec.structs.replace(group, rewards=(1.0, 1.0, 1.0, 0.0, 0.0))
        self.generated += 1
        return msgspec.structs.replace(group, rollout_rank=self.rank,
                                       min_version=self.version_now,
                                       max_version=self.version_now)


def masked_config(tmp_path: Path, filter_groups: str = "none") -> Config:
    cfg = config(tmp_path, steps=3, groups=2)
    return msgspec.structs.replace(
        cfg, trainer=msgspec.structs.replace(cfg.trainer, overlong="mask"),
        rollout=msgspec.structs.replace(cfg.rollout, filter_groups=filter_groups,
                                        max_new_tokens=4))


def test_a_run_s_rows_summary_and_ledger_count_members_and_trained_samples(
        tmp_path: Path) -> None:
    summary = run(masked_config(tmp_path), {0: MixedRollout(0)}, [FakeTrainer(0)])
    rows = [msgspec.json.decode(line) for line in
            (tmp_path / "metrics.jsonl").read_bytes().splitlines()]
    assert len(rows) == summary.steps == 3
    for row in rows:
        groups = row["groups"]
        assert groups == 2
        assert row["tokens"] == 15 * groups  # today 30: every sample's tokens
        assert row["samples"] == 3 * groups
        assert (row["samples_trained"], row["tokens_trained"]) == (2 * groups, 9 * groups)
        assert (row["samples_excluded"], row["tokens_excluded"]) == (2 * groups, 15 * groups)
        assert row["excluded"] == {"env_error": groups, "reward_failed": groups}
        assert row["reward_mean"] == pytest.approx(1 / 3)
        # The trainer saw the trained samples' completions only: 3 + 2 tokens a group.
        assert sum(s["tokens"] for s in row["shards"]) == 5 * groups
    assert summary.samples_trained == 2 * summary.groups_trained == 12
    assert summary.tokens_trained == sum(r["tokens_trained"] for r in rows) == 9 * 6
    trained = [e for h in ledger(tmp_path).values() for e in h if e["event"] == "trained"]
    assert len(trained) == summary.groups_trained
    assert all(e["rewards"] == [1.0, 0.0, 0.0] for e in trained)


def test_a_filtered_group_s_ledger_event_carries_its_members_rewards(tmp_path: Path) -> None:
    summary = run(masked_config(tmp_path, "zero_variance"),
                  {0: MixedRollout(0, flat_odd=True)}, [FakeTrainer(0)])
    assert summary.steps == 3 and summary.filtered_groups > 0
    events = [e for h in ledger(tmp_path).values() for e in h]
    filtered = [e for e in events if e["reason"] == "filtered"]
    trained = [e for e in events if e["event"] == "trained"]
    assert len(filtered) == summary.filtered_groups and len(trained) == 6
    assert all(e["rewards"] == [1.0, 1.0, 1.0] for e in filtered)
    assert all(e["rewards"] == [1.0, 0.0, 0.0] for e in trained)
