"""task.kind = "agent": its section's rules, its rows (``async_rl.tasks.agent_rows``),
the checks before a run, and ``AgentRunner`` playing a group through a real gateway in
front of a fake engine: a solve that returns, one that raises, one that hangs, one that
never calls the model. No Ray, no vLLM."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest

from async_rl.config_io import apply_overrides, decode_config
from async_rl.task_config import task_config
from async_rl.tasks.agent_rows import AgentRowSource
from async_rl.tasks.table import check_task
from buffers.common.config import ConfigError
from buffers.common.records import Prompt, make_group
from tests.unit.test_gateway import MODEL, FakeEngine, Utf8Tokenizer, fake_gateway, text_ids
from workers.rollout.agents import AgentConfig, AgentRunner, agent_function

AGENT = """
async def solve(client, row):
    return 1.0

def not_async(client, row):
    return 1.0

async def one_argument(client):
    return 1.0

NOT_CALLABLE = 3
"""


def files(tmp_path: Path, rows: str = '{"prompt": "1+1=", "answer": "2"}\n') -> tuple[str, str]:
    (tmp_path / "rows.jsonl").write_text(rows)
    (tmp_path / "agent.py").write_text(AGENT)
    return str(tmp_path / "rows.jsonl"), str(tmp_path / "agent.py")


def test_the_agent_section_needs_its_keys_and_refuses_what_an_agent_replaces() -> None:
    section = task_config(kind="agent", path="r.jsonl", agent="a.py:solve")
    assert (section.agent_timeout_s, section.max_turns, section.eval_path) == (300.0, 16, "")
    for bad, key in (({"agent": "a.py:solve"}, "task.path"), ({"path": "r.jsonl"}, "task.agent"),
                     ({"path": "r", "agent": "a", "rewards": [{"function": "f.py:g"}]},
                      "task.rewards"),
                     ({"path": "r", "agent": "a", "environment": {"class": "e.py:E"}},
                      "task.environment.class")):
        with pytest.raises((ValueError, ConfigError, TypeError)) as refused:
            decode_config(apply_overrides({"model": {"path": "m"},
                                           "task": {"kind": "agent", **bad}}, []))
        assert key in str(refused.value)
    with pytest.raises(ConfigError, match=r"run\.eval_on"):
        decode_config(apply_overrides({"model": {"path": "m"},
                                       "task": {"kind": "agent", "path": "r", "agent": "a"},
                                       "run": {"eval_on": "idle_cpu"}}, []))


def test_the_checks_name_the_file_the_line_or_the_agent(tmp_path: Path) -> None:
    rows, agent = files(tmp_path)
    assert check_task(task_config(kind="agent", path=rows, agent=f"{agent}:solve"))
    for target, why in ((f"{agent}:not_async", "async def"), (f"{agent}:one_argument",
                                                             "two arguments"),
                        (f"{agent}:missing", "task.agent")):
        with pytest.raises(ConfigError, match=why):
            check_task(task_config(kind="agent", path=rows, agent=target))
    with pytest.raises(ConfigError, match="file not found"):
        check_task(task_config(kind="agent", path=str(tmp_path / "no.jsonl"),
                               agent=f"{agent}:solve"))
    for text, why in (("", "empty"), ('{"a": 1}\n[1]\n', ":2: expected a JSON object"),
                      ("{oops\n", ":1: invalid JSON")):
        bad, _ = files(tmp_path, text)
        with pytest.raises(ConfigError, match=why):
            check_task(task_config(kind="agent", path=bad, agent=f"{agent}:solve"))
    with pytest.raises(ConfigError, match=r"must be an .async def"):
        agent_function(f"{agent}:NOT_CALLABLE")


def test_rows_become_prompts_carrying_the_whole_row(tmp_path: Path) -> None:
    rows, _ = files(tmp_path, '{"prompt": "a", "answer": 3, "tag": [1]}\n{"question": "b"}\n')
    source = AgentRowSource(rows, shuffle=False)
    first, second, third = (source.next_prompt() for _ in range(3))
    assert (first.text, first.answer, first.columns) == ("a", "3", {"prompt": "a", "answer": 3,
                                                                    "tag": [1]})
    assert second.columns == {"question": "b"} and second.text == "" and second.answer == ""
    assert third.columns == first.columns and third.prompt_id == "rows-2"  # the next pass
    assert [p.prompt_id for p in source.eval_prompts(5)] == ["rows-eval-0", "rows-eval-1"]
    assert source.eval_prompts(0) == ()


async def returns(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
    out = await client.completions.create(model=MODEL, prompt=row["prompt"])
    more = await client.completions.create(model=MODEL,
                                           prompt=row["prompt"] + out.choices[0].text + ";")
    return 1.0 if more.choices[0].text else 0.0


async def raises(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
    await client.completions.create(model=MODEL, prompt=row["prompt"])
    raise RuntimeError("on purpose")


async def hangs(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
    await client.completions.create(model=MODEL, prompt=row["prompt"])
    await asyncio.sleep(60)
    return 1.0


async def no_model(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
    return 0.0


def play(solves: list[Any], on_error: str = "exclude") -> tuple[Any, list[str]]:
    """One group of ``len(solves)`` trajectories, trajectory k played by ``solves[k]``."""
    engine = FakeEngine([text_ids("ab")])
    prompt = Prompt(prompt_id="p", text="7*6=", answer="42", columns={"prompt": "7*6="})

    async def main() -> tuple[Any, list[str]]:
        gateway = fake_gateway(engine, max_new_tokens=8, context=64, concurrency=8)
        await gateway.start()
        calls, tokens = iter(solves), []

        async def solve(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
            tokens.append(client.api_key)
            return float(await next(calls)(client, row))

        config = AgentConfig(agent="unused", agent_timeout_s=1.0, max_turns=4,
                             on_error=on_error)
        runner = AgentRunner(config, gateway, Utf8Tokenizer(), solve=solve)
        try:
            prompt_ids, samples, refused = await runner.group(prompt, len(solves))
            assert refused == 0 and len(gateway.table) == 0 and len(tokens) == len(solves)
            late = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=tokens[0],
                                      max_retries=0)
            with pytest.raises(openai.ConflictError):  # its trajectory has ended
                await late.completions.create(model=MODEL, prompt="x")
            await late.close()
            return make_group(prompt, prompt_ids, samples), sorted(runner.outcomes.elements())
        finally:
            await runner.close()

    return asyncio.run(main())


def test_a_group_of_agents_that_return_raise_hang_or_never_ask() -> None:
    group, outcomes = play([returns, raises, hangs, no_model, returns])
    assert outcomes == ["done", "done", "done", "error", "timeout"]
    assert group.rewards == (1.0, 0.0, 0.0, 0.0, 1.0)
    assert group.excluded == ("", "agent_error", "agent_timeout", "no_policy_token", "")
    assert (group.env_errors, group.env_timeouts) == (1, 1)
    assert group.member_trajectories == 2 and group.prompt_length == len(text_ids("7*6="))
    # The returning agent's two turns are one segment: ab, then ";" as context, then ab.
    assert group.completion_lengths[0] == 5


def test_on_error_train_keeps_the_failed_trajectory_with_reward_zero() -> None:
    group, outcomes = play([raises, returns], on_error="train")
    assert outcomes == ["done", "error"] and group.excluded == ()
    assert group.rewards == (0.0, 1.0) and group.env_errors == 1
