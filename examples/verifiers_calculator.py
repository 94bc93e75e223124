"""The calculator task as a verifiers environment, and the process that plays its
episodes for async-rl's gateway sessions (docs/agents.md, "verifiers").

Runs in the verifiers virtualenv (``make verifiers``: verifiers 0.4.0, whose pins cannot
share async-rl's), never in async-rl's: it imports nothing from async_rl.

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

Run with no argument, it is the episode server that examples/agent_verifiers.py starts
once per rollout worker process (``serve``): the environment loaded once, then one JSON
object a line on stdin, each answered by one on stdout, in any order:

- ``{"id", "base_url", "api_key", "row"}`` plays one episode of ``row`` in the session
  (an asyncio task of its own; any number at once), answered ``{"id", "reward"}`` or
  ``{"id", "error"}``;
- ``{"cancel": id}`` cancels that episode, which is answered nothing.

It exits when stdin ends (its parent closed it, or died), cancelling what still runs.
Anything else the process prints goes to stderr. Given a row, it plays that one episode
against the session of ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` and prints the reward:

    OPENAI_BASE_URL=... OPENAI_API_KEY=... .venv-verifiers/bin/python \
        examples/verifiers_calculator.py '{"prompt": "47*83=", "answer": "3901"}'
"""

from __future__ import annotations

import ast
import asyncio
import functools
import itertools
import json
import operator
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult, SubprocessConfig
from verifiers.v1.utils.memory import trim_memory_periodically

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
KEY_VARIABLE = "ASYNC_RL_SESSION_KEY_"
"""The prefix of the environment variable that holds one episode's session key."""
LINE_LIMIT = 64 << 20
ERROR_CHARS = 2000
_OPERATORS: dict[type, Any] = {ast.Add: operator.add, ast.Sub: operator.sub,
                               ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """The calculator: integers with + - * and parentheses ("error" for anything else).
    A copy of async_rl.tasks.calculator's rule (this process cannot import async_rl);
    tests/unit/test_agent_verifiers.py checks the two agree."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            result = int(node.value)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            result = -value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            result = int(_OPERATORS[type(node.op)](value(node.left), value(node.right)))
        else:
            raise ValueError("not an integer expression")
        if abs(result) > 10**12:  # every value, literals too, as the task's calculator
            raise ValueError("too large")
        return result

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


_http: httpx.AsyncClient | None = None


def http_client() -> httpx.AsyncClient:
    """The HTTP client of every turn of this process's harness: one pool, made once (an
    ``AsyncOpenAI`` of its own a turn would build a TLS context each time, about 30 ms
    of CPU). Closed by ``close_http_client``."""
    global _http
    if _http is None:
        _http = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0),
                                  limits=httpx.Limits(max_connections=None))
    return _http


async def close_http_client() -> None:
    global _http
    if _http is not None:
        await _http.aclose()
        _http = None


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
        model = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0,
                            http_client=http_client())
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


def load_env() -> vf.Env:
    """The calculator environment, through verifiers' own loader."""
    return vf.load_environment(vf.resolve_env_config({"taskset": {"id": PLUGIN}}))


