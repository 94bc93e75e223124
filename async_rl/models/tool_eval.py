"""Greedy multi-turn evaluation with transformers: a policy that talks to environments.

Owns: ``evaluate_with_environment``, the held-out accuracy of a warm-started model on a
task with tools (``async-rl make-model --task calculator``), measured outside any engine:
each turn is greedy up to a stop string or EOS, the environment answers, and its
observation joins the context of the next turn. Knows nothing about vLLM, Ray or
training; the rollout workers run multi-turn trajectories themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from buffers.common.records import Prompt
from workers.eval.greedy import greedy_completions
from workers.rollout.environment import Environment


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` up to and including the first of ``stops`` in it (all of it if none)."""
    ends = [text.index(s) + len(s) for s in stops if s in text]
    return text[: min(ends)] if ends else text


def evaluate_with_environment(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    make_env: Callable[[], Environment],
    *,
    stops: Sequence[str],
    max_turns: int,
    max_new_tokens: int,
) -> float:
    """Mean trajectory reward (the sum of its steps' rewards) of greedy trajectories,
    one fresh environment per prompt (``reset`` gets the row ``{"prompt", "answer",
    "prompt_id"}`` and must return text).

    Greedy decoding is deterministic, so a turn generated past a stop string and cut
    there (``cut_at_stop``) is the turn an engine stopping at it writes. A trajectory
    not done after ``max_turns`` turns scores what its steps gave so far.
    """
    if not prompts:
        raise ValueError("evaluate_with_environment needs at least one prompt")

    async def run() -> float:
        envs = [make_env() for _ in prompts]
        contexts: list[str] = []
        for env, prompt in zip(envs, prompts, strict=True):
            first = await env.reset({"prompt": prompt.text, "answer": prompt.answer,
                                     "prompt_id": prompt.prompt_id})
            if not isinstance(first, str):
                raise TypeError("evaluate_with_environment needs text prompts, not messages")
            contexts.append(first)
        rewards = [0.0] * len(prompts)
        active = list(range(len(prompts)))
        for _ in range(max_turns):
            if not active:
                break
            turns = greedy_completions(model, tokenizer, [contexts[i] for i in active],
                                       max_new_tokens=max_new_tokens)
            still = []
            for i, turn in zip(active, turns, strict=True):
                turn = cut_at_stop(turn, stops)
                step = await envs[i].step(turn)
                rewards[i] += step.reward
                if not step.done:
                    contexts[i] += turn + (step.observation or "")
                    still.append(i)
            active = still
        return sum(rewards) / len(prompts)

    return anyio.run(run)
