"""Only a group's members are scored: an excluded sample is never sent to a reward, and a
trajectory an environment failure ended under task.environment.on_error / on_timeout =
"train" scores 0 by every reward (each named one too), whatever its text would earn.
Rewards that always return 1.0 and count their calls; a fake engine and environment
(no Ray, no vLLM, no model)."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Any

import pytest

import async_rl
from buffers.common.records import NO_POLICY_TOKEN, Prompt, Sample
from tests.unit.turn_fakes import ByteTokenizer, Params
from workers.rewards.runner import UserRewards
from workers.rollout.environment import EnvironmentConfig
from workers.rollout.prompts import PromptFormat
from workers.rollout.scoring import Scorer
from workers.rollout.turns import TurnRunner

PROMPT = Prompt(prompt_id="p0", text="2+2=", answer="4")


class Calls:
    """Rewards that score every completion 1.0 and count the completions they got."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: Counter[str] = Counter()

    def per_sample(self) -> Any:
        def always(prompt: str, completion: str) -> float:
            with self.lock:
                self.seen["always"] += 1
            return 1.0

        return always

    def per_group(self) -> Any:
        def group_ones(completions: list[Any], **kwargs: Any) -> list[float]:
            with self.lock:
                self.seen["group_ones"] += len(completions)
            return [1.0] * len(completions)

        return group_ones

    def scorer(self, eval_reward: str = "") -> Scorer:
        scorer = Scorer(lambda prompt, text: 1.0, UserRewards(
            specs=(async_rl.Reward(fn=self.per_sample()),
                   async_rl.Reward(fn=self.per_group())),
            threads=True, eval_reward=eval_reward))
        scorer.start()
        return scorer


def trajectory(outcome: str, *, excluded: str = "", tokens: int = 3,
               reward: float = 0.0) -> Sample:
    """A played trajectory as ``TurnRunner`` makes it (its environment reward set)."""
    return Sample(token_ids=(7,) * tokens, logprobs=(-0.1,) * tokens,
                  versions=(0,) * tokens, finish_reason="stop", text="4" * tokens,
                  reward=reward, env_outcome=outcome, excluded=excluded)


def score(scorer: Scorer, samples: list[Sample], greedy: bool = False) -> Any:
    try:
        return asyncio.run(scorer.score_trajectories(PROMPT, samples, greedy=greedy))
    finally:
        scorer.close()


# ---- a "train"-policy failure scores 0 by every reward ----------------------------------


class CrashesEveryOther:
    """Every second instance raises in its first step (a sandbox that crashed)."""

    made = 0

    def __init__(self) -> None:
        CrashesEveryOther.made += 1
        self.crashes = CrashesEveryOther.made % 2 == 0

    async def reset(self, row: dict[str, Any]) -> str:
        return str(row["prompt"])

    async def step(self, completion: str) -> Any:
        if self.crashes:
            raise RuntimeError("sandbox crashed")
        return async_rl.EnvStep(None, 0.0, True)


async def answer_4(context: list[int], params: Any) -> Sample:
    return Sample(token_ids=(52,), logprobs=(-0.1,), versions=(0,), finish_reason="stop",
                  text="4")


@pytest.mark.parametrize("policy", ["on_error", "on_timeout"])
def test_a_train_policy_failure_scores_0_by_every_reward_without_a_call(policy: str) -> None:
    if policy == "on_error":
        CrashesEveryOther.made = 0
        turns = TurnRunner(EnvironmentConfig(class_="unused:Unused", on_error="train"),
                           ByteTokenizer(), PromptFormat(), max_new_tokens=8,
                           make_environment=CrashesEveryOther)
        try:
            played = asyncio.run(turns.group(PROMPT, 4, answer_4, Params()))[1]
        finally:
            turns.close()
        failed = "error"
    else:  # what a step past turn_timeout_s leaves with on_timeout = "train"
        played = [trajectory("done"), trajectory("timeout")] * 2
        failed = "timeout"
    assert [s.env_outcome for s in played] == ["done", failed] * 2
    assert all(not s.exclusion for s in played)  # "train": all four are members
    calls = Calls()
    scorer = calls.scorer()
    scored = score(scorer, played)
    # The crashed trajectories answered "4" too: today each scored 2.0 (1.0 per reward).
    assert [s.reward for s in scored.samples] == [2.0, 0.0, 2.0, 0.0]
    assert scored.scores == {"always": (1.0, 0.0, 1.0, 0.0),
                             "group_ones": (1.0, 0.0, 1.0, 0.0)}
    assert calls.seen == {"always": 2, "group_ones": 2}
    assert scorer.skipped == 2 and (scored.errors, scored.timeouts) == (0, 0)


def test_a_failed_greedy_trajectory_scores_0_by_the_eval_reward_too() -> None:
    calls = Calls()
    scorer = calls.scorer(eval_reward="always")
    [crashed] = score(scorer, [trajectory("error")], greedy=True).samples
    assert crashed.reward == 0.0 and calls.seen == {}


# ---- an excluded sample is never sent to a reward ---------------------------------------


def test_excluded_samples_are_never_sent_to_the_task_s_rewards() -> None:
    reset_failed = Sample(token_ids=(), logprobs=(), versions=(), finish_reason="abort",
                          text="", env_outcome="error", excluded="env_error")
    samples = [trajectory("done"), trajectory("timeout", excluded="env_timeout"),
               reset_failed, trajectory("max_turns")]
    assert reset_failed.exclusion == "env_error"
    calls = Calls()
    scorer = calls.scorer()
    scored = score(scorer, samples)
    assert calls.seen == {"always": 2, "group_ones": 2}
    assert scorer.skipped == 2
    # None: no verdict to average (an excluded sample is no 0 in reward/<name>).
    assert scored.scores == {"always": (1.0, None, None, 1.0),
                             "group_ones": (1.0, None, None, 1.0)}
    assert [s.reward for s in scored.samples] == [2.0, 0.0, 0.0, 2.0]
    assert not any(s.reward_failed for s in scored.samples)


def test_no_member_no_reward_call() -> None:
    excluded = [trajectory("error", excluded="env_error") for _ in range(3)]
    calls = Calls()
    scorer = calls.scorer()
    scored = score(scorer, excluded)
    assert calls.seen == {} and scorer.skipped == 3
    assert scored.scores == {"always": (None,) * 3, "group_ones": (None,) * 3}
    assert [s.reward for s in scored.samples] == [0.0] * 3


def test_one_member_is_scored_alone() -> None:
    calls = Calls()
    scorer = calls.scorer()
    scored = score(scorer, [trajectory("done"), trajectory("error", excluded="env_error")])
    assert calls.seen == {"always": 1, "group_ones": 1}
    assert scored.scores["always"] == (1.0, None)


def test_the_built_in_reward_skips_a_sample_without_a_policy_token() -> None:
    seen: list[str] = []

    def built_in(prompt: Prompt, text: str) -> float:
        seen.append(text)
        return 1.0

    empty = Sample(token_ids=(), logprobs=(), versions=(), finish_reason="stop", text="")
    answered = Sample(token_ids=(52,), logprobs=(-0.1,), versions=(0,), finish_reason="stop",
                      text="4")
    assert empty.exclusion == NO_POLICY_TOKEN
    scorer = Scorer(built_in)
    scored = asyncio.run(scorer.score(PROMPT, [answered, empty, answered]))
    assert seen == ["4", "4"] and scorer.skipped == 1
    assert [s.reward for s in scored.samples] == [1.0, 0.0, 1.0]
    assert asyncio.run(scorer.score(PROMPT, [])).samples == ()
