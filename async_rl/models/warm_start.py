"""The supervised warm start that makes a fresh local model a weak but useful base policy.

Owns: teacher-forced training on ``prompt + teacher completion + EOS`` for any task that
can write a teacher completion (``TeacherTask``), whose untrained spans (a tool's
results) are context without loss, with batches cut into length-sorted chunks so
long-tail tasks do not pay for padding. Knows nothing about model shapes,
tokenizer construction, vLLM or RL: ``async_rl.models.tiny_model`` calls it while building a
model.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Final, Protocol, TypeAlias

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from buffers.common.records import Prompt

IGNORE: Final = -100
"""Label of positions without loss (the prompt, untrained spans and padding)."""
Segments: TypeAlias = Sequence[tuple[str, bool]]
"""A teacher completion as ``(text, trained)`` spans, in order."""


class TeacherTask(Protocol):
    """A prompt stream whose teacher can write a (sometimes wrong) target completion."""

    def next_prompt(self) -> Prompt: ...

    def teacher_completion(self, prompt: Prompt, rng: random.Random,
                           accuracy: float) -> str | Segments:
        """The target text after the prompt (EOS is added by the warm start), or its
        ``(text, trained)`` spans when some of it is context rather than target."""
        ...


def _example(tokenizer: PreTrainedTokenizerBase, prompt: Prompt, completion: str | Segments,
             eos_id: int) -> tuple[list[int], list[int]]:
    """Token ids and labels of ``prompt + completion + EOS``: the prompt's and untrained
    spans' labels are ``IGNORE``."""
    ids = tokenizer.encode(prompt.text)
    labels = [IGNORE] * len(ids)
    spans = [(completion, True)] if isinstance(completion, str) else completion
    for text, trained in spans:
        span = tokenizer.encode(text)
        ids += span
        labels += span if trained else [IGNORE] * len(span)
    return [*ids, eos_id], [*labels, eos_id]


def _chunks(
    examples: Sequence[tuple[list[int], list[int]]], max_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Sorted by length and cut so each padded chunk stays under max_tokens: a batch of
    # long-tail lengths padded to its longest row would be mostly padding. Right padding
    # needs no attention mask: a causal model never looks ahead, and labels skip it.
    order = sorted(examples, key=lambda e: len(e[0]))
    chunks: list[list[tuple[list[int], list[int]]]] = [[]]
    for example in order:
        if chunks[-1] and len(example[0]) * (len(chunks[-1]) + 1) > max_tokens:
            chunks.append([])
        chunks[-1].append(example)
    out = []
    for chunk in chunks:
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), 0, dtype=torch.long)
        labels = torch.full((len(chunk), width), IGNORE, dtype=torch.long)
        for row, (seq, lab) in enumerate(chunk):
            ids[row, : len(seq)] = torch.tensor(seq)
            labels[row, : len(lab)] = torch.tensor(lab)
        out.append((ids, labels))
    return out


def supervised_warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: TeacherTask,
    *,
    steps: int,
    eos_id: int,
    batch_size: int = 64,
    lr: float = 2e-3,
    teacher_accuracy: float = 1.0,
    seed: int = 0,
    chunk_tokens: int = 2048,
    log: Callable[[str], None] | None = None,
) -> None:
    """Teacher-forced training on ``prompt + teacher completion + EOS``, loss on the
    completion's trained spans and EOS only, mean over the batch's target tokens.

    The teacher (``task.teacher_completion``) gets the final answer right with
    probability ``teacher_accuracy`` and otherwise one too high, drawn per example from
    ``random.Random("teacher/<seed>")``. Below one half the model learns the task but
    prefers the wrong final answer: greedy decoding is often wrong while sampling finds
    the right answer about ``teacher_accuracy`` of the time. That is the regime RL
    post-training fixes quickly (turning pass@k into pass@1), so a short RL run shows a
    clear gain. Linear warm-up over the first tenth of the steps, then cosine decay to
    lr/10. Each batch runs as length-sorted chunks of at most ``chunk_tokens`` padded
    positions, with gradients accumulated over the chunks.
    """
    if steps <= 0:
        return
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, steps // 10)

    def schedule(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    teacher = random.Random(f"teacher/{seed}")
    for step in range(steps):
        examples = []
        for _ in range(batch_size):
            prompt = task.next_prompt()
            completion = task.teacher_completion(prompt, teacher, teacher_accuracy)
            examples.append(_example(tokenizer, prompt, completion, eos_id))
        targets = sum(len(ids) - lab.count(IGNORE) for ids, lab in examples)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for ids, labels in _chunks(examples, chunk_tokens):
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                ignore_index=IGNORE, reduction="sum",
            ) / targets
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if log is not None and (step + 1) % max(1, steps // 5) == 0:
            log(f"  sft step {step + 1}/{steps}  loss {total:.3f}")
    model.eval()
