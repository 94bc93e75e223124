"""A plain openai.AsyncOpenAI agent that plays the calculator task (docs/agents.md).

examples/agent_openai.toml names ``solve``: async-rl calls it once per trajectory with
a client whose base URL and API key are that trajectory's session on the run's gateway.
The tiny calculator model has no chat template, so the agent speaks the task's own
format through ``/v1/completions``: the model writes ``<call>expr</call>``, the agent
runs the tool itself and writes ``<result>value</result>`` after it, and the model
answers ``#### value``. Each turn's prompt is the whole history so far, so the gateway
continues one segment and trains on exactly the tokens the model produced.

The same function runs as a process of its own against a gateway session:
``OPENAI_BASE_URL=... OPENAI_API_KEY=... python examples/agent_openai.py "47*83="``.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import openai

from async_rl.tasks.calculator import (
    CALL_CLOSE,
    CALL_OPEN,
    ERROR_RESULT,
    RESULT_CLOSE,
    RESULT_OPEN,
    TOOL_LATENCY_SIGMA,
    ExpressionError,
    ToolLatency,
    evaluate_expression,
    final_answer,
)

MAX_TOOL_CALLS = 3
TURN_TOKENS = 32
_MODELS: dict[str, str] = {}
_LATENCIES: dict[tuple[float, float], ToolLatency] = {}


async def served_model(client: openai.AsyncOpenAI) -> str:
    """The model the gateway serves (the run's), asked once per gateway."""
    url = str(client.base_url)
    if url not in _MODELS:
        _MODELS[url] = (await client.models.list()).data[0].id
    return _MODELS[url]


def tool(expression: str) -> str:
    """The calculator, as the agent runs it between turns."""
    try:
        return str(evaluate_expression(expression))
    except ExpressionError:
        return ERROR_RESULT


def tool_latency(row: dict[str, Any]) -> ToolLatency | None:
    """The emulated latency of a remote sandbox's tool calls, when ``row`` carries
    ``tool_latency_ms``: the in-process calculator's model (``task.tool_latency_ms``),
    log-normal around that median with ``tool_latency_sigma`` (default
    ``TOOL_LATENCY_SIGMA``; 0 makes every call take the median). One seeded stream per
    setting in this process, as the in-process tool shares one between environments."""
    median_ms = float(row.get("tool_latency_ms", 0.0))
    if median_ms == 0:
        return None
    key = (median_ms, float(row.get("tool_latency_sigma", TOOL_LATENCY_SIGMA)))
    if key not in _LATENCIES:
        _LATENCIES[key] = ToolLatency(median_ms, sigma=key[1])
    return _LATENCIES[key]


async def play(client: openai.AsyncOpenAI, prompt: str,
               latency: ToolLatency | None = None) -> str:
    """One trajectory: the completion after ``prompt`` (turns, tool results, answer);
    each tool call waits ``latency``'s next draw, when given."""
    model = await served_model(client)
    text = prompt
    for _ in range(MAX_TOOL_CALLS + 1):
        out = await client.completions.create(model=model, prompt=text,
                                              max_tokens=TURN_TOKENS, stop=[CALL_CLOSE])
        choice = out.choices[0]
        text += choice.text
        if getattr(choice, "stop_reason", None) != CALL_CLOSE:
            break  # the model answered (or ran out of tokens): no tool call
        # The stop string is not in the returned text: write it back, then the result.
        expression = text[text.rfind(CALL_OPEN) + len(CALL_OPEN):]
        if latency is not None:
            await asyncio.sleep(latency.draw_s())
        text += f"{CALL_CLOSE}{RESULT_OPEN}{tool(expression)}{RESULT_CLOSE}"
    return text[len(prompt):]


async def solve(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
    """The calculator's reward: 1 when the final answer is the row's. A row may carry
    ``tool_latency_ms`` (and ``tool_latency_sigma``): its tool calls then take that long
    (``tool_latency``; bench/gateway.py)."""
    completion = await play(client, row["prompt"], tool_latency(row))
    return 1.0 if final_answer(completion) == str(row["answer"]) else 0.0


if __name__ == "__main__":
    # A process of its own: AsyncOpenAI() reads OPENAI_BASE_URL and OPENAI_API_KEY.
    print(asyncio.run(play(openai.AsyncOpenAI(max_retries=0), sys.argv[1])))
