"""rollout.chat_template: the gateway renders chat messages with the run's template in
place of the tokenizer's (examples/calculator_chat.jinja: each message's content alone,
the calculator task's own text), a conversation that extends the last turn continues
its segment on the generated ids, and the config checks (an agent task only; a file that
is there and renders a conversation with the model's tokenizer, made absolute). No Ray,
no engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from test_gateway import MODEL, FakeEngine, Utf8Tokenizer, client, fake_gateway, text_ids

from async_rl.config_io import load_config
from async_rl.models.tiny_model import build_tokenizer
from async_rl.run.inputs import check_inputs
from buffers.common.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "examples" / "calculator_chat.jinja"
AGENT = REPO / "examples" / "agent_openai.toml"


def test_the_runs_template_renders_the_task_format_and_turns_extend_one_segment() -> None:
    engine = FakeEngine([text_ids("<call>7*6</call>"), [*text_ids("#### 42"), 1]])
    template = TEMPLATE.read_text()

    async def main() -> None:
        gateway = fake_gateway(engine, context=128, chat_template=template)
        await gateway.start()
        try:
            session = gateway.table.open(max_turns=4)
            api = client(gateway, session.token)
            messages: list[Any] = [{"role": "system", "content": "You add."},
                                   {"role": "user", "content": "7*6="}]
            first = await api.chat.completions.create(
                model=MODEL, messages=messages, stop=["</call>"],
                extra_body={"include_stop_str_in_output": True})
            reply = first.choices[0].message
            assert reply.content == "<call>7*6</call>"
            messages += [{"role": "assistant", "content": reply.content},
                         {"role": "user", "content": "<result>42</result>"}]
            second = await api.chat.completions.create(model=MODEL, messages=messages)
            await api.close()
        finally:
            await gateway.close()
        assert second.choices[0].message.content == "#### 42"
        decode = Utf8Tokenizer().decode
        # The model saw the task's raw text: no role markers, no system message.
        assert [decode(ids) for ids, _ in engine.requests] == [
            "7*6=", "7*6=<call>7*6</call><result>42</result>"]
        (segment,) = session.segments
        assert segment.mask == [1] * 16 + [0] * 19 + [1] * 8

    asyncio.run(main())


def test_without_a_template_the_tokenizers_own_renders() -> None:
    engine = FakeEngine([text_ids("3")])

    async def main() -> None:
        gateway = fake_gateway(engine)
        await gateway.start()
        try:
            api = client(gateway, gateway.table.open(max_turns=4).token)
            await api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "1+2="}])
            await api.close()
        finally:
            await gateway.close()
        assert Utf8Tokenizer().decode(engine.requests[0][0]) == "<|user|>1+2=\n<|assistant|>"

    asyncio.run(main())


def test_only_an_agent_task_takes_a_template() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "examples" / "cpu_tools.toml",
                    {"rollout.chat_template": str(TEMPLATE)})
    assert "rollout.chat_template" in str(err.value) and 'task.kind = "agent"' in str(err.value)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory as far as the config check reads it: the byte tokenizer."""
    path = tmp_path_factory.mktemp("model")
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    build_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize(("template", "why"), [
    ("missing.jinja", "no such file"),
    ("{% for m in messages %}{{ m['content'] }", "it does not render a conversation: "),
    ("{{ messages[0]['content'] + raise_exception('no system messages') }}",
     "it does not render a conversation: TemplateError: no system messages"),
])
def test_a_template_that_is_missing_or_does_not_render_exits_naming_the_key(
        model: Path, tmp_path: Path, template: str, why: str) -> None:
    path = tmp_path / "missing.jinja"
    if template != path.name:
        path.write_text(template)
    config = load_config(AGENT, {"model.path": str(model), "rollout.chat_template": str(path)})
    with pytest.raises(ConfigError) as err:
        check_inputs(config)
    message = str(err.value)
    assert message.startswith(f"config error: rollout.chat_template = {str(path)!r}: {why}")
    assert "\n" not in message


def test_a_template_that_renders_is_passed_on_by_its_absolute_path(
        model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    config = load_config(AGENT, {"model.path": str(model),
                                 "rollout.chat_template": "examples/calculator_chat.jinja"})
    assert check_inputs(config).rollout.chat_template == str(TEMPLATE)


def test_the_tokenizer_checks_load_the_tokenizer_once(
        model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rollout.tool_call_parser and rollout.chat_template both check against the model's
    tokenizer, which loads once for both (and not at all without them)."""
    import async_rl.run.inputs as inputs

    loads: list[str] = []
    load = inputs._load_tokenizer
    monkeypatch.setattr(inputs, "_load_tokenizer", lambda path: loads.append(path) or load(path))
    both = load_config(AGENT, {"model.path": str(model), "rollout.tool_call_parser": "hermes",
                               "rollout.chat_template": str(TEMPLATE)})
    checked = check_inputs(both)
    assert checked.rollout.tool_call_parser == "hermes" and loads == [str(model)]
    check_inputs(load_config(AGENT, {"model.path": str(model)}))
    assert loads == [str(model)]
