"""Function calling through the gateway (``workers.rollout.tool_calls``) over real HTTP
with the real openai client, in front of a fake engine: vLLM's Hermes tool parser
(``workers.rollout.tool_parser``) on the project's byte-level tokenizer with a
Qwen-style tool template; tool turns that keep the
generated ids exactly, a rewritten reply's new segment, tool_choice, the refusals, a
garbled call, and rollout.tool_call_parser's config check. No Ray, no engine (vLLM's
parser module only)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from test_gateway import MODEL, FakeEngine, Params, client

from async_rl.config_io import load_config
from async_rl.models.tiny_model import EOS_ID, VOCAB_SIZE, build_tokenizer
from async_rl.run.inputs import check_inputs
from buffers.common.config import ConfigError
from buffers.common.records import Sample
from workers.rollout.gateway import Gateway, GatewayLimits
from workers.rollout.tool_parser import VllmToolParser

TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}\n</tools>\n"
    "Call a function as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call>"
    "{{ eos_token + '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{% if m.content %}{{ '\\n' + m.content }}{% endif %}"
    "{% for call in m.tool_calls %}{{ '\\n<tool_call>\\n{\"name\": \"' + call.function.name"
    " + '\", \"arguments\": ' + call.function.arguments | tojson + '}\\n</tool_call>' }}"
    "{% endfor %}{{ eos_token + '\\n' }}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ eos_token + '\\n' }}"
    "{% endif %}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + eos_token + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Qwen2.5's tool template in short: the tools in the system turn, each call as
``<tool_call>`` JSON, tool results as ``<tool_response>`` in a user turn; the EOS ends
each turn (Qwen's ``<|im_end|>``)."""
REPO = Path(__file__).resolve().parents[2]
TOKENIZER = build_tokenizer()
TOKENIZER.chat_template = TEMPLATE
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "mul", "parameters": {"type": "object"}}},
]
CALL = '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>'
"""A call as the model writes it: compact JSON, which the template renders otherwise."""


def ids(text: str) -> list[int]:
    return list(TOKENIZER.encode(text, add_special_tokens=False))


def ended(text: str) -> list[int]:
    """A completion of ``text`` that ends at the EOS, as the engine gives it."""
    return [*ids(text), EOS_ID]


def text(token_ids: list[int]) -> str:
    return str(TOKENIZER.decode(token_ids, skip_special_tokens=False))


class LengthEngine(FakeEngine):
    """Every reply cut at its token budget (finish_reason "length")."""

    async def generate(self, ids: list[int], params: Params, greedy: bool) -> Sample:
        out = await super().generate(ids, params, greedy)
        return Sample(token_ids=out.token_ids, logprobs=out.logprobs, versions=out.versions,
                      finish_reason="length", text="")


def serve(engine: FakeEngine, test: Callable[[Gateway], Awaitable[None]], *,
          parser: str = "hermes") -> None:
    async def main() -> None:
        gateway = Gateway(model_name=MODEL, tokenizer=TOKENIZER,
                          params={"sample": Params(), "greedy": Params()},
                          generate=engine.generate,
                          tool_parser=VllmToolParser(parser, TOKENIZER) if parser else None,
                          limits=GatewayLimits(max_new_tokens=128, max_context=4096,
                                               max_trajectory_tokens=4096, max_concurrency=2,
                                               vocab_size=VOCAB_SIZE))
        await gateway.start()
        try:
            await test(gateway)
        finally:
            await gateway.close()

    asyncio.run(main())


