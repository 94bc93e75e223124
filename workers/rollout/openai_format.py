"""The OpenAI API's shapes as the gateway speaks them: errors, request fields, responses.

Owns: ``ApiError`` (a refused request: its HTTP status and the OpenAI error body),
``parse_body`` (the JSON object of a request), the readers of the request fields the
gateway honours (``TurnRequest``: max_tokens, stop, seed, allowed_token_ids,
include_stop_str_in_output, logprobs, return_token_ids, stream and
stream_options.include_usage; ``prompt_of``, ``messages_of``:
a chat's messages with their tool calls and tool results), ``ToolCall`` (one function
call of an assistant message) and the response bodies of ``/v1/completions``,
``/v1/chat/completions`` and ``/v1/models``, and a turn's ``event_stream`` for a
``stream: true`` request (a request's ``tools`` and ``tool_choice``
are read by ``workers.rollout.tool_calls``). Sampling itself (temperature, top_p) is the
run's: a request's values are ignored, since the behaviour policy must be the one the
run trains against. Pure: no HTTP server, no engine (``workers.rollout.gateway`` serves
these).
"""

from __future__ import annotations

import itertools
import json
import secrets
import time
from collections.abc import Sequence
from typing import Any

import msgspec

REFUSED_FIELDS = {
    "functions": "functions (deprecated) is not supported by the gateway: use tools",
    "response_format": "structured output is not supported by the gateway",
}
"""Request fields the gateway refuses (400) when set, and why."""


class ApiError(Exception):
    """A request refused in the OpenAI error format: ``status`` and ``body()``."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, kind: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.kind = kind or error_type(status)

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``, as OpenAI's API sends."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status."""
    return {401: "authentication_error", 404: "invalid_request_error",
            409: "conflict_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object; ``ApiError`` 400 for anything else."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    for key, why in REFUSED_FIELDS.items():
        if body.get(key):
            raise ApiError(400, why, param=key, code="unsupported_parameter")
    if not isinstance(body.get("stream", False), bool | None):
        raise ApiError(400, "stream must be true or false", param="stream",
                       code="invalid_value")
    if body.get("stream_options") is not None and not body.get("stream"):
        raise ApiError(400, "stream_options is only allowed when stream is true",
                       param="stream_options", code="invalid_value")
    if body.get("n", 1) != 1:
        raise ApiError(400, "n must be 1: each trajectory is one session", param="n",
                       code="unsupported_parameter")
    return body


def check_model(body: dict[str, Any], served: str) -> None:
    """``body["model"]`` must name the run's model: 404 ``model_not_found`` otherwise."""
    model = body.get("model")
    if model != served:
        raise ApiError(404, f"the model {model!r} does not exist; this gateway serves "
                            f"{served!r}", param="model", code="model_not_found")


class TurnRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What a request may set of its turn (the rest is the run's)."""

    max_tokens: int | None = None
    """At most rollout.max_new_tokens, and the room left in the trajectory."""
    stop: tuple[str, ...] = ()
    seed: int | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    """vLLM's constrained decoding: the behaviour logprobs are then those of the
    constrained distribution, the one sampled."""
    include_stop_str_in_output: bool = False
    logprobs: bool = False
    return_token_ids: bool = False
    stream: bool = False
    """The response as server-sent events (``event_stream``)."""
    stream_usage: bool = False
    """stream_options.include_usage: a last event with the usage."""


def _int(body: dict[str, Any], key: str, low: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ApiError(400, f"{key} must be an integer >= {low}, got {value!r}", param=key,
                       code="invalid_value")
    return value


def turn_request(body: dict[str, Any], vocab_size: int) -> TurnRequest:
    """The turn fields of ``body``, checked (400 on a bad one)."""
    stop = body.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a non-empty string or a list of them", param="stop",
                       code="invalid_value")
    allowed = body.get("allowed_token_ids")
    if allowed is not None and (
            not isinstance(allowed, list) or not allowed
            or not all(isinstance(i, int) and 0 <= i < vocab_size for i in allowed)):
        raise ApiError(400, f"allowed_token_ids must be a non-empty list of token ids "
                            f"below {vocab_size}", param="allowed_token_ids",
                       code="invalid_value")
    logprobs = body.get("logprobs")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options",
                       code="invalid_value")
    return TurnRequest(
        max_tokens=_int(body, "max_tokens", 1) or _int(body, "max_completion_tokens", 1),
        stop=tuple(stop), seed=_int(body, "seed", 0),
        allowed_token_ids=tuple(allowed) if allowed is not None else None,
        include_stop_str_in_output=bool(body.get("include_stop_str_in_output")),
        logprobs=logprobs is not None and logprobs is not False,
        return_token_ids=bool(body.get("return_token_ids")),
        stream=bool(body.get("stream")), stream_usage=bool(options.get("include_usage")))


def prompt_of(body: dict[str, Any]) -> str | list[int]:
    """A completion request's prompt: a text, or token ids (a list of one text is that
    text); 400 otherwise (a batch of prompts is refused: one session, one trajectory)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if (isinstance(prompt, list) and prompt
            and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)):
        return list(prompt)
    raise ApiError(400, "prompt must be one non-empty text or one list of token ids",
                   param="prompt", code="invalid_value")


def messages_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat request's messages as ``{"role", "content"}`` texts (a content given as
    parts keeps its text parts, joined), an assistant message's ``tool_calls`` and a tool
    message's ``tool_call_id`` and ``name`` kept; 400 for anything else."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages",
                       code="invalid_value")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, "each message needs a role", param="messages",
                           code="invalid_value")
        content = m.get("content") or ""
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise ApiError(400, "a message's content must be text", param="messages",
                           code="invalid_value")
        message: dict[str, Any] = {"role": m["role"], "content": content}
        if m["role"] == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _tool_calls_of(m["tool_calls"])
        if m["role"] == "tool":
            message.update((k, m[k]) for k in ("tool_call_id", "name")
                           if isinstance(m.get(k), str))
        out.append(message)
    return out


def _tool_calls_of(calls: Any) -> list[dict[str, Any]]:
    """An assistant message's tool calls as ``{"id", "type", "function": {"name",
    "arguments"}}`` (the arguments as sent: a JSON text, or an object); 400 unless each
    is a function call with a name."""
    refused = ApiError(400, "an assistant message's tool_calls must be a list of function "
                            "calls, each with a name", param="messages", code="invalid_value")
    if not isinstance(calls, list):
        raise refused
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise refused
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": function["name"],
                                 "arguments": function.get("arguments") or ""}})
    return out


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One function call of an assistant message, as the gateway issued it."""

    id: str
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's format)."""

    def body(self) -> dict[str, Any]:
        """The call as a chat message's ``tool_calls`` item."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class TurnResult(msgspec.Struct, frozen=True, kw_only=True):
    """One generated turn as the response reports it."""

    text: str
    finish_reason: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    tokens: tuple[str, ...] = ()
    """Each token's text (for the logprobs block)."""
    stop_reason: str | None = None
    """The stop string the turn ended at (vLLM's ``stop_reason``); None otherwise."""
    tool_calls: tuple[ToolCall, ...] = ()
    """The calls parsed from the completion (``workers.rollout.tool_calls``); ``text`` is
    then the content outside them ("" for none)."""


