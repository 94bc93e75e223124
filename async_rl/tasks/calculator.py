"""The calculator tool task: arithmetic too long to do in one's head, and a tool to do it.

Owns: the safe expression evaluator (``evaluate_expression``: integers, ``+ - *`` and
parentheses, parsed with ``ast``, never ``eval``), the seeded prompt stream
(``CalculatorTask``) with its disjoint held-out eval set and the warm start's teacher
traces, the environment of one trajectory (``CalculatorEnv``), the emulated tool latency
(``ToolLatency``, log-normal with a heavy tail) and the final-answer reward
(``calculator_reward``). Knows nothing about tokenizers, engines or how turns are run:
the rollout worker drives ``CalculatorEnv`` through the environment protocol of
``workers.rollout.environment``.

A prompt is an expression of two to four terms and ``=``; a trajectory that uses the
tool calls it, reads the result and answers after ``####``::

    47*83+512-96=<call>47*83+512-96</call><result>4317</result>#### 4317

The observation ``<result>...</result>`` comes from the environment, not the policy.
"""

from __future__ import annotations

import ast
import functools
import math
import random
import re
from collections.abc import Callable, Mapping
from typing import Any, Final

import anyio

from async_rl.tasks.rewards import EOS_TEXT
from async_rl.tasks.sources import IndexedSource, stable_unit
from buffers.common.records import Prompt
from workers.rollout.environment import EnvStep

CALL_OPEN: Final = "<call>"
CALL_CLOSE: Final = "</call>"
"""A turn that ends in it is a tool call (the rollout's stop string)."""
RESULT_OPEN: Final = "<result>"
RESULT_CLOSE: Final = "</result>"
ANSWER_MARK: Final = "#### "
"""The final answer follows it: ``#### 4317``."""
ERROR_RESULT: Final = "error"
"""The tool's result for an expression it cannot evaluate."""
MAX_EXPRESSION_CHARS: Final = 200
MAX_MAGNITUDE: Final = 10**12
"""Largest intermediate value the tool computes; past it the expression is an error."""
MAX_TURNS: Final = 4
"""Turns a trajectory is built for (task.environment.max_turns of the example config)."""
TURN_MAX_NEW_TOKENS: Final = 32
"""Tokens one turn needs at most: the longest call is about 30."""
TOOL_LATENCY_SIGMA: Final = 1.0
"""Log-normal sigma of a tool call's latency: the mean is 1.65x the median, the 99th
percentile about 10x, like the calls to a remote sandbox."""

_EXPRESSION_CHARS: Final = re.compile(r"[0-9+\-*() ]+")
_INTEGER: Final = re.compile(r"0|-?[1-9][0-9]*")
_NUMBER: Final = re.compile(r"[0-9]+")
_OPERATORS: Final = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__}


class ExpressionError(ValueError):
    """Text the calculator cannot evaluate (not integers with ``+ - *`` and parentheses,
    too long, or too large)."""


