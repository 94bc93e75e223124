"""Agent sessions: one trajectory's turns through the gateway, kept as the exact tokens.

Owns: ``Session`` (one trajectory of an agent task: its random token, its segments, its
turn count, open or finished, and each turn's ``TurnSpan`` for the trace: when it
arrived and finished, its tokens and versions), ``Segment`` (a run of turns that each
extended the one before: one training sequence), ``SessionTable`` (the sessions of one
rollout engine, by token, numbered and timed as they open and close) and ``extend``
(the rule that decides whether a request continues the last segment or starts a new
one).

The rule. After each turn a segment keeps its context as token ids (the prompt's, then
every turn's, exactly as generated) and as text (what those ids render to for the
agent: the prompt text, then each completion decoded). A request whose prompt text (a
completion's prompt, or a chat's messages rendered by the template) starts with that
text continues the segment: the context's ids are kept as they are and only the rest of
the text is tokenized and appended (as context: loss mask 0, no version). Anything else
(the agent dropped, reordered or rewrote part of its history) starts a new segment,
tokenized whole. So a completion that decodes to text which tokenizes back to other ids
(a byte-level model's token cut mid-character decodes to U+FFFD; an EOS the text does not
show) trains on the ids the policy produced, never on the re-tokenized text. A reply
with tool calls, which the template renders otherwise than the model wrote it, is
rendered as the model's text when sent back unchanged (``Session.replies``,
``workers.rollout.tool_calls``), so tool turns continue the segment too.

Pure: no engine, no HTTP; the tokenizer is duck-typed (``encode``).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from buffers.common.records import NO_VERSION
from workers.common.spans import SessionSpan, TurnSpan

OPEN, FINISHED = "open", "finished"
REMEMBERED = 65536
"""Finished sessions whose tokens still get 409 (not 401): the newest ones."""
Encode = Callable[[str], list[int]]
"""Text -> token ids: how the rest of an extended prompt is tokenized (no special tokens
added around it)."""


@dataclass
class Segment:
    """A run of turns each of which extended the one before: one training sequence, its
    prompt the first turn's."""

    prompt_ids: list[int]
    """The first turn's prompt, as the engine got it."""
    tokens: list[int] = field(default_factory=list)
    """Everything after the prompt: each turn's generated ids and the agent's additions
    between turns."""
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    """1: the policy generated it (trained); 0: the agent added it (context)."""
    text: str = ""
    """The context as text: the last turn's prompt text and its completion decoded."""
    turns: int = 0
    longest_turn: int = 0
    finish_reason: str = "stop"
    """"length" once any of its turns was cut at its token budget."""

    @property
    def context_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.tokens]

    @property
    def generated(self) -> int:
        return sum(self.mask)


def extend(segment: Segment | None, text: str, encode: Encode) -> list[int] | None:
    """The prompt ids of a request whose prompt text is ``text`` when it continues
    ``segment`` (its context ids, then ``encode`` of the rest of the text); None when it
    does not (no segment yet, or ``text`` does not start with the segment's text)."""
    if segment is None or not segment.turns or not text.startswith(segment.text):
        return None
    return [*segment.context_ids, *encode(text[len(segment.text):])]


def extend_ids(segment: Segment | None, ids: Sequence[int]) -> bool:
    """Whether a request given as token ids continues ``segment`` (its context ids are a
    prefix of ``ids``)."""
    if segment is None or not segment.turns:
        return False
    context = segment.context_ids
    return len(ids) >= len(context) and list(ids[:len(context)]) == context