def test_tool_turns_continue_the_segment_on_the_generated_ids() -> None:
    replies = [ended(CALL),
               ended('Let me check.<tool_call>{"name":"mul","arguments":{"a":3,"b":4}}'
                     '</tool_call>'),
               ended("It is 12.")]
    engine = FakeEngine(replies)

    async def test(gateway: Gateway) -> None:
        session = gateway.table.open(max_turns=8)
        api = client(gateway, session.token)
        messages: list[Any] = [{"role": "user", "content": "(1+2)*4?"}]
        first = await api.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and calls[0].type == "function" and calls[0].id
        assert calls[0].function.name == "add"
        assert json.loads(calls[0].function.arguments) == {"a": 1, "b": 2}
        # The agent sends the reply back as the client returned it, then the result.
        messages += [choice.message, {"role": "tool", "tool_call_id": calls[0].id,
                                      "content": "3"}]
        second = await api.chat.completions.create(model=MODEL, messages=messages,
                                                   tools=TOOLS)
        choice = second.choices[0]
        calls = choice.message.tool_calls or []
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
        assert len(calls) == 1 and calls[0].function.name == "mul"  # type: ignore[union-attr]
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": calls[0].id, "content": "12"}]
        third = await api.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        await api.close()
        assert third.choices[0].message.content == "It is 12."
        assert third.choices[0].message.tool_calls is None
        assert third.choices[0].finish_reason == "stop"

        prompts = [request[0] for request in engine.requests]
        assert len(prompts) == 3 and "<tools>" in text(prompts[0])
        for turn in (1, 2):  # each prompt: the last one, its completion, then new tokens
            before = [*prompts[turn - 1], *replies[turn - 1]]
            assert prompts[turn][:len(before)] == before
        added = prompts[1][len(prompts[0]) + len(replies[0]):]
        assert text(added) == ("\n<|im_start|>user\n<tool_response>\n3\n</tool_response></s>"
                               "\n<|im_start|>assistant\n")  # only the result is tokenized
        assert len(session.segments) == 1 and len(session.replies) == 2
        segment = session.segments[0]
        assert segment.prompt_ids == prompts[0] and segment.turns == 3
        assert segment.context_ids == [*prompts[2], *replies[2]]
        generated = [i for i, m in zip(segment.tokens, segment.mask, strict=True) if m]
        assert generated == [*replies[0], *replies[1], *replies[2]]  # only these train

    serve(engine, test)


@pytest.mark.parametrize("change", ["rewritten arguments", "unknown tool_call_id"])
def test_a_changed_reply_starts_a_new_segment(change: str) -> None:
    engine = FakeEngine([ended(CALL), ended("3")])

    async def test(gateway: Gateway) -> None:
        session = gateway.table.open(max_turns=8)
        api = client(gateway, session.token)
        messages: list[Any] = [{"role": "user", "content": "1+2?"}]
        first = await api.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        reply = first.choices[0].message.model_dump(exclude_none=True)
        call_id = reply["tool_calls"][0]["id"]
        if change == "rewritten arguments":
            reply["tool_calls"][0]["function"]["arguments"] = '{"a": 1, "b": 5}'
        else:
            call_id = "call-unknown"
        messages += [reply, {"role": "tool", "tool_call_id": call_id, "content": "3"}]
        second = await api.chat.completions.create(model=MODEL, messages=messages,
                                                   tools=TOOLS)
        await api.close()
        assert second.choices[0].message.content == "3"  # served, not refused
        assert len(session.segments) == 2 and session.turns == 2
        prompt = engine.requests[1][0]
        assert session.segments[1].prompt_ids == prompt  # tokenized whole
        arguments = reply["tool_calls"][0]["function"]["arguments"]
        assert CALL not in text(prompt)  # the reply as sent, as the template renders it
        assert f'{{"name": "add", "arguments": {arguments}}}' in text(prompt)

    serve(engine, test)


def test_tool_choice_none_returns_the_text_and_an_empty_list_is_no_tools() -> None:
    engine = FakeEngine([ended(CALL)])

    async def test(gateway: Gateway) -> None:
        session = gateway.table.open(max_turns=8)
        api = client(gateway, session.token)
        messages: Any = [{"role": "user", "content": "1+2?"}]
        plain = await api.chat.completions.create(model=MODEL, messages=messages,
                                                  tools=TOOLS, tool_choice="none")
        empty = await api.chat.completions.create(model=MODEL, messages=messages, tools=[])
        await api.close()
        for out in (plain, empty):
            message = out.choices[0].message
            assert message.content == CALL and message.tool_calls is None
            assert out.choices[0].finish_reason == "stop"
        prompts = [text(request[0]) for request in engine.requests]
        assert len(prompts) == 2
        assert "<tools>" in prompts[0] and "<tools>" not in prompts[1]
        assert not session.replies

    serve(engine, test)


