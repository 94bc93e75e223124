"""Queued groups as a checkpoint writes them: every field and every token array back bit
for bit (random groups), and a damaged or foreign file refused in one line."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers.common.records import NO_VERSION, Group, Prompt, Sample, make_group
from buffers.common.saved_groups import SavedGroup, decode_groups, encode_groups


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    n = draw(st.integers(0, 12))
    masked = draw(st.booleans())
    return Sample(
        token_ids=tuple(draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))),
        logprobs=tuple(draw(st.lists(st.floats(-50, 0, width=32), min_size=n, max_size=n))),
        versions=tuple(draw(st.lists(st.sampled_from((NO_VERSION, 0, 3, 7)), min_size=n,
                                     max_size=n))),
        finish_reason=draw(st.sampled_from(("stop", "length", "abort"))), text="t",
        reward=draw(st.floats(-1, 1)),
        loss_mask=tuple(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)))
        if masked else ())


@st.composite
def saved_groups(draw: st.DrawFn) -> SavedGroup:
    prompt = Prompt(prompt_id=draw(st.text(min_size=1, max_size=8)), text="q", answer="a",
                    attempt=draw(st.integers(0, 3)),
                    columns=draw(st.dictionaries(st.text(max_size=4),
                                                 st.integers(-(2**63), 2**63 - 1))))
    group = make_group(prompt, draw(st.lists(st.integers(0, 100), max_size=6)),
                       draw(st.lists(samples(), min_size=1, max_size=4)))
    return SavedGroup(group=group, tokens=group.tokens,
                      entered_version=draw(st.none() | st.integers(0, 9)))


def same_tokens(a: object, b: object) -> bool:
    assert isinstance(a, type(b))
    return all(
        (x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype
                                      and np.array_equal(x, y))
        for x, y in zip(msgspec.structs.astuple(a), msgspec.structs.astuple(b), strict=True))


@settings(max_examples=60, deadline=None)
@given(st.lists(saved_groups(), max_size=4))
def test_every_field_and_token_comes_back(groups: list[SavedGroup]) -> None:
    back = decode_groups(encode_groups(groups))
    assert len(back) == len(groups)
    for original, loaded in zip(groups, back, strict=True):
        assert loaded.group == msgspec.structs.replace(original.group, tokens=None)
        assert loaded.entered_version == original.entered_version
        assert same_tokens(loaded.tokens, original.tokens)


def group() -> Group:
    sample = Sample(token_ids=(5, 6), logprobs=(-0.5, -0.25), versions=(2, 3),
                    finish_reason="stop", text="x", reward=1.0)
    return make_group(Prompt(prompt_id="p", text="q", answer="a"), (1, 2, 3), [sample] * 2)


def test_a_group_reference_is_left_out_and_tokenless_groups_are_kept() -> None:
    with_ref = msgspec.structs.replace(group(), tokens="a reference")
    (loaded,) = decode_groups(encode_groups([SavedGroup(group=with_ref, tokens=None)]))
    assert loaded.group.tokens is None and loaded.tokens is None
    assert decode_groups(encode_groups([])) == ()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "wrong dtype", "wrong length"])
def test_a_damaged_file_is_refused_in_one_line(damage: str) -> None:
    made = group()
    tokens = made.tokens
    data = encode_groups([SavedGroup(group=made, tokens=tokens)])
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "garbage":
        data = b"\x93not msgpack at all"
    elif damage == "wrong dtype":
        data = data.replace(b"<f4\0", b"<i4\0")
    else:  # arrays that do not agree with the group's lengths
        short = msgspec.structs.replace(tokens, logprobs=tokens.logprobs[:-1])
        data = encode_groups([SavedGroup(group=made, tokens=short)])
    with pytest.raises(ValueError) as info:
        decode_groups(data)
    assert "\n" not in str(info.value) and str(info.value)
