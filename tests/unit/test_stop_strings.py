"""Stop strings with a real byte-level BPE tokenizer (issue 40, risk one): vLLM cuts a
stop string's text, not its tokens, so the turn's token ids decoded again run past
``</call>`` when a merged token spans it; ``cut_at_stop`` keeps the shortest token
prefix holding the stop string and hands ``step`` the text ending right at it. The
tokenizer is trained here with the ``tokenizers`` library on calculator-like strings
(nothing downloaded), so that ``">="`` is one token."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from workers.rollout.stop_strings import cut_at_stop

EOS = "<|endoftext|>"
CALL = "</call>"


@functools.cache
def bpe() -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE (its pre-tokenizer's regex too) trained on calls."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([f"<call>{a}+{b}</call>={a + b} then" for a in range(20)
                                   for b in range(20)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)


def turn(text: str) -> tuple[list[int], list[float], list[int]]:
    """``text`` as a turn's tokens, with made-up logprobs and versions to follow them."""
    ids = bpe().encode(text)
    return ids, [-0.1 * (i + 1) for i in range(len(ids))], [7 + i % 2 for i in range(len(ids))]


def test_a_merged_token_makes_the_naive_decode_run_past_the_stop_string() -> None:
    tokenizer = bpe()
    ids, logprobs, versions = turn("<call>3+4</call>=7 then")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert ">=" in pieces  # one token spans the stop string's end and the next character
    # What the engine stops at: the token completing "</call>", and the text re-decoded.
    stopped = ids[:pieces.index(">=") + 1]
    naive = tokenizer.decode(stopped, skip_special_tokens=True)
    assert naive == "<call>3+4</call>=" and not naive.endswith(CALL)

    cut = cut_at_stop(stopped, logprobs[:len(stopped)], versions[:len(stopped)], tokenizer,
                      [CALL])
    assert cut.text == "<call>3+4</call>" and cut.text.endswith(CALL) and cut.stop == CALL
    assert cut.token_ids == tuple(stopped)  # the policy's tokens stay as it wrote them
    assert tokenizer.decode(list(cut.token_ids)).startswith(cut.text)
    assert cut.logprobs == tuple(logprobs[:len(stopped)])
    assert cut.versions == tuple(versions[:len(stopped)])


def test_tokens_past_the_stop_string_are_dropped_with_their_logprobs() -> None:
    ids, logprobs, versions = turn("<call>3+4</call>=7 then <call>1+1</call>")
    cut = cut_at_stop(ids, logprobs, versions, bpe(), [CALL])
    kept = len(cut.token_ids)
    assert 0 < kept < len(ids)
    assert cut.text == "<call>3+4</call>"
    assert bpe().decode(ids[:kept - 1]).find(CALL) < 0  # the shortest prefix holding it
    assert cut.logprobs == tuple(logprobs[:kept]) and cut.versions == tuple(versions[:kept])


def test_the_stop_string_that_ends_first_wins() -> None:
    ids, logprobs, versions = turn("<call>3+4</call>=7 then")
    cut = cut_at_stop(ids, logprobs, versions, bpe(), [CALL, "+"])
    assert cut.text == "<call>3+" and cut.stop == "+"


@pytest.mark.parametrize("text", ["", "7 then", "<call>3+4</call"])
def test_a_turn_without_a_stop_string_is_kept_whole(text: str) -> None:
    ids, logprobs, versions = turn(text)
    for stops in ([CALL], []):
        cut = cut_at_stop(ids, logprobs, versions, bpe(), stops)
        assert cut.token_ids == tuple(ids) and cut.text == text and cut.stop == ""
        assert cut.logprobs == tuple(logprobs) and cut.versions == tuple(versions)


def test_the_special_tokens_are_skipped_as_the_worker_skips_them() -> None:
    ids, logprobs, versions = turn("<call>3+4</call>=7")
    eos = bpe().eos_token_id
    cut = cut_at_stop([*ids, eos], [*logprobs, 0.0], [*versions, 7], bpe(), [CALL])
    assert cut.text == "<call>3+4</call>" and eos not in cut.token_ids


def test_misaligned_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="2 token ids came with 1 logprobs"):
        cut_at_stop([1, 2], [0.0], [0, 0], bpe(), [CALL])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["<call>", "</call>", "=", "3", "+", "4", " then", "x", "é"]),
                max_size=12))
def test_any_turn_is_cut_at_its_first_stop_string(parts: list[str]) -> None:
    text = "".join(parts)
    ids, logprobs, versions = turn(text)
    cut = cut_at_stop(ids, logprobs, versions, bpe(), [CALL])
    kept = len(cut.token_ids)
    full = bpe().decode(ids)
    if CALL not in full:
        assert kept == len(ids) and cut.text == full
        return
    assert cut.text == full[:full.index(CALL) + len(CALL)]
    assert bpe().decode(list(cut.token_ids)).startswith(cut.text)
    assert CALL not in bpe().decode(ids[:kept - 1])
    assert cut.logprobs == tuple(logprobs[:kept]) and cut.versions == tuple(versions[:kept])
