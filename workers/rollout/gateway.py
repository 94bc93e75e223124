"""The gateway: an OpenAI-compatible HTTP endpoint in front of one rollout engine.

Owns: ``Gateway`` (``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``
served by uvicorn on the rollout worker's own event loop as bare ASGI, beside its engine, bound to
127.0.0.1 on a free port), how a request becomes a turn of its session
(``workers.rollout.sessions``: the session is the request's API key; its prompt
continues the session's last segment as exact token ids, or starts a new one) and how
that turn is generated: the run's sampling parameters (temperature, top_p: the behaviour
policy's) with the request's max_tokens (at most rollout.max_new_tokens and the room
left under task.environment.max_trajectory_tokens), stop strings, seed and vLLM's
allowed_token_ids; at most ``max_concurrency`` requests on the engine at once; a chat's
messages rendered by the tokenizer's chat template, or by rollout.chat_template's; with
rollout.tool_call_parser set, a chat's ``tools`` rendered and its completion parsed into
``tool_calls`` (``workers.rollout.tool_calls``); a ``stream: true`` request's turn, once
generated, sent as server-sent events. Every refusal is an OpenAI-format error
(``workers.rollout.openai_format``) and counted; the engine keeps serving.

One gateway per engine, not per node: a session's turns then always reach the engine
whose prefix cache holds its context, and the engine's event loop runs the handlers
with no hop between processes. Knows nothing about agents, rewards or groups
(``workers.rollout.agents`` opens and closes the sessions).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgspec

from buffers.common.records import Sample
from workers.common.errors import first_line
from workers.rollout.openai_format import (
    ApiError,
    TurnRequest,
    TurnResult,
    chat_body,
    check_model,
    completion_body,
    event_stream,
    messages_of,
    models_body,
    parse_body,
    prompt_of,
    turn_request,
)
from workers.rollout.prompts import encode_plain
from workers.rollout.sessions import OPEN, Session, SessionError, SessionTable, extend
from workers.rollout.stop_strings import cut_at_stop
from workers.rollout.tool_calls import (
    ParserTurn,
    ToolParser,
    answer,
    template_messages,
    tool_request,
)

log = logging.getLogger("async_rl.gateway")

Generate = Callable[[list[int], Any, bool], Awaitable[Sample]]
"""Runs one engine request (prompt ids, sampling parameters, greedy) and returns its
unscored sample with per-token logprobs and versions: the rollout worker's."""
_SEED_RANGE = 2**63
KEEP_ALIVE_S = 60
"""How long the server keeps an idle connection open: far past the agents' transport's
reuse (``workers.rollout.local_http.REUSE_S``), so a connection it reuses is not one
the server is closing, even on a core so busy that the client reads a response seconds
after it was sent."""
_JSON = msgspec.json.Encoder()
JSON_TYPE, EVENTS_TYPE = b"application/json", b"text/event-stream"
Reply = tuple[int, bytes, bytes]
"""A route's answer: its status, body and content type."""


def _bearer(scope: dict[str, Any]) -> str:
    """The request's API key: its ``Authorization: Bearer`` token ("" when none)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            return value.decode("latin-1").removeprefix("Bearer ").strip()
    return ""


async def _read_body(receive: Any) -> bytes:
    """The request's whole body (ASGI may hand it over in parts)."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ApiError(400, "the client went away", code="client_disconnected")
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


class GatewayLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The bounds a turn is generated within."""

    max_new_tokens: int
    """rollout.max_new_tokens: a turn's budget at most."""
    max_context: int
    """The engine's context length (prompt plus completion)."""
    max_trajectory_tokens: int
    """task.environment.max_trajectory_tokens: one segment (a training sequence)."""
    max_concurrency: int
    """Requests on the engine at once (rollout.max_inflight_prompts x
    rollout.group_size: what a built-in task's groups hold)."""
    vocab_size: int


class _Server:
    """uvicorn's server, without its signal handlers (the worker's process owns those)."""

    @staticmethod
    def make(app: Any) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        return Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                     lifespan="off", interface="asgi3",
                                     timeout_keep_alive=KEEP_ALIVE_S))