@dataclass
class Session:
    """One trajectory of an agent task, behind one random token."""

    token: str
    max_turns: int
    greedy: bool = False
    """An evaluation's trajectory: greedy requests."""
    seed: int | None = None
    """rollout.sampling_seed's seed of this trajectory (each turn's is seed + turn)."""
    state: str = OPEN
    segments: list[Segment] = field(default_factory=list)
    turns: int = 0
    refused: int = 0
    """Requests of this session the gateway refused."""
    replies: dict[str, str] = field(default_factory=dict)
    """The turns answered with tool calls: each reply as issued (its key in
    ``workers.rollout.tool_calls``) -> the text the model generated, rendered in its place
    when the agent sends the reply back."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    """Held through each request: one session's turns run one at a time."""
    number: int = 0
    """Its place among its engine's sessions, in the order opened, from 0."""
    opened: float = 0.0
    closed: float = 0.0
    arrived: float = 0.0
    """When the request holding ``lock`` arrived (the gateway sets it): where the turn
    ``record`` notes begins."""
    turn_spans: list[TurnSpan] = field(default_factory=list)
    """Each turn's record for the trace."""
    clock: Callable[[], float] = field(default=time.time, repr=False)
    """Its table's clock (seconds since the epoch)."""

    @property
    def last(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def check_turn(self) -> None:
        """``SessionError`` 409 once the session has used its turns (task.max_turns)."""
        if self.turns >= self.max_turns:
            raise SessionError(409, "max_turns_reached", f"this session has used its "
                                                         f"{self.max_turns} turns "
                                                         f"(task.max_turns)")

    def record(self, prompt_ids: Sequence[int], prompt_text: str, token_ids: Sequence[int],
               logprobs: Sequence[float], versions: Sequence[int], text: str,
               finish_reason: str) -> Segment:
        """Adds one turn: the engine generated ``token_ids`` (with their behaviour
        ``logprobs`` and ``versions``) from ``prompt_ids``, whose text is ``prompt_text``;
        ``text`` is the completion's text as the agent's next prompt will hold it. The
        turn continues the last segment when ``prompt_ids`` extend its context (see
        ``extend``), else it starts a new one. Returns the segment."""
        if not len(token_ids) == len(logprobs) == len(versions):
            raise ValueError(f"{len(token_ids)} token ids came with {len(logprobs)} "
                             f"logprobs and {len(versions)} versions")
        segment = self.last
        new_tokens = len(prompt_ids)
        if extend_ids(segment, prompt_ids):
            assert segment is not None
            added = list(prompt_ids[len(segment.context_ids):])
            new_tokens = len(added)
            segment.tokens += added
            segment.logprobs += [0.0] * len(added)
            segment.versions += [NO_VERSION] * len(added)
            segment.mask += [0] * len(added)
        else:
            segment = Segment(prompt_ids=list(prompt_ids))
            self.segments.append(segment)
        segment.tokens += token_ids
        segment.logprobs += logprobs
        segment.versions += versions
        segment.mask += [1] * len(token_ids)
        segment.text = prompt_text + text
        segment.turns += 1
        segment.longest_turn = max(segment.longest_turn, len(token_ids))
        if finish_reason == "length":
            segment.finish_reason = "length"
        self.turn_spans.append(TurnSpan(
            turn=self.turns, segment=len(self.segments) - 1, arrived=self.arrived,
            finished=self.clock(), prompt_tokens=len(prompt_ids),
            new_prompt_tokens=new_tokens, completion_tokens=len(token_ids),
            min_version=min(versions, default=NO_VERSION),
            max_version=max(versions, default=NO_VERSION), finish_reason=finish_reason))
        self.turns += 1
        return segment

    def span(self, worker: str, prompt_id: str, member: int, outcome: str) -> SessionSpan:
        """The closed session's record for the trace: on rollout engine ``worker``,
        trajectory ``member`` of ``prompt_id``'s group, ended with ``outcome``."""
        return SessionSpan(worker=worker, session=self.number, prompt_id=prompt_id,
                           member=member, greedy=self.greedy, opened=self.opened,
                           closed=self.closed, outcome=outcome, refused=self.refused,
                           turns=tuple(self.turn_spans))


class SessionError(Exception):
    """A request the session table refuses: ``status`` and ``code`` for the OpenAI-format
    error (401 unknown session, 409 finished or out of turns)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class SessionTable:
    """The sessions of one rollout engine, by token. Its methods run on the engine's
    event loop only (the gateway's handlers and the agent runner both live there)."""

    def __init__(self, remember: int = REMEMBERED,
                 clock: Callable[[], float] = time.time) -> None:
        """``clock``: when sessions open and close and their turns finish (seconds since
        the epoch, as spans')."""
        self._open: dict[str, Session] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._remember = remember
        self.clock = clock
        self.opened = 0

    def __len__(self) -> int:
        return len(self._open)

    def open(self, max_turns: int, *, greedy: bool = False, seed: int | None = None
             ) -> Session:
        """A new session behind a fresh random token (128 bits)."""
        token = "sk-session-" + secrets.token_urlsafe(16)
        session = Session(token=token, max_turns=max_turns, greedy=greedy, seed=seed,
                          number=self.opened, opened=self.clock(), clock=self.clock)
        self._open[token] = session
        self.opened += 1
        return session

    def get(self, token: str) -> Session:
        """The open session behind ``token``; ``SessionError`` otherwise (never another
        session's data)."""
        session = self._open.get(token)
        if session is None:
            if token in self._finished:
                raise SessionError(409, "session_finished",
                                   "this session's trajectory has ended")
            raise SessionError(401, "invalid_api_key", "unknown session")
        return session

    def close(self, token: str) -> Session:
        """Ends the session: later requests with its token get 409. Returns it."""
        session = self._open.pop(token)
        session.state, session.closed = FINISHED, self.clock()
        self._finished[token] = None
        while len(self._finished) > self._remember:
            self._finished.popitem(last=False)  # older ones answer 401 instead of 409
        return session
