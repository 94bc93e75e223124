"""A LangGraph agent that plays the calculator task through the gateway (docs/agents.md).

examples/agent_langgraph.toml names ``solve``: async-rl calls it once per trajectory with
an ``openai.AsyncOpenAI`` client bound to that trajectory's gateway session. The agent is
a LangGraph ``StateGraph`` of two nodes:

- ``model`` asks the session for the next turn through ``/v1/completions`` in the task's
  own call format (the tiny calculator model has no chat template), stopping at
  ``</call>``;
- ``tool`` runs the calculator on the call's expression and writes
  ``</call><result>value</result>`` after it;

and a conditional edge after ``model``: to ``tool`` when the turn ended in a call (and
calls are left), else to the end, where the model has written ``#### value``. The state
holds the whole history, so each turn's prompt extends the last and the gateway trains
on one segment of exactly the tokens the model produced.

The graph is compiled once; each trajectory runs it with its own client in LangGraph's
run context. Needs ``pip install -e '.[agents]'`` (langgraph).
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

import openai
from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime

from async_rl.tasks.calculator import (
    CALL_CLOSE,
    CALL_OPEN,
    ERROR_RESULT,
    RESULT_CLOSE,
    RESULT_OPEN,
    ExpressionError,
    evaluate_expression,
    final_answer,
)

MAX_TOOL_CALLS = 3
TURN_TOKENS = 32


class Calculation(TypedDict):
    """The graph's state: the history so far, and the call the last turn made."""

    text: str
    call: str | None
    calls: int


@dataclass(frozen=True)
class Session:
    """A run's context: the trajectory's client and the model it serves."""

    client: openai.AsyncOpenAI
    model: str


def call_of(text: str, stop_reason: object) -> str | None:
    """The expression of the call a turn ended in (it stopped at ``</call>``), or None."""
    if stop_reason != CALL_CLOSE or CALL_OPEN not in text:
        return None
    return text[text.rfind(CALL_OPEN) + len(CALL_OPEN):]


def tool_result(expression: str) -> str:
    """What the calculator tool writes back after a call: ``</call><result>v</result>``."""
    try:
        value = str(evaluate_expression(expression))
    except ExpressionError:
        value = ERROR_RESULT
    return f"{CALL_CLOSE}{RESULT_OPEN}{value}{RESULT_CLOSE}"


async def model_node(state: Calculation, runtime: Runtime[Session]) -> dict[str, Any]:
    """One turn of the policy, through the session's completions endpoint."""
    session = runtime.context
    out = await session.client.completions.create(
        model=session.model, prompt=state["text"], max_tokens=TURN_TOKENS, stop=[CALL_CLOSE])
    choice = out.choices[0]
    text = state["text"] + choice.text
    return {"text": text, "call": call_of(text, getattr(choice, "stop_reason", None))}


async def tool_node(state: Calculation) -> dict[str, Any]:
    """The calculator on the last call's expression."""
    assert state["call"] is not None
    return {"text": state["text"] + tool_result(state["call"]), "call": None,
            "calls": state["calls"] + 1}


def route(state: Calculation) -> Literal["tool", "__end__"]:
    """After a turn: run the tool when the turn made a call and calls are left."""
    if state["call"] is not None and state["calls"] < MAX_TOOL_CALLS:
        return "tool"
    return END


def build_graph() -> Any:
    """The agent's graph: model -> (tool -> model)* -> end."""
    graph = StateGraph(Calculation, context_schema=Session)
    graph.add_node("model", model_node)
    graph.add_node("tool", tool_node)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", route, ["tool", END])
    graph.add_edge("tool", "model")
    return graph.compile()


GRAPH = build_graph()
_MODELS: dict[str, str] = {}


async def play(client: openai.AsyncOpenAI, prompt: str) -> str:
    """One trajectory through the graph: the completion after ``prompt``."""
    url = str(client.base_url)
    if url not in _MODELS:  # the model the gateway serves (the run's), asked once
        _MODELS[url] = (await client.models.list()).data[0].id
    final = await GRAPH.ainvoke({"text": prompt, "call": None, "calls": 0},
                                context=Session(client=client, model=_MODELS[url]))
    return str(final["text"])[len(prompt):]


async def solve(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
    """The task's reward: 1 when the final answer (``#### value``) is the row's."""
    completion = await play(client, row["prompt"])
    return 1.0 if final_answer(completion) == str(row["answer"]) else 0.0


if __name__ == "__main__":
    # A process of its own: AsyncOpenAI() reads OPENAI_BASE_URL and OPENAI_API_KEY.
    print(asyncio.run(play(openai.AsyncOpenAI(max_retries=0), sys.argv[1])))
