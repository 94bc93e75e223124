"""IdleCpuEvaluator: held-out evaluations of exact policy versions on CPU time nobody wants.

Owns: a transformers copy of the policy on the CPU, loaded before each evaluation with
the weights of the version to score (trainer shard 0's state, passed by reference), its
greedy completions (``workers.eval.greedy.greedy_completions``, the evaluator the race
bench scores TRL with) and their mean reward, all at the OS's idle scheduling priority.

Why a process of its own at ``SCHED_IDLE``: an evaluation on a rollout engine shares the
engine with generation (on the long-tail CPU task 4-5 s of the rollout core per
evaluation, every 10 steps) and scores whatever versions the engine runs meanwhile. Here
the Linux scheduler runs it only on a core whose own workers have nothing to run, so
training loses no cycles to it, and every token comes from the one version asked for.
Knows nothing about Ray, when evaluations fall due or the run's clock.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from buffers.common.records import Prompt, Sample
from buffers.common.reports import EvalResult
from workers.eval.greedy import greedy_completions
from workers.eval.spec import EvaluatorSpec
from workers.rollout.prompts import render
from workers.rollout.scoring import Scorer
from workers.rollout.task import WorkerTask

EVALUATOR_RANK = -1
"""``EvalResult.rollout_rank`` of this evaluator's results (no rollout worker ran them)."""


def idle_priority() -> None:
    """Puts the calling thread in ``SCHED_IDLE``: it runs only when its core has nothing
    else to run. Lowering one's own priority needs no privilege."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


class IdleCpuEvaluator:
    """See the module docstring. ``setup`` once, then ``evaluate`` per version."""

    def __init__(self, spec: EvaluatorSpec, task: WorkerTask) -> None:
        """``spec``: the model section it loads and rollout.max_new_tokens, the
        completion cap a rollout worker's greedy evaluation has too; ``task``: what the
        rollout workers get of the task (its environment unused: evaluation here is
        single-turn)."""
        self.model_config = spec.model
        self.prompt_format = task.prompt_format
        """Renders prompts as a rollout worker does (``workers.rollout.prompts``)."""
        self.scorer = Scorer(task.reward_fn, task.user_rewards, self.prompt_format)
        """Scores as a rollout worker does (the task's own rewards when it has them)."""
        self.max_new_tokens = spec.max_new_tokens

    def setup(self) -> int:
        """Loads the model and tokenizer from ``model.path``; returns the pid."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        idle_priority()
        # One thread: a second one would wait at every operation's barrier whenever its
        # core is taken, and a single thread can still run on whichever core is free.
        torch.set_num_threads(1)
        self.scorer.start()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_config.path)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_config.path, dtype=getattr(torch, self.model_config.dtype))
        self.model.eval()
        return os.getpid()

    def evaluate(self, prompts: Sequence[Prompt], state: Mapping[str, torch.Tensor],
                 version: int) -> EvalResult:
        """Greedy accuracy of the policy whose weights are ``state``, labelled ``version``."""
        if not prompts:
            raise ValueError("evaluate needs at least one prompt")
        idle_priority()  # the thread Ray runs this call on may not be the one set up
        began = time.perf_counter()
        self.model.load_state_dict(state)
        rendered = [render(self.tokenizer, p, self.prompt_format) for p in prompts]
        texts = greedy_completions(self.model, self.tokenizer, rendered,
                                   max_new_tokens=self.max_new_tokens)
        # A loop of its own, in a thread of its own: the actor's thread may already run
        # one (Ray's), and asyncio.run refuses to nest.
        with ThreadPoolExecutor(max_workers=1) as scoring:
            rewards = scoring.submit(asyncio.run, self._rewards(prompts, texts)).result()
        return EvalResult(
            accuracy=sum(rewards) / len(rewards), version_min=version, version_max=version,
            num_prompts=len(rewards), rollout_rank=EVALUATOR_RANK,
            seconds=time.perf_counter() - began,
        )

    @property
    def reward_failures(self) -> int:
        """Scores lost so far to a reward that raised, was not finite or timed out."""
        return self.scorer.failures

    async def _rewards(self, prompts: Sequence[Prompt], texts: Sequence[str]) -> list[float]:
        """As a rollout worker scores: a reward that raises or is not finite counts 0."""
        rewards = []
        for prompt, text in zip(prompts, texts, strict=True):
            sample = Sample(token_ids=(), logprobs=(), versions=(), finish_reason="stop",
                            text=text)
            rewards.append((await self.scorer.score_greedy(prompt, sample)).reward)
        return rewards
