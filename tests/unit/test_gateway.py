"""The gateway (``workers.rollout.gateway``) over real HTTP with the real openai client, in
front of a fake engine and a byte-level tokenizer: the exact tokens of a session across
turns (a completion cut mid-character, whose text re-tokenizes to other ids), a
rewrite's new segment, chat turns through a template, every refusal in the OpenAI
format with the engine serving on, and the concurrency bound. No Ray, no vLLM."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import jinja2
import openai
import pytest

from buffers.common.records import Sample
from workers.rollout.gateway import Gateway, GatewayLimits

EOS, OFFSET = 1, 3
MODEL = "runs/tiny"


class Utf8Tokenizer:
    """Byte-level like the project's tiny models: byte b is id b + 3, EOS ("</s>") is 1;
    decoding bytes that are no whole UTF-8 character gives U+FFFD."""

    eos_token_id, eos_token = EOS, "</s>"
    chat_template = "<|role|>content"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(text.split(self.eos_token)):
            ids += [EOS] if i else []
            ids += [OFFSET + b for b in part.encode()]
        return ids

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        out, run = "", b""
        for i in ids:
            if i >= OFFSET:
                run += bytes([i - OFFSET])
                continue
            out, run = out + run.decode(errors="replace"), b""
            out += "" if skip_special_tokens else self.eos_token
        return out + run.decode(errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                            tokenize: bool, chat_template: str | None = None) -> str:
        if chat_template is not None:  # rollout.chat_template's, as transformers renders it
            jinja = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
            return jinja.from_string(chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                eos_token=self.eos_token)
        text = "".join(f"<|{m['role']}|>{m['content']}"
                       f"{self.eos_token if m['role'] == 'assistant' else ''}\n"
                       for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")


class Params:
    """vLLM's SamplingParams as far as the gateway sets them."""

    def __init__(self) -> None:
        self.max_tokens, self.stop, self.seed, self.detokenize = 8, None, None, False
        self.include_stop_str_in_output, self.allowed_token_ids = False, None

    def clone(self) -> Params:
        return copy.copy(self)


class FakeEngine:
    """Answers each request with the next of ``replies`` (token ids; cut to max_tokens),
    labelled with version 5; records what it was asked."""

    def __init__(self, replies: list[list[int]], delay_s: float = 0.0) -> None:
        self.replies, self.delay_s = replies, delay_s
        self.requests: list[tuple[list[int], Params]] = []
        self.running = self.most = 0

    async def generate(self, ids: list[int], params: Params, greedy: bool) -> Sample:
        self.requests.append((list(ids), params))
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(self.delay_s)
        self.running -= 1
        reply = self.replies[(len(self.requests) - 1) % len(self.replies)][:params.max_tokens]
        return Sample(token_ids=tuple(reply), logprobs=(-0.25,) * len(reply),
                      versions=(5,) * len(reply), finish_reason="stop", text="")


def text_ids(text: str) -> list[int]:
    return Utf8Tokenizer().encode(text)


def fake_gateway(engine: Any, *, max_new_tokens: int = 32, context: int = 64,
                 concurrency: int = 4, chat_template: str = "") -> Gateway:
    """A gateway over the byte tokenizer in front of ``engine`` (its ``generate``), not
    started; ``chat_template``: rollout.chat_template's text."""
    return Gateway(model_name=MODEL, tokenizer=Utf8Tokenizer(), chat_template=chat_template,
                   params={"sample": Params(), "greedy": Params()},
                   generate=engine.generate, limits=GatewayLimits(
                       max_new_tokens=max_new_tokens, max_context=context,
                       max_trajectory_tokens=context, max_concurrency=concurrency,
                       vocab_size=OFFSET + 256))


def serve(engine: FakeEngine, test: Callable[[Gateway], Awaitable[None]], *,
          context: int = 64, concurrency: int = 4) -> None:
    async def main() -> None:
        gateway = fake_gateway(engine, context=context, concurrency=concurrency)
        url = await gateway.start()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        try:
            await test(gateway)
        finally:
            await gateway.close()

    asyncio.run(main())


