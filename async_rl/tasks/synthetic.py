"""Made-up rollout groups of the long-tail task's length shape, for runs without rollout.

Owns: ``long_tail_groups``, the fixed batch of the trainer benchmarks and of `async-rl
compare`: random token ids, behaviour logprobs and 0/1 rewards, each sample as long as
a reference completion of ``async_rl.tasks.longtail``'s, the same for the same seed.
Knows nothing about tokenizers, engines or training.
"""

from __future__ import annotations

import random

from async_rl.tasks.longtail import RemainderTask, parse_prompt, reference_completion
from buffers.common.records import Group, Sample, make_group


def long_tail_groups(n: int, seed: int, group_size: int = 8) -> list[Group]:
    """Groups of ``n`` sequences in all, shaped like the long-tail task's (random token ids in
    3..258, random behaviour logprobs and 0/1 rewards; each sample as long as the
    reference completion of a fresh prompt): the same ``seed``, the same groups."""
    task, rng = RemainderTask(seed=seed), random.Random(seed)
    out = []
    for g in range(n // group_size):
        prompt = task.prompt_at(g)
        samples = []
        for k in range(group_size):
            number, divisor = parse_prompt(task.prompt_at(g * group_size + k).text)
            completion = len(reference_completion(number, divisor)) + 1  # + EOS
            samples.append(Sample(
                token_ids=tuple(rng.randrange(3, 259) for _ in range(completion)),
                logprobs=tuple(-rng.uniform(0.1, 3.0) for _ in range(completion)),
                versions=(0,) * completion, finish_reason="stop", text="",
                reward=float(rng.random() < 0.5)))
        out.append(make_group(prompt, tuple(rng.randrange(3, 259) for _ in prompt.text),
                              tuple(samples)))
    return out
