"""Greedy decoding with transformers: the held-out evaluator outside the rollout engines.

Owns: greedy completions of a batch of prompts (``greedy_completions``) and their mean
reward (``evaluate_accuracy``). The idle-CPU evaluator (``workers.eval.evaluator``), the
warm start of ``async-rl make-model`` and the race bench (which scores TRL with it)
share it. Knows nothing about engines, training or Ray.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from buffers.common.records import Prompt
from workers.rewards.function import RewardFn


@torch.no_grad()
def greedy_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str | Sequence[int]],
    *,
    max_new_tokens: int = 8,
) -> list[str]:
    """Greedy completions (EOS and everything after it removed), batched by prompt length.

    Each prompt is a text (encoded here) or its token ids, as given (a chat template's,
    from ``workers.rollout.prompts.render``).

    Prompts of equal token length share a batch, so there is no padding, no attention
    mask and no position shift: exactly what an engine computes for each prompt alone.
    Decoding keeps a KV cache (long-tail completions run to hundreds of tokens). A
    completion that never emitted EOS within ``max_new_tokens`` ends in ``<unk>``, so a
    reward with a format check rejects it even if the limit fell right after a valid
    answer.
    """
    eos, unk = tokenizer.eos_token_id, tokenizer.unk_token_id
    if eos is None or unk is None:
        raise ValueError("greedy_completions needs a tokenizer with EOS and UNK tokens")
    was_training = model.training
    model.eval()
    encoded = [tokenizer.encode(t) if isinstance(t, str) else list(t) for t in texts]
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(encoded):
        by_len[len(ids)].append(i)
    out: list[list[int]] = [[] for _ in texts]
    for members in by_len.values():
        step_input = torch.tensor([encoded[i] for i in members], dtype=torch.long)
        done = torch.zeros(len(members), dtype=torch.bool)
        cache = None
        for _ in range(max_new_tokens):
            result = model(input_ids=step_input, past_key_values=cache, use_cache=True)
            cache = result.past_key_values
            nxt = result.logits[:, -1].argmax(-1)
            for row, i in enumerate(members):
                if not done[row] and int(nxt[row]) != eos:
                    out[i].append(int(nxt[row]))
            done |= nxt == eos
            if bool(done.all()):
                break
            step_input = nxt[:, None]
        for row, i in enumerate(members):
            if not done[row]:
                out[i].append(unk)
    model.train(was_training)
    return [str(tokenizer.decode(token_ids)) for token_ids in out]


def evaluate_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    reward_fn: RewardFn,
    *,
    max_new_tokens: int = 8,
) -> float:
    """Mean reward of greedy completions: the accuracy for a 0/1 reward."""
    if not prompts:
        raise ValueError("evaluate_accuracy needs at least one prompt")
    texts = greedy_completions(
        model, tokenizer, [p.text for p in prompts], max_new_tokens=max_new_tokens
    )
    return sum(reward_fn(p, t) for p, t in zip(prompts, texts, strict=True)) / len(prompts)