def _usage(turn: TurnResult) -> dict[str, int]:
    prompt, completion = len(turn.prompt_ids), len(turn.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _extras(turn: TurnResult, request: TurnRequest) -> dict[str, Any]:
    if not request.return_token_ids:
        return {}
    return {"prompt_token_ids": list(turn.prompt_ids), "token_ids": list(turn.token_ids)}


_IDS = itertools.count()
_ID_PREFIX = secrets.token_hex(8)


def response_id(kind: str) -> str:
    """A response's id, unique within this process and across processes: a random
    prefix drawn once and a counter (no system call per response, as uuid4 makes)."""
    return f"{kind}-{_ID_PREFIX}{next(_IDS):x}"


def completion_body(turn: TurnResult, request: TurnRequest, model: str) -> dict[str, Any]:
    """A ``text_completion`` response (vLLM's ``return_token_ids`` extension: the
    choice's ``prompt_token_ids`` and ``token_ids``)."""
    logprobs: dict[str, Any] | None = None
    if request.logprobs:
        logprobs = {"tokens": list(turn.tokens), "token_logprobs": list(turn.logprobs),
                    "top_logprobs": None, "text_offset": None}
    choice = {"index": 0, "text": turn.text, "logprobs": logprobs,
              "finish_reason": turn.finish_reason, "stop_reason": turn.stop_reason,
              **_extras(turn, request)}
    return {"id": response_id("cmpl"), "object": "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": _usage(turn)}


def chat_body(turn: TurnResult, request: TurnRequest, model: str) -> dict[str, Any]:
    """A ``chat.completion`` response."""
    logprobs: dict[str, Any] | None = None
    if request.logprobs:
        logprobs = {"content": [{"token": t, "logprob": p, "bytes": None, "top_logprobs": []}
                                for t, p in zip(turn.tokens, turn.logprobs, strict=True)]}
    message: dict[str, Any] = {"role": "assistant", "content": turn.text}
    if turn.tool_calls:
        message.update(content=turn.text or None,
                       tool_calls=[call.body() for call in turn.tool_calls])
    choice = {"index": 0, "message": message, "logprobs": logprobs,
              "finish_reason": turn.finish_reason, "stop_reason": turn.stop_reason,
              **_extras(turn, request)}
    return {"id": response_id("chatcmpl"), "object": "chat.completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": _usage(turn)}


def models_body(served: Sequence[str]) -> dict[str, Any]:
    """The ``/v1/models`` list."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                        "owned_by": "async-rl"} for name in served]}


def event_stream(body: dict[str, Any], request: TurnRequest) -> bytes:
    """A whole response (``completion_body`` or ``chat_body``) as the server-sent events a
    ``stream: true`` request reads: one chunk with the turn's text (a chat's ``delta``:
    the role, content and tool calls), one with its finish_reason, with
    stream_options.include_usage one with the usage and no choices, then ``[DONE]``. The
    turn is generated whole first: the stream gives a streaming client the same text,
    calls and token ids, not its tokens sooner."""
    choice = body["choices"][0]
    chat = body["object"] == "chat.completion"
    base = {"id": body["id"], "object": "chat.completion.chunk" if chat else body["object"],
            "created": body["created"], "model": body["model"]}
    if request.stream_usage:
        base["usage"] = None
    last = {"index": 0, "logprobs": None, "finish_reason": choice["finish_reason"],
            "stop_reason": choice["stop_reason"]}
    first = {**{k: v for k, v in choice.items() if k != "stop_reason"},
             "finish_reason": None}
    if chat:
        message = first["delta"] = dict(first.pop("message"))
        if "tool_calls" in message:
            message["tool_calls"] = [{"index": i, **call}
                                     for i, call in enumerate(message["tool_calls"])]
        last["delta"] = {}
    else:
        last["text"] = ""
    chunks = [{**base, "choices": [first]}, {**base, "choices": [last]}]
    if request.stream_usage:
        chunks.append({**base, "choices": [], "usage": body["usage"]})
    return b"".join(b"data: " + msgspec.json.encode(chunk) + b"\n\n" for chunk in chunks
                    ) + b"data: [DONE]\n\n"