def client(gateway: Gateway, token: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.base_url, api_key=token, max_retries=0)


def test_three_turns_keep_the_generated_ids_where_the_text_would_tokenize_otherwise() -> None:
    cut = [OFFSET + 0xC3]  # the first byte of "é": decodes to U+FFFD
    engine = FakeEngine([cut, text_ids("ab"), text_ids("c"), text_ids("z")])

    async def test(gateway: Gateway) -> None:
        session = gateway.table.open(max_turns=8)
        api = client(gateway, session.token)
        first = await api.completions.create(model=MODEL, prompt="Q:", max_tokens=1,
                                             extra_body={"return_token_ids": True})
        text = first.choices[0].text
        assert text == "\ufffd" and text_ids(text) != cut  # re-tokenizing differs
        history = "Q:" + text + " ok"
        await api.completions.create(model=MODEL, prompt=history)
        history += "ab" + "!"
        await api.completions.create(model=MODEL, prompt=history)
        await api.completions.create(model=MODEL, prompt="Q: rewritten")  # a new segment
        await api.close()
        assert len(session.segments) == 2 and session.turns == 4
        segment = session.segments[0]
        expected = [*cut, *text_ids(" ok"), *text_ids("ab"), *text_ids("!"), *text_ids("c")]
        assert segment.prompt_ids == text_ids("Q:") and segment.tokens == expected
        assert engine.requests[1][0] == [*text_ids("Q:"), *cut, *text_ids(" ok")]
        assert segment.mask == [1, 0, 0, 0, 1, 1, 0, 1]
        assert segment.versions == [5, -1, -1, -1, 5, 5, -1, 5]
        assert session.segments[1].prompt_ids == text_ids("Q: rewritten")
        assert session.segments[1].tokens == text_ids("z")
        assert first.choices[0].token_ids == cut  # type: ignore[attr-defined]

    serve(engine, test)


def test_stop_strings_are_cut_from_the_text_and_kept_in_the_context() -> None:
    engine = FakeEngine([text_ids("<call>1+2</call>tail"), text_ids("#### 3")])

    async def test(gateway: Gateway) -> None:
        session = gateway.table.open(max_turns=8, seed=10)
        api = client(gateway, session.token)
        out = await api.completions.create(model=MODEL, prompt="1+2=", stop=["</call>"],
                                           max_tokens=100, logprobs=0)
        assert out.choices[0].text == "<call>1+2" and out.choices[0].finish_reason == "stop"
        assert out.choices[0].stop_reason == "</call>"  # type: ignore[attr-defined]
        assert out.choices[0].logprobs is not None
        assert out.choices[0].logprobs.token_logprobs == [-0.25] * 16
        # The agent writes the call back with its stop string, then the tool's result.
        await api.completions.create(model=MODEL, prompt="1+2=<call>1+2</call><result>3"
                                                         "</result>", stop=["</call>"])
        await api.close()
        assert len(session.segments) == 1 and session.turns == 2
        params = engine.requests[0][1]
        assert params.max_tokens == 32 and params.stop == ["</call>"] and params.seed == 10
        assert engine.requests[1][1].seed == 11  # each turn's seed from the session's

    serve(engine, test)


def test_chat_turns_extend_through_the_template() -> None:
    engine = FakeEngine([[*text_ids("hi"), EOS], text_ids("yes")])

    async def test(gateway: Gateway) -> None:
        session = gateway.table.open(max_turns=8)
        api = client(gateway, session.token)
        messages: list[Any] = [{"role": "user", "content": "hello"}]
        out = await api.chat.completions.create(model=MODEL, messages=messages)
        assert out.choices[0].message.content == "hi"
        messages += [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "ok?"}]
        await api.chat.completions.create(model=MODEL, messages=messages)
        await api.close()
        assert len(session.segments) == 1
        tokens = session.segments[0].tokens
        assert tokens[:3] == [*text_ids("hi"), EOS]  # the EOS the engine generated, once
        assert tokens[3:-3] == text_ids("\n<|user|>ok?\n<|assistant|>")

    serve(engine, test)


