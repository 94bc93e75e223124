"""Scoring a group's completions: the task's built-in reward, or the task's own rewards.

Owns: ``Scorer``, which the rollout worker and the idle-CPU evaluator score with. With no
``UserRewards`` it calls the built-in task reward per sample, in the caller's event loop
(those are pure and take microseconds), a raising or non-finite one scoring 0 and
flagged. With ``UserRewards`` (task.rewards) it scores through a
``workers.rewards.runner.RewardRunner``: off the caller's event loop, every call bounded
by task.reward_timeout_s, failures and timeouts counted, each reward's group mean kept
for the metrics; the rewards get the row's dataset columns (``answer`` among them) and
its ``data_source``, and, with the chat template on, the prompt as messages. Multi-turn
trajectories keep their environment's reward, plus the task's own rewards' when there
are any (``score_trajectories``). Knows nothing about engines or groups' tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from buffers.records import Prompt, Sample
from workers.rewards.function import RewardFn, guarded_reward
from workers.rewards.runner import RewardRunner, UserRewards
from workers.rollout.prompts import PromptFormat, reward_prompt


class Scored(msgspec.Struct, frozen=True, kw_only=True):
    """A group's samples with their rewards, and what scoring them cost."""

    samples: tuple[Sample, ...]
    errors: int = 0
    """Scores lost to a reward that raised or was not finite."""
    timeouts: int = 0
    """Scores lost to a reward call past its deadline."""
    saturated: int = 0
    """Of ``timeouts``, refused at once: every reward thread was stuck."""
    means: dict[str, float] = {}
    """Per reward of task.rewards: its mean over the group."""


class Scorer:
    """See the module docstring; ``start`` in the process that scores, ``close`` at the
    end."""

    def __init__(self, reward_fn: RewardFn, user: UserRewards | None = None,
                 prompt_format: PromptFormat | None = None) -> None:
        """``prompt_format``: how prompts reach the model; with the chat template on, the
        task's own rewards get prompts (and TRL-style ones completions) as messages."""
        self._reward_fn, self._user = reward_fn, user
        self._format = prompt_format or PromptFormat()
        self._runner: RewardRunner | None = None
        self.failures = 0
        """Scores lost so far (errors and timeouts)."""

    def start(self) -> None:
        """Loads the task's own rewards and starts their pool (none without them)."""
        if self._user is not None and self._runner is None:
            self._runner = self._user.runner()

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None

    async def score(self, prompt: Prompt, samples: Sequence[Sample]) -> Scored:
        """``samples`` (completions of ``prompt``) with their rewards set."""
        if self._user is None:
            rewards = [guarded_reward(self._reward_fn, prompt, s.text) for s in samples]
            lost = sum(r is None for r in rewards)
            self.failures += lost
            return Scored(samples=tuple(
                msgspec.structs.replace(s, reward=r or 0.0, reward_failed=r is None)
                for s, r in zip(samples, rewards, strict=True)), errors=lost)
        if self._runner is None:
            raise RuntimeError("Scorer.start() was not called")
        got = await self._runner.score(
            prompts=[reward_prompt(prompt, self._format)] * len(samples),
            completions=[s.text for s in samples],
            completion_ids=[s.token_ids for s in samples],
            completion_turns=[list(s.messages) for s in samples]
            if any(s.messages for s in samples) else None,
            columns={"answer": prompt.answer, **prompt.columns},
            data_source=prompt.data_source)
        self.failures += got.errors + got.timeouts
        return Scored(
            samples=tuple(msgspec.structs.replace(s, reward=total, reward_failed=failed)
                          for s, total, failed in zip(samples, got.total, got.failed,
                                                      strict=True)),
            errors=got.errors, timeouts=got.timeouts, saturated=got.saturated,
            means=got.per_reward | got.extra)

    async def score_trajectories(self, prompt: Prompt, samples: Sequence[Sample],
                                 greedy: bool = False) -> Scored:
        """Multi-turn trajectories (``workers.rollout.turns``), each with its environment
        reward: that alone, or plus the task's own rewards when there are any (the
        built-in task reward does not apply). TRL-style rewards get each trajectory as
        its messages (the policy's turns as role "assistant", observations as "tool"),
        the other styles its whole text. ``greedy``: an evaluation's,
        scored by task.eval_reward alone when it names one."""
        if self._user is None:
            return Scored(samples=tuple(samples))
        scored = await self.score(prompt, samples)
        name = self._user.eval_reward if greedy else ""
        return msgspec.structs.replace(scored, samples=tuple(
            msgspec.structs.replace(s, reward=scored.means[name] if name
                                    else s.reward + played.reward)
            for s, played in zip(scored.samples, samples, strict=True)))

    async def score_greedy(self, prompt: Prompt, sample: Sample) -> Sample:
        """An evaluation's greedy ``sample`` of ``prompt``, its reward what accuracy
        averages: the reward named by task.eval_reward when there is one, else the
        weighted sum training uses."""
        scored = await self.score(prompt, [sample])
        name = self._user.eval_reward if self._user is not None else ""
        if not name:
            return scored.samples[0]
        return msgspec.structs.replace(scored.samples[0], reward=scored.means[name])
