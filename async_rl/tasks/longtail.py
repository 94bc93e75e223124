"""The long-tail reasoning task: a remainder worked out by repeated subtraction.

Owns: the seeded prompt stream (``RemainderTask``), its reference reasoning traces, the
length distribution that makes them heavy-tailed, its disjoint held-out eval set and the
teacher completions of the supervised warm start. Knows nothing about tokenizers,
engines or training; its reward is ``async_rl.tasks.rewards.remainder_reward``.

A prompt is ``"N%k="``; the completion writes every subtraction of ``k`` until the
number is below ``k``, then the final answer after ``####``::

    47%9=47-9=38 38-9=29 29-9=20 20-9=11 11-9=2 #### 2

The number of steps ``m = N // k`` is drawn from a log-normal law, so completion lengths
look like reasoning traces: most are a few dozen tokens, a few run to hundreds. Each
step restates its operands, so it depends only on the text just before it: a two-digit
subtraction a small model can learn. The whole trace must be right for the final answer
to be, so long traces are harder.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

from async_rl.tasks.sources import IndexedSource, stable_unit
from buffers.common.records import Prompt

MAX_NUMBER = 99
"""Largest ``N``: every step is a subtraction of two-digit numbers."""
MAX_DIVISOR = 19
MAX_NEW_TOKENS = 256
"""The completion limit the task is built for: a few reference traces are longer."""


def reference_steps(number: int, divisor: int) -> list[str]:
    """The trace's steps ``"N-k=N-k"``, ..., ending at ``N % k`` (at least one)."""
    return [f"{a}-{divisor}={a - divisor}" for a in range(number, divisor - 1, -divisor)]


def reference_completion(number: int, divisor: int, final_answer: int | None = None) -> str:
    """The reference trace of ``N%k``, ending in ``#### <final_answer>`` (default: the
    true remainder; the warm-start teacher sometimes writes a wrong one)."""
    answer = number % divisor if final_answer is None else final_answer
    return " ".join(reference_steps(number, divisor)) + f" #### {answer}"


def parse_prompt(text: str) -> tuple[int, int]:
    """``(N, k)`` of a prompt text ``"N%k="``."""
    number, divisor = text.removesuffix("=").split("%")
    return int(number), int(divisor)


class RemainderTask(IndexedSource):
    """Endless ``N%k=`` prompts whose trace length ``N // k`` has a heavy tail.

    Prompt ``i`` depends only on seed and index: draw the step count ``m`` from
    ``round(exp(Normal(log(median_steps), sigma)))`` clipped to ``[1, max_steps]``, then
    a divisor ``k`` in ``[2, 19]`` with ``k * (m + 1) - 1 <= 99`` and ``N = k * m + r``
    for a remainder ``r`` in ``[0, k)``. With the defaults the reference completions
    (one token per character plus EOS) have a median of about 25 tokens, a 99th
    percentile about ten times that, and a few longer than 256 tokens.

    A fixed slice of all ``(N, k)`` problems (``held_out_fraction``, chosen by a
    seed-independent digest) never appears in training; ``eval_prompts`` draws from the
    same length law restricted to that slice.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        median_steps: float = 2.0,
        sigma: float = 1.1,
        max_steps: int = 49,
        held_out_fraction: float = 0.2,
        name: str = "longtail",
    ) -> None:
        if not 1.0 <= median_steps <= max_steps:
            raise ValueError(f"median_steps must be in [1, max_steps], got {median_steps}")
        if not 0 < max_steps <= MAX_NUMBER // 2:
            raise ValueError(f"max_steps must be in [1, {MAX_NUMBER // 2}], got {max_steps}")
        if sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {sigma}")
        if not 0.0 < held_out_fraction < 0.5:
            raise ValueError(f"held_out_fraction must be in (0, 0.5), got {held_out_fraction}")
        self._seed = seed
        self._median_steps = median_steps
        self._sigma = sigma
        self._max_steps = max_steps
        self._held_out_fraction = held_out_fraction
        self._name = name
        self._next_index = 0
        self._fingerprint = (
            f"longtail:name={name}:seed={seed}:median_steps={median_steps}:sigma={sigma}"
            f":max_steps={max_steps}:held_out={held_out_fraction}"
        )

    @property
    def name(self) -> str:
        return self._name

    def is_held_out(self, number: int, divisor: int) -> bool:
        """True for problems reserved for evaluation (never in the training stream)."""
        return stable_unit(f"held-out:{number}%{divisor}") < self._held_out_fraction

    def _draw(self, rng: random.Random) -> tuple[int, int]:
        steps = round(math.exp(rng.gauss(math.log(self._median_steps), self._sigma)))
        steps = min(max(steps, 1), self._max_steps)
        divisor = rng.randint(2, min(MAX_DIVISOR, (MAX_NUMBER + 1) // (steps + 1)))
        return divisor * steps + rng.randrange(divisor), divisor

    def _draws(self, rng: random.Random, held_out: bool) -> Iterator[tuple[int, int]]:
        # Rejection sampling keeps the length law of each split the same.
        while True:
            number, divisor = self._draw(rng)
            if self.is_held_out(number, divisor) == held_out:
                yield number, divisor

    @staticmethod
    def _make_prompt(prompt_id: str, number: int, divisor: int) -> Prompt:
        return Prompt(prompt_id=prompt_id, text=f"{number}%{divisor}=",
                      answer=str(number % divisor))

    def prompt_at(self, index: int) -> Prompt:
        """The training prompt at ``index``, without moving the cursor."""
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        rng = random.Random(f"{self._name}/{self._seed}/{index}")
        number, divisor = next(self._draws(rng, held_out=False))
        return self._make_prompt(f"{self._name}-{index}", number, divisor)

    def eval_prompts(self, n: int = 200) -> tuple[Prompt, ...]:
        """``n`` held-out problems drawn from the training length law, in a fixed order
        (ids ``<name>-eval-<i>``), independent of the cursor and of ``seed``.

        Draws may repeat a problem: with two-digit numbers the held-out slice has only
        a few hundred problems, and insisting on distinct ones would over-weight the
        rare long traces, measuring a harder set than the one trained on.
        """
        rng = random.Random(f"{self._name}/eval")
        draws = self._draws(rng, held_out=True)
        return tuple(self._make_prompt(f"{self._name}-eval-{i}", *next(draws))
                     for i in range(max(n, 0)))

    def teacher_completion(self, prompt: Prompt, rng: random.Random, accuracy: float) -> str:
        """The warm start's target: the full trace, with the final answer one too high
        ``1 - accuracy`` of the time (the trace itself is always right)."""
        number, divisor = parse_prompt(prompt.text)
        wrong = rng.random() >= accuracy
        return reference_completion(number, divisor, number % divisor + 1 if wrong else None)