def test_refusals_are_openai_errors_and_the_engine_serves_on() -> None:
    engine = FakeEngine([text_ids("x")])

    async def test(gateway: Gateway) -> None:
        table = gateway.table
        live, ended = table.open(max_turns=2), table.open(max_turns=2)
        table.close(ended.token)
        api = client(gateway, live.token)
        models = await api.models.list()
        assert [m.id for m in models.data] == [MODEL]
        with pytest.raises(openai.AuthenticationError):
            await client(gateway, "sk-session-nope").completions.create(model=MODEL,
                                                                       prompt="a")
        with pytest.raises(openai.ConflictError):
            await client(gateway, ended.token).completions.create(model=MODEL, prompt="a")
        with pytest.raises(openai.NotFoundError) as unknown_model:
            await api.completions.create(model="gpt-4o", prompt="a")
        assert unknown_model.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as too_long:
            await api.completions.create(model=MODEL, prompt="a" * 64)
        assert too_long.value.code == "context_length_exceeded"
        async with httpx.AsyncClient() as raw:
            bad = await raw.post(f"{gateway.base_url}/completions", content=b"{oops",
                                 headers={"Authorization": f"Bearer {live.token}"})
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
            lost = await raw.get(f"{gateway.base_url}/nowhere")
            assert lost.status_code == 404 and "error" in lost.json()
        assert not engine.requests  # nothing refused reached the engine
        await api.completions.create(model=MODEL, prompt="a")
        await api.completions.create(model=MODEL, prompt="ax")
        with pytest.raises(openai.ConflictError) as spent:  # task.max_turns
            await api.completions.create(model=MODEL, prompt="axx")
        assert spent.value.code == "max_turns_reached"
        await api.close()
        assert len(engine.requests) == 2 and gateway.served == 2
        assert live.refused == 4  # its own refusals: model, length, JSON, turns
        assert gateway.refused["invalid_api_key"] == 1
        assert gateway.refused["session_finished"] == 1

    serve(engine, test, context=16)


def test_requests_on_the_engine_are_bounded() -> None:
    engine = FakeEngine([text_ids("x")], delay_s=0.05)

    async def test(gateway: Gateway) -> None:
        sessions = [gateway.table.open(max_turns=1) for _ in range(6)]
        clients = [client(gateway, s.token) for s in sessions]
        await asyncio.gather(*(c.completions.create(model=MODEL, prompt="a") for c in clients))
        for c in clients:
            await c.close()
        assert len(engine.requests) == 6 and engine.most == 2

    serve(engine, test, concurrency=2)


def test_an_engine_error_is_an_openai_error_and_the_next_request_is_served() -> None:
    engine = FakeEngine([text_ids("x")])
    failures = iter([ValueError("token id out of range"), RuntimeError("engine died")])
    generate = engine.generate

    async def flaky(ids: list[int], params: Params, greedy: bool) -> Sample:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return await generate(ids, params, greedy)

    engine.generate = flaky  # type: ignore[method-assign]

    async def test(gateway: Gateway) -> None:
        session = gateway.table.open(max_turns=4)
        api = client(gateway, session.token)
        with pytest.raises(openai.BadRequestError):
            await api.completions.create(model=MODEL, prompt="a")
        with pytest.raises(openai.InternalServerError) as failed:
            await api.completions.create(model=MODEL, prompt="a")
        assert failed.value.status_code == 503
        out = await api.completions.create(model=MODEL, prompt="a")
        await api.close()
        assert out.choices[0].text == "x" and session.turns == 1 and session.refused == 2

    serve(engine, test)
