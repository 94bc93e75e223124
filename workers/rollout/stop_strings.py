"""Where a multi-turn turn ends at a stop string, in tokens and in text, consistently.

Owns: ``cut_at_stop``. vLLM matches task.environment.stop on the detokenised text and
cuts the text, not the tokens: with a BPE tokenizer the token that completes a stop
string can carry characters past it (a merged ``">="`` after ``"</call"``), so decoding
the turn's token ids again gives text that runs past the stop string, and an environment
testing ``completion.endswith("</call>")`` misjudges the turn. ``cut_at_stop`` keeps the
shortest token prefix whose text holds a stop string (with its logprobs and versions)
and hands back the text cut right after that stop string. The last kept token may still
carry characters past the stop string (cutting inside a token would change what the
policy wrote, and its logprob); the text for ``step`` ends at the stop string. Pure:
knows nothing about engines or environments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec


class StopCut(msgspec.Struct, frozen=True, kw_only=True):
    """A turn cut at its first stop string (or whole, when it holds none)."""

    token_ids: tuple[int, ...]
    """The shortest prefix of the turn's tokens whose text holds the stop string."""
    logprobs: tuple[float, ...]
    """Their behaviour logprobs (aligned with ``token_ids``)."""
    versions: tuple[int, ...]
    """The policy version of each (aligned with ``token_ids``)."""
    text: str
    """What ``step`` gets: the kept tokens' text, ending right after the stop string."""
    stop: str = ""
    """The stop string the turn ended at; "" when it holds none (kept whole)."""


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The end offset in ``text`` of the stop string that ends first, and that string."""
    found = [(at + len(s), s) for s in stops if s and (at := text.find(s)) >= 0]
    return min(found) if found else None


def cut_at_stop(token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
                tokenizer: Any, stops: Sequence[str], *,
                skip_special_tokens: bool = True) -> StopCut:
    """The turn ``token_ids`` (with aligned ``logprobs`` and ``versions``) cut at the first
    of ``stops`` its text holds, decoded by ``tokenizer`` as the rollout worker decodes
    (``skip_special_tokens``). The prefix is found by bisection over decoded prefixes: a
    few decodes, not one per token (once a prefix's text holds a stop string every
    longer one does; a byte sequence cut mid-character decodes to U+FFFD until it is
    whole, which no stop string holds)."""
    if not len(token_ids) == len(logprobs) == len(versions):
        raise ValueError(f"{len(token_ids)} token ids came with {len(logprobs)} logprobs "
                         f"and {len(versions)} versions")

    def decode(n: int) -> str:
        return str(tokenizer.decode(list(token_ids[:n]), skip_special_tokens=skip_special_tokens))

    whole = decode(len(token_ids))
    if _first_stop(whole, stops) is None:
        return StopCut(token_ids=tuple(token_ids), logprobs=tuple(logprobs),
                       versions=tuple(versions), text=whole)
    low, high = 1, len(token_ids)  # decode(high) holds a stop string; find the least such
    while low < high:
        middle = (low + high) // 2
        if _first_stop(decode(middle), stops) is None:
            low = middle + 1
        else:
            high = middle
    text = decode(high)
    match = _first_stop(text, stops)
    assert match is not None
    end, stop = match
    return StopCut(token_ids=tuple(token_ids[:high]), logprobs=tuple(logprobs[:high]),
                   versions=tuple(versions[:high]), text=text[:end], stop=stop)
