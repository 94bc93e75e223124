"""Reward functions for the built-in tasks.

Owns: the exact-answer arithmetic reward with its format check, the GSM8K-style numeric
reward with its answer extraction. Knows nothing about tokens, engines, groups or
advantages: it scores one decoded completion against ``Prompt.answer``.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Final

from buffers.common.records import Prompt

EOS_TEXT: Final = "</s>"
"""The end-of-sequence token's text (see ``async_rl.models.tiny_model``). Engines usually strip
it from the decoded completion; when they keep it (``skip_special_tokens=False``) the
rewards below drop one trailing copy so both conventions score the same."""

# Canonical integers only: "7", "-3", "0"; not "07", "+7", "-0" or "7.0".
_INTEGER: Final = re.compile(r"0|-?[1-9][0-9]*")
# A number as people write it in GSM8K: optional sign, thousands commas, a decimal part.
_NUMBER: Final = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?")
_HASH_ANSWER: Final = re.compile(r"####\s*(" + _NUMBER.pattern + r")")
# The remainder task's trace: "a-k=b" steps separated by single spaces, then the answer.
_REMAINDER_TRACE: Final = re.compile(
    r"(?:[0-9]+-[0-9]+=-?[0-9]+ )*#### (" + _INTEGER.pattern + r")"
)


def _strip_eos(text: str) -> str:
    return text[: -len(EOS_TEXT)] if text.endswith(EOS_TEXT) else text


def arithmetic_reward(prompt: Prompt, completion_text: str) -> float:
    """1.0 when the completion is exactly the reference integer, else 0.0.

    Format rule: the completion must be just the number in canonical form (optional minus
    sign, digits, no leading zeros, no spaces, no ``+``, no other text) followed by
    end-of-sequence. A wrong format
    scores 0 and so does a well-formed wrong number: no partial credit, so the mean reward
    is the accuracy. The reward cannot see the finish reason, so "followed by EOS" holds
    as long as the engine's ``max_tokens`` exceeds the longest answer: a completion that
    never emitted EOS is then longer than any answer and fails the format check.
    """
    text = _strip_eos(completion_text)
    if _INTEGER.fullmatch(text) is None:
        return 0.0
    return 1.0 if int(text) == int(prompt.answer) else 0.0


def _parse_number(text: str) -> Fraction:
    # Fraction rather than float: "0.1" and "0.10" are equal and nothing rounds.
    return Fraction(text.replace(",", ""))


def extract_gsm8k_answer(text: str) -> str | None:
    """The final answer of a GSM8K-style solution: the number after ``####`` if there is
    one, else the last number in the text; ``None`` when the text holds no number."""
    text = _strip_eos(text)
    marked = _HASH_ANSWER.findall(text)
    if marked:
        return str(marked[-1])
    numbers = _NUMBER.findall(text)
    return str(numbers[-1]) if numbers else None


def gsm8k_reward(prompt: Prompt, completion_text: str) -> float:
    """1.0 when the completion's final number equals the reference answer numerically.

    The reference (``prompt.answer``) may be a bare number or a full solution ending in
    ``#### 42``; both sides go through ``extract_gsm8k_answer``, so "1,234", "1234" and
    "1234.0" match. No number in the completion scores 0.
    """
    got = extract_gsm8k_answer(completion_text)
    want = extract_gsm8k_answer(prompt.answer)
    if got is None or want is None:
        return 0.0
    return 1.0 if _parse_number(got) == _parse_number(want) else 0.0


def remainder_reward(prompt: Prompt, completion_text: str) -> float:
    """1.0 when a long-tail (remainder) completion is well formed and its final answer
    is the reference integer, else 0.0.

    Format rule: space-separated ``a-k=b`` steps, then ``#### <answer>`` in canonical form,
    then end-of-sequence; nothing else. The steps themselves are not checked (a wrong
    step almost always leads to a wrong answer). A completion cut off at the token limit
    has no ``####`` at its end and scores 0.
    """
    match = _REMAINDER_TRACE.fullmatch(_strip_eos(completion_text))
    if match is None:
        return 0.0
    return 1.0 if int(match.group(1)) == int(prompt.answer) else 0.0