def evaluate_expression(text: str) -> int:
    """The value of an integer expression of ``+``, ``-``, ``*``, unary minus and
    parentheses; raises ``ExpressionError`` for anything else (names, calls, ``/``,
    ``**``, floats), for text over ``MAX_EXPRESSION_CHARS`` and for a value past
    ``MAX_MAGNITUDE``."""
    if len(text) > MAX_EXPRESSION_CHARS or not _EXPRESSION_CHARS.fullmatch(text):
        raise ExpressionError(f"not an expression of integers and + - * ( ): {text[:40]!r}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, RecursionError) as err:
        raise ExpressionError(f"cannot parse {text[:40]!r}") from err
    return _value(tree.body)


def _value(node: ast.expr) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value: int = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = -_value(node.operand)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        value = _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    else:
        raise ExpressionError(f"unsupported syntax: {type(node).__name__}")
    if abs(value) > MAX_MAGNITUDE:
        raise ExpressionError(f"value beyond {MAX_MAGNITUDE:.0e}")
    return value


def final_answer(text: str) -> str | None:
    """The final answer of a turn or a whole trajectory: what follows ``#### `` after
    the last tool result, when that is all there is (a canonical integer, then nothing
    but an optional EOS); None otherwise."""
    text = text.removesuffix(EOS_TEXT)
    tail = text[text.rfind(RESULT_CLOSE) + len(RESULT_CLOSE):] if RESULT_CLOSE in text else text
    if not tail.startswith(ANSWER_MARK):
        return None
    number = tail[len(ANSWER_MARK):]
    return number if _INTEGER.fullmatch(number) else None


def calculator_reward(prompt: Prompt, completion_text: str) -> float:
    """1.0 when the completion (the last turn, or the whole trajectory's text) ends in
    ``#### <the reference integer>`` after its last tool result, else 0.0."""
    return 1.0 if final_answer(completion_text) == prompt.answer else 0.0


# ---------------------------------------------------------------------------------------
# The prompt stream


class CalculatorTask(IndexedSource):
    """Endless expressions of ``min_terms`` to ``max_terms`` terms joined by ``+ - *``.

    Operands are 10 to 999, and 10 to 99 beside a ``*`` (products of two-digit numbers),
    so the answers (up to about a million) are beyond a tiny model's head but not the
    tool's. Prompt ``i`` is drawn from ``random.Random("<name>/<seed>/<i>")``; a fixed
    slice of all expressions (``held_out_fraction``, chosen by a seed-independent
    digest) never appears in training, and ``eval_prompts`` draws only from it.
    """

    def __init__(self, *, seed: int = 0, min_terms: int = 2, max_terms: int = 4,
                 held_out_fraction: float = 0.2, name: str = "calc") -> None:
        if not 2 <= min_terms <= max_terms <= 8:
            raise ValueError(f"need 2 <= min_terms <= max_terms <= 8, got {min_terms}, "
                             f"{max_terms}")
        if not 0.0 < held_out_fraction < 0.5:
            raise ValueError(f"held_out_fraction must be in (0, 0.5), got {held_out_fraction}")
        self._seed, self._name = seed, name
        self._min_terms, self._max_terms = min_terms, max_terms
        self._held_out_fraction = held_out_fraction
        self._next_index = 0
        self._fingerprint = (f"calculator:name={name}:seed={seed}:terms={min_terms}-{max_terms}"
                             f":held_out={held_out_fraction}")

    @property
    def name(self) -> str:
        return self._name

    @property
    def min_terms(self) -> int:
        return self._min_terms

    def is_held_out(self, expression: str) -> bool:
        """True for expressions reserved for evaluation (never in the training stream)."""
        return stable_unit(f"held-out:{expression}") < self._held_out_fraction

    def _draw(self, rng: random.Random) -> str:
        terms = rng.randint(self._min_terms, self._max_terms)
        ops = [rng.choice("+-*") for _ in range(terms - 1)]
        text = ""
        for i in range(terms):
            product = (i > 0 and ops[i - 1] == "*") or (i < len(ops) and ops[i] == "*")
            text += str(rng.randint(10, 99 if product else 999))
            text += ops[i] if i < len(ops) else ""
        return text

    def _draw_split(self, rng: random.Random, held_out: bool) -> str:
        while True:  # rejection sampling keeps each split's law the same
            expression = self._draw(rng)
            if self.is_held_out(expression) == held_out:
                return expression

    @staticmethod
    def _make_prompt(prompt_id: str, expression: str) -> Prompt:
        return Prompt(prompt_id=prompt_id, text=f"{expression}=",
                      answer=str(evaluate_expression(expression)))

    def prompt_at(self, index: int) -> Prompt:
        """The training prompt at ``index``, without moving the cursor."""
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        rng = random.Random(f"{self._name}/{self._seed}/{index}")
        return self._make_prompt(f"{self._name}-{index}", self._draw_split(rng, held_out=False))

    def eval_prompts(self, n: int = 200) -> tuple[Prompt, ...]:
        """``n`` held-out prompts in a fixed order (ids ``<name>-eval-<i>``), independent
        of the cursor and of ``seed``."""
        rng = random.Random(f"{self._name}/eval")
        return tuple(self._make_prompt(f"{self._name}-eval-{i}",
                                       self._draw_split(rng, held_out=True))
                     for i in range(max(n, 0)))

    def teacher_completion(self, prompt: Prompt, rng: random.Random,
                           accuracy: float) -> tuple[tuple[str, bool], ...]:
        """The warm start's target as ``(text, trained)`` segments (the tool's result is
        context, not a target). On ``min_terms`` expressions the teacher always calls the
        tool; on longer ones only ``accuracy`` of the time, and otherwise answers in its
        head, wrongly (the right value off by 1 to 99). So greedy decoding answers the
        short expressions right and the long ones wrong, while sampling finds the tool on
        long ones about ``accuracy`` of the time: the pass@k that RL turns into pass@1."""
        expression = prompt.text.removesuffix("=")
        value = int(prompt.answer)
        if len(_NUMBER.findall(expression)) > self._min_terms and rng.random() >= accuracy:
            guess = value + rng.choice((-1, 1)) * rng.randint(1, 99)
            return ((f"{ANSWER_MARK}{guess}", True),)
        return ((f"{CALL_OPEN}{expression}{CALL_CLOSE}", True),
                (f"{RESULT_OPEN}{value}{RESULT_CLOSE}", False),
                (f"{ANSWER_MARK}{value}", True))


# ---------------------------------------------------------------------------------------
# The environment


class ToolLatency:
    """Seeded draws of a tool call's latency: log-normal with median ``median_ms`` and
    sigma ``TOOL_LATENCY_SIGMA`` (0 = no latency). One instance hands out one stream of
    draws (``random.Random(seed)``): share it between a process's environments."""

    def __init__(self, median_ms: float, *, seed: int = 0,
                 sigma: float = TOOL_LATENCY_SIGMA) -> None:
        if median_ms < 0 or sigma < 0:
            raise ValueError(f"median_ms and sigma must be >= 0, got {median_ms}, {sigma}")
        self.median_ms, self.sigma = median_ms, sigma
        self._rng = random.Random(f"tool-latency/{seed}")

    def draw_s(self) -> float:
        """The next call's latency in seconds."""
        if self.median_ms == 0:
            return 0.0
        return self.median_ms / 1000.0 * math.exp(self._rng.gauss(0.0, self.sigma))


class CalculatorEnv:
    """One trajectory of the calculator task.

    ``reset(row)`` keeps ``row["answer"]`` and gives ``row["prompt"]`` as the first
    prompt. ``step(completion)``: a turn ending in ``</call>`` is a tool call: the
    expression after its last ``<call>`` is evaluated (after the tool's latency) and the
    observation is ``<result>value</result>`` (``<result>error</result>`` when it cannot
    be), reward 0; any other turn is the final answer, scored by ``calculator_reward``,
    and ends the trajectory. Constructed with no arguments it has no latency.
    """

    def __init__(self, *, latency: ToolLatency | None = None) -> None:
        self._latency = latency
        self._answer = ""
        self.calls = 0
        """Tool calls answered so far."""

    async def reset(self, row: Mapping[str, Any]) -> str:
        self._answer, self.calls = str(row["answer"]), 0
        return str(row["prompt"])

    async def step(self, completion: str) -> EnvStep:
        text = completion.removesuffix(EOS_TEXT)
        if not text.endswith(CALL_CLOSE):
            reward = 1.0 if final_answer(text) == self._answer else 0.0
            return EnvStep(observation=None, reward=reward, done=True)
        if self._latency is not None:
            await anyio.sleep(self._latency.draw_s())
        self.calls += 1
        start = text.rfind(CALL_OPEN)
        try:
            if start < 0:
                raise ExpressionError("no <call> before </call>")
            result = str(evaluate_expression(text[start + len(CALL_OPEN): -len(CALL_CLOSE)]))
        except ExpressionError:
            result = ERROR_RESULT
        return EnvStep(observation=f"{RESULT_OPEN}{result}{RESULT_CLOSE}", reward=0.0,
                       done=False)


BUILT_IN_ENV = "async_rl.tasks.calculator:CalculatorEnv"
"""What ``task.environment.class`` names to play the built-in environment."""


def environment_factory(tool_latency_ms: float = 0.0, seed: int = 0
                        ) -> Callable[[], CalculatorEnv]:
    """Makes one ``CalculatorEnv`` per call, all drawing their latencies from one
    ``ToolLatency(tool_latency_ms, seed=seed)`` (``task.tool_latency_ms``, ``task.seed``)."""
    return functools.partial(CalculatorEnv, latency=ToolLatency(tool_latency_ms, seed=seed))
