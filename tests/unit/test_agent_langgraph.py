"""examples/agent_langgraph.py without Ray or vLLM: its graph against a scripted client
(the turns the model would write); a group of its trajectories through the real gateway
and ``AgentRunner`` in front of a fake engine that calls the tool, then answers (the
reward reaches the samples, each trajectory one segment trained only on the model's
tokens); and the pure pieces (a turn's call, the tool's result, the route)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from script_modules import load_script

from buffers.common.records import Prompt, Sample, make_group
from tests.unit.test_gateway import Params, Utf8Tokenizer, fake_gateway, text_ids
from workers.rollout.agents import AgentConfig, AgentRunner

pytest.importorskip("langgraph")
example = load_script("examples/agent_langgraph.py", "agent_langgraph_example")


class ScriptedClient:
    """An ``openai.AsyncOpenAI`` stand-in: each completion is the next scripted turn
    (its text, and ``</call>`` as the stop reason when it made a call)."""

    def __init__(self, turns: list[tuple[str, str | None]]) -> None:
        self.turns = list(turns)
        self.prompts: list[str] = []
        self.base_url = f"http://scripted-{id(self)}/v1"
        self.models = SimpleNamespace(list=self._models)
        self.completions = SimpleNamespace(create=self._create)

    async def _models(self) -> Any:
        return SimpleNamespace(data=[SimpleNamespace(id="calc")])

    async def _create(self, *, model: str, prompt: str, **_: Any) -> Any:
        assert model == "calc"
        self.prompts.append(prompt)
        text, stop_reason = self.turns.pop(0)
        return SimpleNamespace(choices=[SimpleNamespace(text=text, stop_reason=stop_reason)])


def solve(client: ScriptedClient, row: dict[str, Any]) -> float:
    async def main() -> float:
        return float(await example.solve(client, row))
    return anyio.run(main)


def test_the_graph_calls_the_tool_then_answers() -> None:
    client = ScriptedClient([("<call>47*83", "</call>"), ("#### 3901", None)])
    assert solve(client, {"prompt": "47*83=", "answer": "3901"}) == 1.0
    # Each turn's prompt extends the last: the history, the call closed, the result.
    assert client.prompts == ["47*83=", "47*83=<call>47*83</call><result>3901</result>"]
    assert client.turns == []


def test_a_wrong_answer_scores_zero_and_a_bad_call_gets_the_error_result() -> None:
    client = ScriptedClient([("<call>47*", "</call>"), ("#### 1", None)])
    assert solve(client, {"prompt": "47*83=", "answer": 3901}) == 0.0
    assert client.prompts[1].endswith(example.tool_result("47*"))
    assert example.ERROR_RESULT in client.prompts[1]


def test_an_answer_without_a_call_ends_at_once() -> None:
    client = ScriptedClient([("#### 3901", None)])
    assert solve(client, {"prompt": "47*83=", "answer": "3901"}) == 1.0
    assert len(client.prompts) == 1


def test_the_calls_are_bounded() -> None:
    calls = example.MAX_TOOL_CALLS
    client = ScriptedClient([("<call>1+1", "</call>")] * (calls + 1))
    assert solve(client, {"prompt": "1+1=", "answer": "2"}) == 0.0
    assert len(client.prompts) == calls + 1  # the last call is not run
    assert client.prompts[-1].count("<result>2</result>") == calls


def test_call_of_and_route() -> None:
    assert example.call_of("1+2=<call>1+2", "</call>") == "1+2"
    assert example.call_of("1+2=<call>1+2", None) is None  # stopped for another reason
    assert example.call_of("1+2= #### 3", "</call>") is None  # no call was opened
    assert example.call_of("<call>1</call><result>1</result><call>", "</call>") == ""
    assert example.route({"text": "", "call": "1+2", "calls": 0}) == "tool"
    assert example.route({"text": "", "call": None, "calls": 0}) == example.END
    full = {"text": "", "call": "1+2", "calls": example.MAX_TOOL_CALLS}
    assert example.route(full) == example.END


class CalculatorEngine:
    """Writes a call of the prompt's expression when its context has no tool result yet,
    else the answer after the last result: what a model that has learnt the task does."""

    def __init__(self) -> None:
        self.prompts: list[str] = []

    async def generate(self, ids: list[int], params: Params, greedy: bool) -> Sample:
        text = Utf8Tokenizer().decode(ids)
        self.prompts.append(text)
        if "<result>" in text:
            reply = "#### " + text[text.rfind("<result>") + 8:text.rfind("</result>")]
        else:
            reply = f"<call>{text.split('=')[0]}</call>"
        out = text_ids(reply)[:params.max_tokens]
        return Sample(token_ids=tuple(out), logprobs=(-0.5,) * len(out),
                      versions=(2,) * len(out), finish_reason="stop", text="")


def test_a_group_through_the_gateway_is_rewarded_and_trains_the_models_tokens() -> None:
    engine = CalculatorEngine()
    prompt = Prompt(prompt_id="p", text="7*6=", answer="42",
                    columns={"prompt": "7*6=", "answer": "42"})

    async def main() -> Any:
        gateway = fake_gateway(engine, max_new_tokens=32, context=128, concurrency=4)
        await gateway.start()
        config = AgentConfig(agent="unused", agent_timeout_s=5.0, max_turns=4)
        runner = AgentRunner(config, gateway, Utf8Tokenizer(), solve=example.solve)
        try:
            prompt_ids, samples, refused = await runner.group(prompt, 3)
            assert refused == 0 and sorted(runner.outcomes.elements()) == ["done"] * 3
            return make_group(prompt, prompt_ids, samples), samples
        finally:
            await runner.close()

    group, samples = asyncio.run(main())
    assert group.rewards == (1.0, 1.0, 1.0) and group.excluded == ()
    assert len(engine.prompts) == 6  # two turns a trajectory: the call, the answer
    assert engine.prompts[-1].startswith("7*6=<call>7*6</call><result>42</result>")
    # One segment each: the call and the answer are the model's (mask 1), the tool's
    # result between them is context (mask 0).
    assert group.member_trajectories == 3 and len(group.completion_lengths) == 3
    tool = len(text_ids("<result>42</result>"))
    assert len(samples) == 3
    for sample in samples:
        assert sum(sample.loss_mask) == len(text_ids("<call>7*6</call>#### 42"))
        assert len(sample.loss_mask) - sum(sample.loss_mask) == tool
