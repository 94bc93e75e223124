"""The calculator task as a verifiers environment, played through one async-rl gateway
session (docs/agents.md, "verifiers").

Runs in the verifiers virtualenv (``make verifiers``: verifiers 0.4.0, whose pins cannot
share async-rl's), never in async-rl's: it imports nothing from async_rl.
examples/agent_verifiers.py starts it once per trajectory, with the session in
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` and the row on stdin, and reads the reward it
prints last.

Written with verifiers' own API (``verifiers.v1``), one plugin module exporting:

- ``CalculatorTaskset``: the calculator rows ({"prompt", "answer"}, by default
  examples/data/calculator_train.jsonl), each a ``CalculatorTask`` whose ``@vf.reward``
  ``correct`` is 1 when the final ``#### value`` is the row's answer;
- ``CalculatorEnv``: the control flow of one episode. The model's turn either calls the
  calculator (``<call>expr</call>``, the stop string) or answers; the environment
  replies to each call with ``<result>value</result>`` as the next user message, up to
  ``max_tool_calls`` calls, through ``agent.interaction`` (verifiers' turn-by-turn
  exchange, the caller being the user);
- ``ChatHarness``: the agent program, one chat completion per segment on the whole
  conversation, through verifiers' interception endpoint (which relays to the session
  and records the trace). It runs in this process: verifiers' ``null`` harness is the
  same loop as a uv-managed program, which would install uv and its own packages on
  every machine and start a process per turn.

So the model sees chat messages. The tiny calculator model learnt the task's raw text,
so its run renders them with examples/calculator_chat.jinja (rollout.chat_template):
each message's content, nothing around it, which is the task's own format.

    OPENAI_BASE_URL=... OPENAI_API_KEY=... .venv-verifiers/bin/python \
        examples/verifiers_calculator.py '{"prompt": "47*83=", "answer": "3901"}'
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult, SubprocessConfig

PLUGIN = "verifiers_calculator"
"""This module's name as a verifiers plugin id: verifiers imports its taskset, and the
environment and harness it exports beside it, by that name."""
sys.modules.setdefault(PLUGIN, sys.modules[__name__])  # run as a script: the same module
__all__ = ["CalculatorEnv", "CalculatorTaskset", "ChatHarness"]
CALL_CLOSE = "</call>"
TURN_TOKENS = 32
MAX_TOOL_CALLS = 3
DATA = Path(__file__).resolve().parent / "data" / "calculator_train.jsonl"
_CALL = re.compile(r"<call>([^<]*)</call>\s*$")
ANSWER_MARK = "#### "
_INTEGER = re.compile(r"0|-?[1-9][0-9]*")
_OPERATORS: dict[type, Any] = {ast.Add: operator.add, ast.Sub: operator.sub,
                               ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """The calculator: integers with + - * and parentheses ("error" for anything else)."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            result = _OPERATORS[type(node.op)](value(node.left), value(node.right))
            if abs(result) > 10**12:
                raise ValueError("too large")
            return int(result)
        raise ValueError("not an integer expression")

    if len(expression) > 200 or not re.fullmatch(r"[0-9+\-*() ]+", expression):
        return "error"
    try:
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, RecursionError):
        return "error"


def final_answer(reply: str) -> str | None:
    """The answer of the model's last reply: the integer after ``#### `` when that is all
    the reply holds (the calculator task's reward reads it so), else None."""
    number = reply.removesuffix("</s>").removeprefix(ANSWER_MARK)
    if number == reply or not _INTEGER.fullmatch(number):
        return None
    return number


class CalculatorData(vf.TaskData):
    """One calculator row: the expression (the prompt) and its value."""

    answer: str


class CalculatorTask(vf.Task[CalculatorData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the model's last reply is ``#### value``, the row's value."""
        replies = [m.content or "" for m in trace.messages
                   if isinstance(m, vf.AssistantMessage)]
        return 1.0 if replies and final_answer(replies[-1]) == self.data.answer else 0.0


class CalculatorTasksetConfig(vf.TasksetConfig):
    path: Path = DATA
    """A JSONL file of {"prompt", "answer"} rows."""


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorTasksetConfig]):
    def load(self) -> Iterator[CalculatorTask]:
        with open(self.config.path) as rows:
            for line in rows:
                if line.strip():
                    yield task_of(json.loads(line), self.config.task)


def task_of(row: dict[str, Any], config: vf.TaskConfig | None = None) -> CalculatorTask:
    """The task of one row."""
    return CalculatorTask(CalculatorData(prompt=str(row["prompt"]),
                                         answer=str(row["answer"])), config)


class ChatHarnessConfig(vf.HarnessConfig):
    pass


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """One chat completion per segment, in this process, through the interception."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime,
                     endpoint: str, secret: str, mcp_urls: dict[str, str],
                     data: vf.TaskData) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as model:
            await model.chat.completions.create(model=ctx.model, messages=messages)
        return ProgramResult(exit_code=0, stdout="", stderr="")


class CalculatorEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(
        # No harness named: the taskset's own (ChatHarness, exported beside it).
        runtime=SubprocessConfig(), max_turns=MAX_TOOL_CALLS + 1,
        # The turn stops at a call; the reply keeps "</call>" (vLLM's
        # include_stop_str_in_output), so the history sent back is what the model wrote.
        sampling=vf.SamplingConfig(max_tokens=TURN_TOKENS, stop=[CALL_CLOSE],
                                   include_stop_str_in_output=True))
    max_tool_calls: int = MAX_TOOL_CALLS


class CalculatorEnv(vf.Env[CalculatorEnvConfig]):
    """The calculator answers each call the model makes, as the next user message."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(self.config.max_tool_calls):
                call = _CALL.search(segment.messages[-1].content or "") if (
                    segment.messages and not segment.terminated) else None
                if call is None:
                    return  # the model answered (or the run ended)
                segment = await chat.turn(f"<result>{calculate(call.group(1))}</result>")


async def play(row: dict[str, Any]) -> float:
    """One episode of ``row`` against the session that ``OPENAI_BASE_URL`` and
    ``OPENAI_API_KEY`` name: its reward. Raises when the episode failed."""
    async with AsyncOpenAI(max_retries=0) as client:
        model = (await client.models.list()).data[0].id
    env = vf.load_environment(vf.resolve_env_config({"taskset": {"id": PLUGIN}}))
    ctx = vf.ModelContext(model=model, client=vf.EvalClientConfig(
        base_url=os.environ["OPENAI_BASE_URL"], api_key_var="OPENAI_API_KEY"))
    async with env.serving():
        episode = await env.run_episode(task_of(row), ctx)
    if not episode.ok:
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        raise RuntimeError("; ".join(f"{e.type}: {e.message}" for e in errors)
                           or "the episode failed")
    return episode.traces[0].reward


def main(argv: list[str]) -> None:
    row = json.loads(argv[1] if len(argv) > 1 else sys.stdin.read())
    print(asyncio.run(play(row)), flush=True)


if __name__ == "__main__":
    main(sys.argv)