async def model_of(base_url: str, api_key: str) -> str:
    """The name the session's endpoint serves its model under."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        return (await client.models.list()).data[0].id


async def play(env: vf.Env, model: str, client: vf.EvalClientConfig, row: dict[str, Any]
               ) -> float:
    """One episode of ``row`` against ``client``'s endpoint: its reward. Raises when the
    episode failed. Outside ``env.serving()``, so verifiers brings up an interception
    server for this episode alone and closes it, with the model client it built for
    ``client`` (one a session key), when the episode ends."""
    episode = await env.run_episode(task_of(row), vf.ModelContext(model=model, client=client))
    if not episode.ok:
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        raise RuntimeError("; ".join(f"{e.type}: {e.message}" for e in errors)
                           or "the episode failed")
    return episode.traces[0].reward


async def play_one(row: dict[str, Any]) -> float:
    """One episode of ``row`` against the session of ``OPENAI_BASE_URL`` and
    ``OPENAI_API_KEY``: its reward."""
    base_url = os.environ["OPENAI_BASE_URL"]
    model = await model_of(base_url, os.environ["OPENAI_API_KEY"])
    client = vf.EvalClientConfig(base_url=base_url, api_key_var="OPENAI_API_KEY")
    try:
        return await play(load_env(), model, client, row)
    finally:
        await close_http_client()


class Server:
    """The episodes requested on stdin, each an asyncio task of its own, answered on the
    file descriptor ``out``; see the module docstring."""

    def __init__(self, env: vf.Env, out: int) -> None:
        self.env, self.out = env, out
        self.episodes: dict[Any, asyncio.Task[float]] = {}
        self.models: dict[str, str] = {}  # each endpoint's model name, once known
        self.keys = itertools.count()

    async def serve(self, lines: asyncio.StreamReader) -> None:
        """Handles each line until stdin ends, then cancels the episodes still running."""
        try:
            while line := await lines.readline():
                try:
                    self.handle(json.loads(line))
                except (ValueError, TypeError, KeyError) as err:
                    print(f"verifiers server: ignored {line[:200]!r} ({err!r})",
                          file=sys.stderr, flush=True)
        finally:
            for task in self.episodes.values():
                task.cancel()
            await asyncio.gather(*self.episodes.values(), return_exceptions=True)

    def handle(self, message: dict[str, Any]) -> None:
        """Starts the episode ``message`` requests, or cancels the one it names."""
        if "cancel" in message:
            cancelled = self.episodes.get(message["cancel"])
            if cancelled is not None:
                cancelled.cancel()
            return
        key = message["id"]
        if key in self.episodes:
            raise ValueError(f"episode {key!r} is running already")
        task = asyncio.create_task(self.episode(message))
        self.episodes[key] = task
        task.add_done_callback(functools.partial(self.answer, key))

    async def episode(self, request: dict[str, Any]) -> float:
        """The reward of the episode ``request`` asks for. verifiers reads the session's
        key from the environment variable the client config names, when the episode's
        agent registers with its interception server: a variable of the episode's own,
        set while it runs (episodes run on this one thread, so no other sees it change)."""
        base_url, api_key, row = request["base_url"], request["api_key"], request["row"]
        variable = f"{KEY_VARIABLE}{next(self.keys)}"
        os.environ[variable] = api_key
        try:
            if base_url not in self.models:
                self.models[base_url] = await model_of(base_url, api_key)
            client = vf.EvalClientConfig(base_url=base_url, api_key_var=variable)
            reward = await play(self.env, self.models[base_url], client, row)
        finally:
            del os.environ[variable]
        await trim_memory_periodically()  # as verifiers' own runner does after an episode
        return reward

    def answer(self, key: Any, task: asyncio.Task[float]) -> None:
        """Writes the reply to the episode ``key`` (none when it was cancelled)."""
        if self.episodes.get(key) is task:
            del self.episodes[key]
        if task.cancelled():
            return
        error = task.exception()
        reply = ({"id": key, "reward": task.result()} if error is None else
                 {"id": key, "error": f"{type(error).__name__}: {error}"[:ERROR_CHARS]})
        data = (json.dumps(reply) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.out, data):]
        except OSError:  # the parent is gone: stdin ends next
            pass


async def serve() -> None:
    """Serves episodes on stdin and stdout until stdin ends."""
    out = os.dup(1)
    os.dup2(2, 1)  # stdout carries the replies alone: any print goes to stderr
    server = Server(load_env(), out)
    lines = asyncio.StreamReader(limit=LINE_LIMIT)
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(lines), sys.stdin)
    try:
        await server.serve(lines)
    finally:
        await close_http_client()


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        print(asyncio.run(play_one(json.loads(argv[1]))), flush=True)
    else:
        asyncio.run(serve())


if __name__ == "__main__":
    main(sys.argv)
