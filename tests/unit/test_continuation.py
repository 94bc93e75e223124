"""Continuing a partial rollout, without vLLM (``workers.rollout.continuation``): what is
left of each sample (nothing kept, cut short, at max_new_tokens, ending with EOS, had
finished), the requests a continuation makes (prompt plus kept tokens, the budget less
the kept count, the derived seed) and the samples it returns (the kept prefix exactly,
then the new tokens); a partials file that disagrees with itself is refused in one line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from buffers.common.partials import PartialGroup, PartialSample, decode_partials, encode_partials
from buffers.common.records import Prompt, Sample
from workers.rollout.continuation import (
    HandBack,
    continuation_seed,
    continue_samples,
    remaining,
    request_seed,
)

PROMPT = Prompt(prompt_id="p7", text="1+1=", answer="2")
EOS = 99


def part(tokens: Sequence[int], finish: str = "", version: int = 3) -> PartialSample:
    return PartialSample(token_ids=tuple(tokens),
                         logprobs=tuple(-0.1 - i / 7 for i in range(len(tokens))),
                         versions=(version,) * len(tokens), finish_reason=finish)


def test_what_is_left_of_each_kind_of_partial_sample() -> None:
    assert remaining(part([]), 4, {EOS}) == (4, "")  # nothing produced yet
    assert remaining(part([5, 6]), 4, {EOS}) == (2, "")  # cut short
    assert remaining(part([5, 6, 7, 8]), 4, {EOS}) == (0, "length")  # at the budget
    assert remaining(part([5, EOS]), 4, {EOS}) == (0, "stop")  # ended with EOS
    assert remaining(part([5, EOS]), 4, ()) == (2, "")  # rollout.ignore_eos
    assert remaining(part([5], "stop"), 4, {EOS}) == (0, "stop")  # had finished


def test_a_continuation_asks_for_the_rest_and_keeps_the_prefix_exactly() -> None:
    samples = (part([]), part([5, 6]), part([5, 6, 7, 8]), part([5], "stop"))
    group = PartialGroup(prompt=PROMPT, prompt_token_ids=(1, 2), samples=samples)
    asked: list[tuple[list[list[int]], list[int], list[int]]] = []

    async def stream_all(contexts: list[list[int]], kind: str, seeds: list[int],
                         budgets: list[int]) -> list[tuple[tuple[int, ...], Any]]:
        assert kind == "sample"
        asked.append((contexts, seeds, budgets))
        return [(tuple(c), Sample(token_ids=(40 + k,), logprobs=(-2.0,), versions=(4,),
                                  finish_reason="stop", text=""))
                for k, c in enumerate(contexts)]

    def decode(tokens: Sequence[int]) -> str:
        return " ".join(map(str, tokens))

    out = anyio.run(continue_samples, group, stream_all, decode, 4, {EOS}, 7)
    ((contexts, seeds, budgets),) = asked
    assert contexts == [[1, 2], [1, 2, 5, 6]]  # only the two that need more
    assert budgets == [4, 2]
    # Nothing kept: the sample's own seed (it samples what it would have); else derived.
    assert seeds == [request_seed(7, PROMPT, 0), continuation_seed(7, PROMPT, 1, 2)]
    assert seeds[1] != request_seed(7, PROMPT, 1)
    assert len(out) == 4
    assert out[1].token_ids == (5, 6, 41) and out[1].versions == (3, 3, 4)
    assert out[1].logprobs[:2] == samples[1].logprobs  # bit for bit
    assert out[1].text == "5 6 41" and out[1].finish_reason == "stop"
    assert out[2].token_ids == (5, 6, 7, 8) and out[2].finish_reason == "length"
    assert out[3].token_ids == (5,) and out[3].finish_reason == "stop"
    # Unseeded (rollout.sampling_seed < 0): no seeds at all.
    asked.clear()
    anyio.run(continue_samples, group, stream_all, decode, 4, {EOS}, -1)
    assert asked[0][1] == []


def test_a_group_with_nothing_left_to_generate_makes_no_request() -> None:
    group = PartialGroup(prompt=PROMPT, prompt_token_ids=(1, 2),
                         samples=(part([5, 6, 7, 8]), part([5], "length")))

    async def stream_all(*args: Any) -> list[Any]:
        raise AssertionError("no request expected")

    out = anyio.run(continue_samples, group, stream_all, str, 4, {EOS}, 7)
    assert [s.finish_reason for s in out] == ["length", "length"]


def test_a_partials_file_that_disagrees_with_itself_is_refused_in_one_line() -> None:
    good = PartialGroup(prompt=PROMPT, prompt_token_ids=(1, 2), samples=(part([5, 6]),))
    assert decode_partials(encode_partials([good])) == (good,)
    bad = PartialGroup(prompt=PROMPT, prompt_token_ids=(1, 2), samples=(
        PartialSample(token_ids=(5, 6), logprobs=(-0.1,), versions=(3, 3)),))
    with pytest.raises(ValueError, match=r"^partial group 0 \('p7'\): sample 0: 2 tokens, "
                                         r"1 log-probs"):
        decode_partials(encode_partials([bad]))
    with pytest.raises(ValueError, match=r"^not a file of partial rollouts"):
        decode_partials(b"\x93garbage")


def test_what_a_hand_back_keeps_of_a_group() -> None:
    """A mixed group keeps every sample (finished ones with their reason); a group with
    no token produced and none finished keeps nothing (it restarts); after ``leave``
    every partial says the engine is leaving."""
    hand_back = HandBack()
    cut = Sample(token_ids=(5, 6), logprobs=(-0.5, -1 / 3), versions=(2, 3),
                 finish_reason="abort", text="")
    done = Sample(token_ids=(5,), logprobs=(-0.5,), versions=(2,), finish_reason="stop",
                  text="")
    empty = Sample(token_ids=(), logprobs=(), versions=(), finish_reason="abort", text="")
    mixed = hand_back.partial(PROMPT, (1, 2), [cut, done, empty], rank=1)
    assert mixed.kept_lengths == (2, 1, 0) and mixed.prompt_token_ids == (1, 2)
    assert [s.finish_reason for s in mixed.samples] == ["", "stop", ""]
    assert mixed.samples[0].logprobs == cut.logprobs and mixed.min_version == 2
    assert not mixed.leaving and mixed.rollout_rank == 1
    nothing = hand_back.partial(PROMPT, (1, 2), [empty, empty], rank=1)
    assert nothing.samples == () and nothing.restarts == "not_started"
    assert nothing.prompt_token_ids == ()
    assert hand_back.start(leaving=True) == 0 and hand_back.handing_back
    again = hand_back.partial(PROMPT, (1, 2), [], rank=0, kept=mixed)
    assert again.samples == mixed.samples and again.leaving