class Gateway:
    """See the module docstring. Built and started on the engine's event loop."""

    def __init__(self, *, model_name: str, tokenizer: Any, params: dict[str, Any],
                 generate: Generate, limits: GatewayLimits,
                 table: SessionTable | None = None, tool_parser: ToolParser | None = None,
                 chat_template: str = "") -> None:
        self.model_name = model_name
        self.table = table if table is not None else SessionTable()
        self.limits = limits
        self.refused: Counter[str] = Counter()
        """Refused requests by error code."""
        self.served = 0
        self._tokenizer, self._params, self._generate = tokenizer, params, generate
        self._tool_parser = tool_parser
        """rollout.tool_call_parser's (``workers.rollout.tool_parser``); None: off, a
        request with tools is refused."""
        self._template = {"chat_template": chat_template} if chat_template else {}
        """rollout.chat_template's Jinja text, rendered in place of the tokenizer's own
        chat template (none: the tokenizer's)."""
        self._slots = asyncio.Semaphore(limits.max_concurrency)
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None
        self.base_url = ""
        """``http://host:port/v1`` once started."""

    # ---- serving ----------------------------------------------------------------------

    async def app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The ASGI application: three routes, each answered with one body (JSON, or a
        ``stream: true`` turn's events), always with its Content-Length. Bare
        ASGI, no framework: on the one core the rollout worker's engine, gateway and
        agents share, Starlette's middleware and routing were about a tenth of a turn's
        CPU (docs/benchmarks.md)."""
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        route = _ROUTES.get(path)
        try:
            if route is None or method not in route[0]:
                raise ApiError(404 if route is None else 405,
                               f"no route {method} {path}", code="not_found")
            status, body, media = await route[1](self, _bearer(scope), receive)
        except ApiError as err:
            status, body, media = self._error(err)
        except Exception:  # a bug, not the request's: the engine keeps serving
            log.exception("gateway: %s %s failed", method, path)
            status, body, media = self._error(ApiError(500, "the gateway failed",
                                                       code="internal_error"))
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", media),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def start(self, host: str = "127.0.0.1") -> str:
        """Serves on ``host`` at a free port, on the running loop; returns the base URL."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        port = sock.getsockname()[1]
        self._server = _Server.make(self.app)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
            await asyncio.sleep(0.01)
        self.base_url = f"http://{host}:{port}/v1"
        log.info("gateway serving %s at %s", self.model_name, self.base_url)
        return self.base_url

    async def close(self) -> None:
        """Stops serving (requests under way are cut)."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._task, 5.0)
        self._server = self._task = None

    # ---- the routes ---------------------------------------------------------------------

    def _error(self, err: ApiError) -> Reply:
        self.refused[err.code or str(err.status)] += 1
        return err.status, _JSON.encode(err.body()), JSON_TYPE

    def _session(self, token: str) -> Session:
        try:
            return self.table.get(token)
        except SessionError as err:
            raise ApiError(err.status, err.message, code=err.code) from None

    async def _models(self, token: str, receive: Any) -> Reply:
        self._session(token)
        return 200, _JSON.encode(models_body([self.model_name])), JSON_TYPE

    async def _completions(self, token: str, receive: Any) -> Reply:
        return await self._serve(token, receive, chat=False)

    async def _chat(self, token: str, receive: Any) -> Reply:
        return await self._serve(token, receive, chat=True)

    async def _serve(self, token: str, receive: Any, *, chat: bool) -> Reply:
        arrived = self.table.clock()
        session: Session | None = None
        try:
            session = self._session(token)
            body = parse_body(await _read_body(receive))
            check_model(body, self.model_name)
            turn = turn_request(body, self.limits.vocab_size)
            parsing = tool_request(body, self._tool_parser, chat=chat, model=self.model_name)
            prompt = (self._render(template_messages(messages_of(body), session.replies),
                                   parsing) if chat else prompt_of(body))
            async with session.lock:
                session = self._session(token)  # still open
                try:
                    session.check_turn()
                except SessionError as err:
                    raise ApiError(err.status, err.message, code=err.code) from None
                session.arrived = arrived  # the turn's start in the trace
                result = await self._turn(session, prompt, turn, chat=chat)
                if parsing is not None:
                    result = answer(result, parsing, self._tokenizer, session.replies)
        except ApiError:
            if session is not None:
                session.refused += 1
            raise
        self.served += 1
        body = (chat_body if chat else completion_body)(result, turn, self.model_name)
        if turn.stream:  # a refusal above is still one JSON error, as OpenAI's are
            return 200, event_stream(body, turn), EVENTS_TYPE
        return 200, _JSON.encode(body), JSON_TYPE

    # ---- one turn -------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, Any]], parsing: ParserTurn | None) -> str:
        if not self._template and not getattr(self._tokenizer, "chat_template", None):
            raise ApiError(400, "the model's tokenizer has no chat template: use "
                                "/v1/completions, or set rollout.chat_template",
                           code="no_chat_template")
        with_tools = {"tools": parsing.tools} if parsing is not None else {}
        try:
            return str(self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **with_tools,
                **self._template))
        except Exception as err:
            raise ApiError(400, f"the chat template refused the messages: {err}",
                           param="messages", code="invalid_value") from None

    def _encode(self, text: str, *, special: bool) -> list[int]:
        return encode_plain(self._tokenizer, text, special)

    def _prompt_ids(self, session: Session, prompt: str | list[int], *, chat: bool
                    ) -> tuple[list[int], str]:
        """The prompt's ids (the session's last segment continued exactly, or the whole
        prompt tokenized) and its text."""
        if isinstance(prompt, list):
            return prompt, str(self._tokenizer.decode(prompt, skip_special_tokens=True))
        ids = extend(session.last, prompt, lambda rest: self._encode(rest, special=False))
        # A completion's text is tokenized as the engine would (special tokens added);
        # a rendered chat template already holds its own.
        return (ids if ids is not None else self._encode(prompt, special=not chat)), prompt

    async def _turn(self, session: Session, prompt: str | list[int], request: TurnRequest,
                    *, chat: bool) -> TurnResult:
        ids, prompt_text = self._prompt_ids(session, prompt, chat=chat)
        limit = min(self.limits.max_context, self.limits.max_trajectory_tokens)
        room = limit - len(ids)
        if room <= 0:
            raise ApiError(400, f"the prompt has {len(ids)} tokens: no room for a "
                                f"completion within {limit} (the engine's context, and "
                                f"task.environment.max_trajectory_tokens)",
                           param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        params = self._params["greedy" if session.greedy else "sample"].clone()
        params.max_tokens = min(request.max_tokens or self.limits.max_new_tokens,
                                self.limits.max_new_tokens, room)
        if request.stop:
            # vLLM matches stop strings on the detokenised text (see cut_at_stop).
            params.stop, params.detokenize = list(request.stop), True
            params.include_stop_str_in_output = True
        seed = request.seed
        if seed is None and session.seed is not None:
            seed = (session.seed + session.turns) % _SEED_RANGE
        if seed is not None:
            params.seed = seed
        if request.allowed_token_ids is not None:
            params.allowed_token_ids = list(request.allowed_token_ids)
        try:
            async with self._slots:
                out = await self._generate(ids, params, session.greedy)
        except ValueError as err:  # vLLM refused the request's parameters
            raise ApiError(400, f"the engine refused the request: {first_line(err)}",
                           code="invalid_request") from None
        except Exception as err:  # the engine failed: the worker reports it on its own
            raise ApiError(503, f"the engine failed: {first_line(err)}",
                           code="engine_unavailable") from None
        if session.state != OPEN:
            raise ApiError(409, "this session's trajectory ended during the request",
                           code="session_finished")
        if out.finish_reason == "abort":
            raise ApiError(503, "the engine aborted the request (a failed weight update)",
                           code="engine_unavailable")
        cut = cut_at_stop(out.token_ids, out.logprobs, out.versions, self._tokenizer,
                          request.stop)
        kept = list(cut.token_ids)
        decode = self._tokenizer.decode
        # The text the next prompt must start with to continue the segment: the
        # completion as the agent writes it back (a chat template writes the EOS token).
        context_text = str(decode(kept, skip_special_tokens=not chat))
        text = cut.text
        if cut.stop and not request.include_stop_str_in_output:
            text = text[:-len(cut.stop)]
        finish = "stop" if cut.stop else out.finish_reason
        session.record(ids, prompt_text, kept, cut.logprobs, cut.versions, context_text,
                       finish)
        tokens = tuple(str(decode([t])) for t in kept) if request.logprobs else ()
        return TurnResult(text=text, finish_reason=finish, prompt_ids=tuple(ids),
                          token_ids=tuple(kept), logprobs=cut.logprobs, tokens=tokens,
                          stop_reason=cut.stop or None)


_ROUTES: dict[str, tuple[frozenset[str], Callable[[Gateway, str, Any],
                                                  Awaitable[Reply]]]] = {
    "/v1/completions": (frozenset({"POST"}), Gateway._completions),
    "/v1/chat/completions": (frozenset({"POST"}), Gateway._chat),
    "/v1/models": (frozenset({"GET", "HEAD"}), Gateway._models),
}
"""Path -> (its methods, its handler); anything else is 404, a wrong method 405."""