@pytest.mark.parametrize(("finish", "make"), [("stop", FakeEngine), ("length", LengthEngine)])
def test_a_garbled_call_is_plain_content(finish: str, make: type[FakeEngine]) -> None:
    garbled = '<tool_call>{"name": "add", oops}</tool_call>'
    engine = make([ended(garbled) if finish == "stop" else ids(garbled)])

    async def test(gateway: Gateway) -> None:
        session = gateway.table.open(max_turns=8)
        api = client(gateway, session.token)
        out = await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "1+2?"}], tools=TOOLS)
        await api.close()
        assert out.choices[0].message.content == garbled
        assert out.choices[0].message.tool_calls is None
        assert out.choices[0].finish_reason == finish and not session.replies

    serve(engine, test)


def test_refused_tool_requests_name_their_field() -> None:
    engine = FakeEngine([ended("x")])
    messages: Any = [{"role": "user", "content": "1+2?"}]

    async def refused(api: openai.AsyncOpenAI, **fields: Any) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(model=MODEL, messages=messages, **fields)
        return err.value

    async def test(gateway: Gateway) -> None:
        session = gateway.table.open(max_turns=8)
        api = client(gateway, session.token)
        required = await refused(api, tools=TOOLS, tool_choice="required")
        named = await refused(api, tools=TOOLS, tool_choice={
            "type": "function", "function": {"name": "add"}})
        for err in (required, named):
            assert err.param == "tool_choice" and "guided decoding" in err.message
        bad = await refused(api, tools=[{"type": "function"}])
        assert bad.param == "tools" and "tools.0.function" in bad.message
        old = await refused(api, functions=[{"name": "add"}])
        assert old.param == "functions"
        with pytest.raises(openai.BadRequestError) as completion:
            await api.completions.create(model=MODEL, prompt="1+2?",
                                         extra_body={"tools": TOOLS})
        assert completion.value.param == "tools"
        await api.close()
        assert not engine.requests and session.refused == 5

    serve(engine, test)


def test_tools_without_a_parser_are_refused_naming_the_key() -> None:
    engine = FakeEngine([ended("x")])

    async def test(gateway: Gateway) -> None:
        session = gateway.table.open(max_turns=8)
        api = client(gateway, session.token)
        messages: Any = [{"role": "user", "content": "1+2?"}]
        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        assert err.value.param == "tools"
        assert "rollout.tool_call_parser" in err.value.message
        out = await api.chat.completions.create(model=MODEL, messages=messages, tools=[])
        await api.close()
        assert out.choices[0].message.content == "x" and len(engine.requests) == 1

    serve(engine, test, parser="")


@pytest.mark.parametrize(("name", "why"), [
    ("hermes", ""), ("hermess", "not a tool parser of the installed vLLM (one of "),
    ("deepseek_v3", "it cannot use the tokenizer of model.path"),
])
def test_the_tool_call_parser_key_names_a_vllm_parser_for_the_model(
        tmp_path: Path, name: str, why: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    TOKENIZER.save_pretrained(model)
    config = load_config(REPO / "examples" / "cpu_default.toml", overrides={
        "model.path": str(model), "rollout.tool_call_parser": name})
    if not why:
        assert check_inputs(config).rollout.tool_call_parser == name
        return
    with pytest.raises(ConfigError) as err:
        check_inputs(config)
    message = str(err.value)
    assert message.startswith(f"config error: rollout.tool_call_parser = {name!r}: {why}")
    assert "\n" not in message
