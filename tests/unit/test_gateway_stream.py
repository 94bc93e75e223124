"""``stream: true`` through the gateway (``workers.rollout.openai_format.event_stream``)
over real HTTP with the real openai client, in front of a fake engine: a streamed turn's
chunks add up to the text, token ids and usage of the same turn unstreamed, and the next
turn continues its segment on the generated ids (completions, chat, and a streamed tool
call the agent assembles from its deltas); the agents' own transport reads a stream;
an empty completion; the stream fields' refusals stay JSON errors. No Ray, no vLLM."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from test_gateway import MODEL, FakeEngine, Utf8Tokenizer, client, serve, text_ids
from test_gateway_tools import CALL, TOOLS, ended
from test_gateway_tools import serve as serve_with_tools

from workers.rollout.gateway import Gateway
from workers.rollout.local_http import local_http_client


async def chunks_of(stream: Any) -> list[Any]:
    return [chunk async for chunk in stream]


def test_a_streamed_completion_is_the_turn_and_the_next_turn_continues_it() -> None:
    cut = [3 + 0xC3]  # half a character: its text re-tokenizes to other ids
    engine = FakeEngine([cut, text_ids("ab")])

    async def test(gateway: Gateway) -> None:
        session = gateway.table.open(max_turns=8)
        api = client(gateway, session.token)
        stream = await api.completions.create(
            model=MODEL, prompt="Q:", max_tokens=1, stream=True, logprobs=0,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
        chunks = await chunks_of(stream)
        assert len(chunks) == 3  # the text, the finish, the usage
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == "\ufffd"
        assert [c.choices[0].finish_reason for c in chunks[:2]] == [None, "stop"]
        assert chunks[0].choices[0].token_ids == cut  # type: ignore[attr-defined]
        assert chunks[0].choices[0].logprobs.token_logprobs == [-0.25]
        assert chunks[2].choices == [] and chunks[2].usage.completion_tokens == 1
        assert chunks[2].usage.prompt_tokens == 2 and chunks[0].usage is None
        assert len({c.id for c in chunks}) == 1
        await api.completions.create(model=MODEL, prompt="Q:" + text + "!")
        await api.close()
        assert len(session.segments) == 1 and session.turns == 2
        assert engine.requests[1][0] == [*text_ids("Q:"), *cut, *text_ids("!")]

    serve(engine, test)


def test_a_streamed_chat_turn_continues_through_the_template_on_the_agents_transport(
) -> None:
    engine = FakeEngine([[*text_ids("hi"), 1], []])

    async def test(gateway: Gateway) -> None:
        session = gateway.table.open(max_turns=8)
        shared = local_http_client()
        api = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=session.token,
                                 max_retries=0, http_client=shared)
        messages: list[Any] = [{"role": "user", "content": "hello"}]
        chunks = await chunks_of(await api.chat.completions.create(
            model=MODEL, messages=messages, stream=True))
        assert len(chunks) == 2 and chunks[0].object == "chat.completion.chunk"
        delta = chunks[0].choices[0].delta
        assert delta.role == "assistant" and delta.content == "hi"
        assert chunks[1].choices[0].finish_reason == "stop"
        messages += [{"role": "assistant", "content": delta.content},
                     {"role": "user", "content": "ok?"}]
        empty = await chunks_of(await api.chat.completions.create(
            model=MODEL, messages=messages, stream=True))
        await shared.close_pool()
        assert len(empty) == 2 and empty[0].choices[0].delta.content == ""
        assert empty[1].choices[0].finish_reason == "stop"
        assert len(session.segments) == 1 and session.turns == 2
        tokens = session.segments[0].tokens
        assert tokens[:3] == [*text_ids("hi"), 1]  # the generated EOS, once
        assert Utf8Tokenizer().decode(tokens[3:]) == "\n<|user|>ok?\n<|assistant|>"

    serve(engine, test)


def test_a_streamed_tool_call_assembled_from_its_delta_continues_the_segment() -> None:
    replies = [ended(CALL), ended("It is 3.")]
    engine = FakeEngine(replies)

    async def test(gateway: Gateway) -> None:
        session = gateway.table.open(max_turns=8)
        api = client(gateway, session.token)
        messages: list[Any] = [{"role": "user", "content": "1+2?"}]
        chunks = await chunks_of(await api.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, stream=True))
        assert len(chunks) == 2 and chunks[1].choices[0].finish_reason == "tool_calls"
        delta = chunks[0].choices[0].delta
        assert delta.content is None and delta.tool_calls is not None
        assert len(delta.tool_calls) == 1 and delta.tool_calls[0].index == 0
        call = delta.tool_calls[0]
        assert call.function is not None and call.function.name == "add"
        assert json.loads(call.function.arguments or "") == {"a": 1, "b": 2}
        # What a streaming agent sends back: the call assembled from the deltas.
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "add", "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "3"}]
        await api.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        await api.close()
        assert len(session.segments) == 1 and session.turns == 2
        first, second = (request[0] for request in engine.requests)
        assert second[:len(first) + len(replies[0])] == [*first, *replies[0]]

    serve_with_tools(engine, test)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "a", "stream": True, "stream_options": ["usage"]}, "stream_options"),
    ({"prompt": "a" * 64, "stream": True}, "prompt"),
])
def test_a_refused_stream_request_is_one_json_error_and_reaches_no_engine(
        body: dict[str, Any], param: str) -> None:
    engine = FakeEngine([text_ids("x")])

    async def test(gateway: Gateway) -> None:
        session = gateway.table.open(max_turns=4)
        async with httpx.AsyncClient() as raw:
            refused = await raw.post(f"{gateway.base_url}/completions",
                                     json={"model": MODEL, **body},
                                     headers={"Authorization": f"Bearer {session.token}"})
        assert refused.status_code == 400
        assert refused.headers["content-type"] == "application/json"
        assert refused.json()["error"]["param"] == param
        assert not engine.requests and session.refused == 1

    serve(engine, test, context=16)
