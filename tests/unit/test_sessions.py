"""Agent sessions and their segments (``workers.rollout.sessions``), the samples a group
of sessions becomes (``workers.rollout.agents.agent_samples``), per-trajectory
advantages and the member rule with segments, and the OpenAI request and error shapes
(``workers.rollout.openai_format``). Pure: no HTTP, no engine."""

from __future__ import annotations

import pytest

from buffers.common.records import NO_VERSION, Prompt, make_group
from buffers.plan.advantages import group_advantages, trajectory_advantages
from workers.rollout.agents import (
    ERROR,
    PROMPT_MISMATCH,
    TIMEOUT,
    AgentResult,
    agent_samples,
    group_prompt,
    reward_of,
)
from workers.rollout.openai_format import (
    ApiError,
    check_model,
    messages_of,
    parse_body,
    prompt_of,
    turn_request,
)
from workers.rollout.sessions import FINISHED, Segment, SessionError, SessionTable, extend


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def turn(session, prompt_ids, prompt_text, ids, text, version=3):  # type: ignore[no-untyped-def]
    return session.record(prompt_ids, prompt_text, ids, [-0.5] * len(ids),
                          [version] * len(ids), text, "stop")


# ---- segments ------------------------------------------------------------------------


def test_an_extension_keeps_the_generated_ids_and_tokenizes_only_the_new_text() -> None:
    session = SessionTable().open(max_turns=4)
    # The engine generated ids 900, 901 whose text "xy" would tokenize to 120, 121.
    turn(session, encode("Q:"), "Q:", [900, 901], "xy")
    ids = extend(session.last, "Q:xy+more", encode)
    assert ids == [*encode("Q:"), 900, 901, *encode("+more")]
    segment = turn(session, ids, "Q:xy+more", [902], "z", version=4)
    assert len(session.segments) == 1 and segment.turns == 2
    assert segment.prompt_ids == encode("Q:")
    assert segment.tokens == [900, 901, *encode("+more"), 902]
    assert segment.mask == [1, 1, 0, 0, 0, 0, 0, 1]
    assert segment.versions == [3, 3, *[NO_VERSION] * 5, 4]
    assert segment.logprobs[2:7] == [0.0] * 5 and segment.text == "Q:xy+morez"
    assert segment.generated == 3 and segment.longest_turn == 2


def test_a_history_rewrite_starts_a_new_segment() -> None:
    session = SessionTable().open(max_turns=4)
    turn(session, encode("Q:"), "Q:", [900], "x")
    assert extend(session.last, "Q:y", encode) is None  # the turn's text is not kept
    assert extend(session.last, "", encode) is None  # degenerate: empty prompt
    turn(session, encode("Q:y"), "Q:y", [901], "z")
    assert len(session.segments) == 2
    assert session.segments[1].prompt_ids == encode("Q:y")
    assert session.segments[1].tokens == [901] and session.segments[1].mask == [1]
    assert session.turns == 2


def test_no_segment_yet_extends_nothing_and_bad_lengths_are_refused() -> None:
    assert extend(None, "anything", encode) is None
    assert extend(Segment(prompt_ids=[1]), "anything", encode) is None  # no turn yet
    session = SessionTable().open(max_turns=1)
    with pytest.raises(ValueError, match="2 token ids came with 1 logprobs"):
        session.record([1], "a", [5, 6], [0.0], [1, 1], "bc", "stop")


def test_a_turn_cut_at_its_budget_marks_its_segment_length() -> None:
    session = SessionTable().open(max_turns=2)
    session.record([1], "a", [5], [0.0], [1], "b", "length")
    session.record([1, 5, 7], "ab!", [6], [0.0], [1], "c", "stop")
    assert session.last is not None and session.last.finish_reason == "length"


# ---- the session table -----------------------------------------------------------------


def test_unknown_finished_and_spent_sessions_are_refused_with_their_status() -> None:
    table = SessionTable(remember=1)
    a, b = table.open(max_turns=1), table.open(max_turns=1)
    assert a.token != b.token and a.token.startswith("sk-session-") and len(table) == 2
    assert table.get(a.token) is a
    with pytest.raises(SessionError) as unknown:
        table.get("sk-session-guess")
    assert unknown.value.status == 401
    with pytest.raises(SessionError) as empty:
        table.get("")
    assert empty.value.status == 401
    a.check_turn()
    a.turns = 1
    with pytest.raises(SessionError) as spent:
        table.get(a.token).check_turn()
    assert (spent.value.status, spent.value.code) == (409, "max_turns_reached")
    assert table.close(a.token).state == FINISHED and len(table) == 1
    with pytest.raises(SessionError) as finished:
        table.get(a.token)
    assert (finished.value.status, finished.value.code) == (409, "session_finished")
    table.close(b.token)  # remember=1: a's token is forgotten, and answers 401
    with pytest.raises(SessionError) as forgotten:
        table.get(a.token)
    assert forgotten.value.status == 401 and table.opened == 2


# ---- a group of sessions as samples ----------------------------------------------------------


def _segment(prompt: list[int], tokens: list[int]) -> Segment:
    return Segment(prompt_ids=prompt, tokens=tokens, logprobs=[-1.0] * len(tokens),
                   versions=[2] * len(tokens), mask=[1] * len(tokens), turns=1,
                   longest_turn=len(tokens))


