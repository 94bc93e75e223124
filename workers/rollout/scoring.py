"""Scoring a group's completions: the task's built-in reward, or the task's own rewards.

Owns: ``Scorer``, which the rollout worker and the idle-CPU evaluator score with. With no
``UserRewards`` it calls the built-in task reward per sample, in the caller's event loop
(those are pure and take microseconds), a raising or non-finite one scoring 0 and
flagged. With ``UserRewards`` (task.rewards) it scores through a
``workers.rewards.runner.RewardRunner``: off the caller's event loop, every call bounded
by task.reward_timeout_s, failures and timeouts counted, each reward's value of each
sample kept for the metrics (None where it has none); the rewards get the row's dataset
columns (``answer`` among them) and its ``data_source``, and, with the chat template on,
the prompt as messages. Multi-turn trajectories keep their environment's reward, plus
the task's own rewards' when there are any (``score_trajectories``). Only a group's
members are scored (``scored_by_task``): an excluded sample is never sent to a reward,
and a trajectory an environment failure ended under task.environment.on_error /
on_timeout = "train" scores 0 by every reward without a call. Knows nothing about
engines or groups' tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from buffers.common.records import Prompt, Sample
from workers.rewards.function import RewardFn, guarded_reward
from workers.rewards.runner import GroupRewards, RewardRunner, UserRewards
from workers.rollout.prompts import PromptFormat, reward_prompt
from workers.rollout.turns import ERROR, TIMEOUT


class Scored(msgspec.Struct, frozen=True, kw_only=True):
    """A group's samples with their rewards, and what scoring them cost."""

    samples: tuple[Sample, ...]
    errors: int = 0
    """Scores lost to a reward that raised or was not finite."""
    timeouts: int = 0
    """Scores lost to a reward call past its deadline."""
    saturated: int = 0
    """Of ``timeouts``, refused at once: every reward thread was stuck."""
    scores: dict[str, tuple[float | None, ...]] = {}
    """Per reward of task.rewards, and per extra metric ``<name>/<key>`` of a verl-style
    one: each sample's value, unweighted. None where there is none: an excluded sample
    (never scored), a lost score, a metric the sample did not give. A failed trajectory
    trained with reward 0 has 0 for every reward and no extra metric."""


def scored_by_task(sample: Sample, greedy: bool = False) -> bool:
    """Whether the rewards score ``sample``: not when it is no group member
    (``Sample.exclusion``: no reward call is spent on it), nor when an environment error
    or timeout ended its trajectory and it is kept anyway (on_error / on_timeout =
    "train", or "requeue"): a crashed, half-finished trajectory scores 0 by every
    reward, whatever its text would earn. An evaluation's ``greedy`` answer is no group
    member: it is scored whatever its tokens (an empty answer is a wrong one), unless an
    environment failure ended it."""
    if sample.env_outcome in (TIMEOUT, ERROR):
        return False
    return greedy or not sample.exclusion


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
        self.skipped = 0
        """Samples so far that no reward was called on (``scored_by_task``): each saved
        one call per per-sample reward."""

    def start(self) -> None:
        """Loads the task's own rewards and starts their pool (none without them)."""
        if self._user is not None and self._runner is None:
            self._runner = self._user.runner()

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None

    async def score(self, prompt: Prompt, samples: Sequence[Sample],
                    greedy: bool = False) -> Scored:
        """``samples`` (completions of ``prompt``) with their rewards set: those
        ``scored_by_task`` by the rewards, the others 0 without a call."""
        picked = [k for k, s in enumerate(samples) if scored_by_task(s, greedy)]
        self.skipped += len(samples) - len(picked)
        if self._user is None:
            got = {k: guarded_reward(self._reward_fn, prompt, samples[k].text) for k in picked}
            lost = sum(r is None for r in got.values())
            self.failures += lost
            return Scored(samples=tuple(
                msgspec.structs.replace(s, reward=got.get(k) or 0.0,
                                        reward_failed=k in got and got[k] is None)
                for k, s in enumerate(samples)), errors=lost)
        if self._runner is None:
            raise RuntimeError("Scorer.start() was not called")
        chosen = [samples[k] for k in picked]
        rewards = await self._runner.score(
            prompts=[reward_prompt(prompt, self._format)] * len(chosen),
            completions=[s.text for s in chosen],
            completion_ids=[s.token_ids for s in chosen],
            completion_turns=[list(s.messages) for s in chosen]
            if any(s.messages for s in chosen) else None,
            columns={"answer": prompt.answer, **prompt.columns},
            data_source=prompt.data_source) if chosen else GroupRewards(total=(), scores={})
        self.failures += rewards.errors + rewards.timeouts
        at = {k: i for i, k in enumerate(picked)}  # sample index -> index in ``rewards``
        named = set(self._runner.names)

        def value(name: str, values: tuple[float | None, ...], k: int) -> float | None:
            if k in at:
                return values[at[k]]
            return 0.0 if name in named and not samples[k].exclusion else None

        columns = dict.fromkeys(self._runner.names, ()) | rewards.scores
        return Scored(
            samples=tuple(msgspec.structs.replace(s, reward=rewards.total[at[k]],
                                                  reward_failed=rewards.failed[at[k]])
                          if k in at else msgspec.structs.replace(s, reward=0.0)
                          for k, s in enumerate(samples)),
            errors=rewards.errors, timeouts=rewards.timeouts, saturated=rewards.saturated,
            scores={name: tuple(value(name, values, k) for k in range(len(samples)))
                    for name, values in columns.items()})

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
        scored = await self.score(prompt, samples, greedy)
        name = self._user.eval_reward if greedy else ""
        return msgspec.structs.replace(scored, samples=tuple(
            msgspec.structs.replace(s, reward=(scored.scores[name][k] or 0.0) if name
                                    else s.reward + played.reward)
            for k, (s, played) in enumerate(zip(scored.samples, samples, strict=True))))

    async def score_greedy(self, prompt: Prompt, sample: Sample) -> Sample:
        """An evaluation's greedy ``sample`` of ``prompt``, its reward what accuracy
        averages: the reward named by task.eval_reward when there is one, else the
        weighted sum training uses."""
        scored = await self.score(prompt, [sample], greedy=True)
        name = self._user.eval_reward if self._user is not None else ""
        if not name:
            return scored.samples[0]
        return msgspec.structs.replace(scored.samples[0],
                                       reward=scored.scores[name][0] or 0.0)
