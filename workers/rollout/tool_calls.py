"""Function calling on ``/v1/chat/completions``: a request's tools, its reply's calls,
and the exact tokens of a tool turn.

Owns: ``tool_request`` (a request's ``tools`` and ``tool_choice``: "auto" parses the
completion for calls, "none" renders the tools and returns the text; "required" and a
named function are refused, and so are tools while rollout.tool_call_parser is off),
``answer`` (a generated turn with the calls the parser reads in it), ``template_messages``
(a chat's messages as the template renders them) and the ``ToolParser`` protocol the
gateway parses with (vLLM's parser behind it: ``workers.rollout.tool_parser``, which the
rollout worker builds; this module imports no vLLM).

Exact tokens across tool turns. A reply with tool calls is remembered in its session
(``Session.replies``): the reply as issued (its content and each call's id, name and
arguments) -> the text the model generated (special tokens kept, less the EOS it ended
at). When the agent sends that reply back unchanged, followed by tool messages that
answer its calls' ids, ``template_messages`` puts the generated text in its place: the
template renders what the model wrote, so the request continues the segment on the
generated ids (``workers.rollout.sessions.extend``) and only the tool results and the
next generation prompt are tokenized. A reply rewritten (another content, call, argument
or id) or answered with an unknown call id is rendered as sent: unless the template
renders it exactly as the model wrote it, the request starts a new segment.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from typing import Any, Protocol

import msgspec

from workers.rollout.openai_format import ApiError, ToolCall, TurnResult


class ParserTurn(Protocol):
    """One request's tool parsing (a parser may keep state, so one per request)."""

    tools: list[dict[str, Any]]
    """The request's tools as the chat template gets them."""
    parse: bool
    """tool_choice "auto": the completion is parsed; "none": returned as text."""
    skip_special_tokens: bool
    """Whether the text parsed leaves special tokens out (as the parser asks)."""

    def calls(self, text: str) -> tuple[str, tuple[ToolCall, ...]]:
        """The calls ``text`` holds and the content outside them ("" for none); no calls
        when the parser reads none (a garbled one stays text)."""
        ...


class ToolParser(Protocol):
    """rollout.tool_call_parser's parser: a ``ParserTurn`` for each request with tools."""

    def turn(self, tools: Any, choice: str, model: str) -> ParserTurn:
        """The request's parsing; ``ApiError`` 400 for tools it cannot read."""
        ...


def tool_request(body: dict[str, Any], parser: ToolParser | None, *, chat: bool,
                 model: str) -> ParserTurn | None:
    """The request's tool parsing; None without tools (no ``tools``, or an empty list).
    400 for tool_choice "required" or a named function, for tools on /v1/completions and
    for tools while rollout.tool_call_parser is off (``parser`` None)."""
    choice = body.get("tool_choice") or "auto"
    if choice == "required" or isinstance(choice, dict):
        raise ApiError(400, f"tool_choice {json.dumps(choice)} is not supported: forcing a "
                            "call needs vLLM's guided decoding, which the gateway does not "
                            'run; use "auto" or "none"', param="tool_choice",
                       code="unsupported_parameter")
    if choice not in ("auto", "none"):
        raise ApiError(400, f'tool_choice must be "auto" or "none", got {choice!r}',
                       param="tool_choice", code="invalid_value")
    tools = body.get("tools")
    if not tools:
        return None
    if not chat:
        raise ApiError(400, "tools are served on /v1/chat/completions", param="tools",
                       code="unsupported_parameter")
    if parser is None:
        raise ApiError(400, "function calling (tools) is off: set rollout.tool_call_parser "
                            "to the model's vLLM tool parser (e.g. \"hermes\")",
                       param="tools", code="unsupported_parameter")
    return parser.turn(tools, choice, model)


def answer(turn: TurnResult, parsing: ParserTurn, tokenizer: Any,
           replies: dict[str, str]) -> TurnResult:
    """``turn`` with the calls its text holds: ``text`` the content outside them,
    finish_reason "tool_calls", the reply remembered in ``replies`` (see the module
    docstring). Unchanged with tool_choice "none", or when the parser reads no call."""
    if not parsing.parse:
        return turn
    generated = _generated_text(tokenizer, turn)
    # The text vLLM's server parses: decoded as the parser asks (with special tokens, for
    # parsers whose call markers are special tokens), or, cut at a stop string, the
    # response's text.
    text = turn.text if parsing.skip_special_tokens or turn.stop_reason else generated
    content, calls = parsing.calls(text)
    if not calls:
        return turn
    replies[_key({"content": content, "tool_calls": [c.body() for c in calls]})] = generated
    return msgspec.structs.replace(turn, text=content, tool_calls=calls,
                                   finish_reason="tool_calls")


def template_messages(messages: list[dict[str, Any]], replies: Mapping[str, str]
                      ) -> list[dict[str, Any]]:
    """``messages`` as the chat template renders them: a reply of ``replies`` sent back
    unchanged and answered by its calls' ids as the text the model generated; other tool
    calls with their arguments as objects (what chat templates expect; vLLM's server
    passes them so too, a malformed one as {})."""
    out = []
    for at, message in enumerate(messages):
        calls = message.get("tool_calls")
        if not calls:
            out.append(message)
            continue
        generated = replies.get(_key(message))
        if generated is not None and _answered(calls, messages[at + 1:]):
            out.append({"role": "assistant", "content": generated})
        else:
            out.append({**message, "tool_calls": [_with_object_arguments(c) for c in calls]})
    return out


def _answered(calls: list[dict[str, Any]], after: list[dict[str, Any]]) -> bool:
    """Each tool message right after a reply answers one of its calls (by id)."""
    ids = {call["id"] for call in calls}
    answers = itertools.takewhile(lambda m: m["role"] == "tool", after)
    return all(m.get("tool_call_id") in ids for m in answers)


def _key(message: dict[str, Any]) -> str:
    """An assistant reply's content and tool calls (ids, names, arguments as sent)."""
    return json.dumps([message["content"], message["tool_calls"]], sort_keys=True)


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    arguments = call["function"]["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments else {}
        except ValueError:
            arguments = {}
    return {**call, "function": {**call["function"],
                                 "arguments": arguments if isinstance(arguments, dict) else {}}}


def _generated_text(tokenizer: Any, turn: TurnResult) -> str:
    """The turn as the model wrote it: special tokens kept, less the stop token a turn
    that ended at one ends with (finish "stop" with no stop string: the EOS), which the
    chat template writes itself at the end of the assistant's message."""
    ids = list(turn.token_ids)
    if turn.finish_reason == "stop" and turn.stop_reason is None:
        ids = ids[:-1]
    return str(tokenizer.decode(ids, skip_special_tokens=False))