def test_each_segment_is_a_sample_after_the_prompt_its_group_shares() -> None:
    one = [_segment([1, 2, 3], [7, 8]), _segment([1, 2, 9, 9], [6])]  # a rewrite
    two = [_segment([1, 2, 3], [5])]
    prompt, samples = agent_samples([(one, "done", 1.0), (two, "done", 0.0)], "exclude",
                                    "exclude", lambda ids: "")
    assert prompt == [1, 2]
    assert len(samples) == 3 and [s.trajectory for s in samples] == [0, 0, 1]
    assert samples[1].token_ids == (9, 9, 6) and samples[1].loss_mask == (0, 0, 1)
    assert samples[1].versions == (NO_VERSION, NO_VERSION, 2)
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0]
    group = make_group(Prompt(prompt_id="p", text="", answer=""), prompt, samples)
    assert group.trajectories == (0, 0, 1) and group.member_trajectories == 2
    assert group.members == (0, 1, 2)


def test_failed_trajectories_follow_on_error_and_on_timeout_and_count_once() -> None:
    failed = [_segment([1, 2], [7]), _segment([1, 3], [8])]
    played = [(failed, ERROR, 0.0), ([], TIMEOUT, 0.0), ([_segment([1, 2], [5])], "done", 1.0)]
    _, excluded = agent_samples(played, "exclude", "exclude", lambda ids: "")
    assert [s.excluded for s in excluded] == ["agent_error", "agent_error", "agent_timeout", ""]
    group = make_group(Prompt(prompt_id="p", text="", answer=""), [1], excluded)
    assert (group.env_errors, group.env_timeouts) == (1, 1)  # one each, not per segment
    assert group.member_trajectories == 1
    _, trained = agent_samples(played, "train", "train", lambda ids: "")
    assert [s.excluded for s in trained] == ["", "", "", ""]
    assert [s.reward for s in trained] == [0.0, 0.0, 0.0, 1.0]
    assert trained[2].token_ids == ()  # a timeout before any turn: no policy token
    assert make_group(Prompt(prompt_id="p", text="", answer=""), [1], trained).excluded[2] \
        == "no_policy_token"


def test_a_segment_sharing_no_first_token_is_no_member() -> None:
    segments = [_segment([1, 2], [7]), _segment([1, 3], [8]), _segment([4], [9])]
    assert group_prompt(segments) == [1]
    prompt, samples = agent_samples([(segments, "done", 1.0)], "exclude", "exclude",
                                    lambda ids: "")
    assert prompt == [1] and [s.excluded for s in samples] == ["", "", PROMPT_MISMATCH]
    assert group_prompt([]) == []
    assert agent_samples([], "exclude", "exclude", lambda ids: "") == ([], [])


def test_solve_returns_a_float_or_an_agent_result() -> None:
    assert reward_of(1) == 1.0 and reward_of(AgentResult(0.5, {"turns": 2})) == 0.5
    with pytest.raises(TypeError):
        reward_of("1.0")
    with pytest.raises(TypeError):
        reward_of(True)
    with pytest.raises(ValueError):
        reward_of(float("nan"))


# ---- advantages count trajectories ----------------------------------------------------------


def test_a_trajectory_of_several_segments_counts_once_in_its_advantages() -> None:
    rewards, trajectories = [1.0, 1.0, 1.0, 0.0], [0, 0, 0, 1]
    advantages = trajectory_advantages(rewards, trajectories)
    single = group_advantages([1.0, 0.0])
    assert advantages == [single[0]] * 3 + [single[1]]
    assert trajectory_advantages([1.0, 0.0], ()) == single
    assert trajectory_advantages([], []) == []
    assert trajectory_advantages([1.0, 1.0], [0, 0]) == [0.0, 0.0]  # one trajectory
    with pytest.raises(ValueError):
        trajectory_advantages([1.0], [0, 1])


# ---- OpenAI shapes ---------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "code"), [
    (b"{not json", "invalid_json"), (b"[1, 2]", "invalid_json"), (b"", "invalid_json"),
    (b'{"stream": "yes"}', "invalid_value"), (b'{"n": 2}', "unsupported_parameter"),
    (b'{"stream_options": {"include_usage": true}}', "invalid_value"),
    (b'{"functions": [{"name": "f"}]}', "unsupported_parameter"),
])
def test_bad_bodies_are_400_in_the_openai_error_format(raw: bytes, code: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse_body(raw)
    assert refused.value.status == 400
    body = refused.value.body()["error"]
    assert body["code"] == code and body["type"] == "invalid_request_error"
    assert set(body) == {"message", "type", "param", "code"}


def test_request_fields_are_checked() -> None:
    with pytest.raises(ApiError) as model:
        check_model({"model": "gpt-4o"}, "runs/model")
    assert model.value.status == 404 and model.value.code == "model_not_found"
    check_model({"model": "runs/model"}, "runs/model")
    request = turn_request({"max_tokens": 5, "stop": "</call>", "seed": 3, "logprobs": 0,
                            "allowed_token_ids": [1, 2]}, vocab_size=10)
    assert (request.max_tokens, request.stop, request.seed) == (5, ("</call>",), 3)
    assert request.logprobs and request.allowed_token_ids == (1, 2)
    assert not turn_request({}, vocab_size=10).logprobs
    for bad in ({"max_tokens": 0}, {"max_tokens": "8"}, {"stop": [""]}, {"seed": -1},
                {"allowed_token_ids": [10]}, {"allowed_token_ids": []}):
        with pytest.raises(ApiError) as refused:
            turn_request(bad, vocab_size=10)
        assert refused.value.status == 400
    assert prompt_of({"prompt": ["abc"]}) == "abc" and prompt_of({"prompt": [1, 2]}) == [1, 2]
    for bad_prompt in ("", ["a", "b"], None, [True]):
        with pytest.raises(ApiError):
            prompt_of({"prompt": bad_prompt})
    assert messages_of({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "text", "text": "!"}]}]}) == [
        {"role": "user", "content": "hi!"}]
    for bad_messages in ([], [{"content": "x"}], [{"role": "user", "content": 3}]):
        with pytest.raises(ApiError):
            messages_of({"messages": bad_messages})
