"""Agent tasks: your own agent code plays each trajectory against the run's gateway.

Owns: ``AgentResult`` (what ``solve`` may return beside a bare float), ``AgentConfig``
(what a rollout worker needs of task.kind = "agent"), ``agent_function`` (the ``async
def solve(client, row)`` that task.agent names, checked), ``AgentRunner`` (a group of
trajectories: one session each, ``solve`` called with an ``openai.AsyncOpenAI`` client
whose API key is the session's token, on an event loop of its own, cut at
agent_timeout_s) and ``agent_samples`` (a group's sessions as samples: each segment one
training sequence, ``workers.rollout.sessions``). Each closed session, with its outcome,
goes to the engine's ``SessionRecorder`` for the trace.

A trajectory that ran past task.agent_timeout_s ends with outcome "timeout", one whose
``solve`` raised or returned no finite reward with "error"; task.environment.on_timeout /
on_error say what becomes of it, as for environments ("exclude": no group member,
excluded as ``agent_timeout`` / ``agent_error``; "train": its segments score 0;
"requeue": the group runs again). Its session is closed either way: a later request of
it gets 409. The group's prompt is the longest token prefix every segment shares; the
rest of each segment's prompt leads its sample as context (loss mask 0). Knows nothing
about HTTP (``workers.rollout.gateway``) or engines.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, cast

import msgspec

from buffers.common.config import ConfigError
from buffers.common.records import NO_VERSION, Prompt, Sample
from workers.common.errors import first_line
from workers.common.loop_thread import LoopThread
from workers.common.spans import SessionRecorder
from workers.common.user_code import import_object
from workers.rollout.gateway import Gateway, GatewayLimits, Generate
from workers.rollout.local_http import local_http_client
from workers.rollout.sessions import Segment
from workers.rollout.tool_calls import ToolParser

log = logging.getLogger("async_rl.agents")

AGENT_KEY = "task.agent"
DONE, TIMEOUT, ERROR = "done", "timeout", "error"
EXCLUDED = {TIMEOUT: "agent_timeout", ERROR: "agent_error"}
"""Why a trajectory that ended so is no group member."""
PROMPT_MISMATCH = "agent_prompt_mismatch"
"""Why a segment is no member: it shares no first token with its group's others."""
_LOGGED = 3


class AgentResult(msgspec.Struct, frozen=True):
    """What ``solve`` may return instead of a float: ``AgentResult(reward)``."""

    reward: float
    """The trajectory's reward (every segment of it gets it)."""
    metadata: dict[str, Any] = {}
    """Anything to keep beside it (logged at DEBUG; not trained on)."""


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What a rollout worker needs of task.kind = "agent"."""

    agent: str
    """task.agent, its file path made absolute."""
    agent_timeout_s: float = 300.0
    max_turns: int = 16
    max_trajectory_tokens: int = 1024
    """task.environment.max_trajectory_tokens: one segment's tokens at most."""
    on_timeout: str = "exclude"
    on_error: str = "exclude"


Solve = Callable[[Any, dict[str, Any]], Awaitable[Any]]


def agent_function(target: str, base_dir: str | Path | None = None) -> Solve:
    """The ``async def solve(client, row)`` task.agent names; ``ConfigError`` naming
    task.agent for anything else."""
    solve = import_object(target, AGENT_KEY, base_dir=base_dir, kind="Function")
    if not inspect.iscoroutinefunction(solve):
        raise ConfigError(f"config error: {AGENT_KEY} = {target!r}: must be an 'async def "
                          f"solve(client, row)' function")
    try:
        inspect.signature(solve).bind(None, {})
    except TypeError:
        raise ConfigError(f"config error: {AGENT_KEY} = {target!r}: must take two "
                          f"arguments (client, row)") from None
    return cast(Solve, solve)


def reward_of(value: Any) -> float:
    """``solve``'s return as a finite float; ``TypeError`` / ``ValueError`` otherwise."""
    reward = value.reward if isinstance(value, AgentResult) else value
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise TypeError(f"solve returned {type(value).__name__}, not a float or "
                        f"async_rl.AgentResult")
    if not math.isfinite(reward):
        raise ValueError(f"solve returned a reward of {reward}")
    return float(reward)


def shared_http_client() -> Any:
    """The HTTP client every session's ``AsyncOpenAI`` shares: one pool of keep-alive
    connections to the gateway (a client of its own per trajectory costs a new pool, and
    an SSL context, each time; a pool capped below the sessions at once would reconnect),
    on plain HTTP/1.1 (``workers.rollout.local_http``). A session's ``client.close()``
    leaves it open for the others; ``close_pool`` closes it, on the agents' loop."""
    return local_http_client()


async def _close_pool(http: Any) -> None:
    """Cancels the agents still running on this loop, then closes ``http`` (closing it
    under them would fail them with connection errors instead)."""
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    if others:
        await asyncio.wait(others, timeout=1.0)
    await http.close_pool()


def _common_prefix(prompts: Sequence[Sequence[int]]) -> list[int]:
    if not prompts:
        return []
    shortest = min(len(p) for p in prompts)
    n = 0
    while n < shortest and all(p[n] == prompts[0][n] for p in prompts):
        n += 1
    return list(prompts[0][:n])


def group_prompt(segments: Sequence[Segment]) -> list[int]:
    """The prompt every sample of a group shares: the segments' longest common prefix;
    where that is empty, the prefix shared by the segments that start with the most
    common first token (the others are no members: ``PROMPT_MISMATCH``)."""
    prefix = _common_prefix([s.prompt_ids for s in segments])
    if prefix or not segments:
        return prefix
    first = Counter(s.prompt_ids[0] for s in segments).most_common(1)[0][0]
    return _common_prefix([s.prompt_ids for s in segments if s.prompt_ids[0] == first])


def agent_samples(trajectories: Sequence[tuple[Sequence[Segment], str, float]],
                  on_timeout: str, on_error: str, decode: Callable[[list[int]], str]
                  ) -> tuple[list[int], list[Sample]]:
    """A group's trajectories, each (its segments, its outcome, its reward), as (the
    group's prompt ids, the samples): one per segment (``Sample.trajectory`` says
    whose), or one empty sample for a trajectory that generated nothing. The outcome
    rides on a trajectory's first sample only, so each is counted once."""
    prompt = group_prompt([s for segments, _, _ in trajectories for s in segments])
    samples: list[Sample] = []
    for k, (segments, outcome, reward) in enumerate(trajectories):
        policy = {TIMEOUT: on_timeout, ERROR: on_error}.get(outcome, "")
        excluded = EXCLUDED[outcome] if policy == "exclude" else ""
        if not segments:
            samples.append(Sample(token_ids=(), logprobs=(), versions=(),
                                  finish_reason="abort", text="", env_outcome=outcome,
                                  excluded=excluded, trajectory=k))
            continue
        for j, seg in enumerate(segments):
            fits = seg.prompt_ids[:len(prompt)] == prompt
            head = seg.prompt_ids[len(prompt):] if fits else seg.prompt_ids
            samples.append(Sample(
                token_ids=(*head, *seg.tokens),
                logprobs=(*[0.0] * len(head), *seg.logprobs),
                versions=(*[NO_VERSION] * len(head), *seg.versions),
                loss_mask=(*[0] * len(head), *seg.mask),
                finish_reason=seg.finish_reason, text=decode(seg.tokens),
                reward=reward if policy != "train" else 0.0,
                env_outcome=outcome if j == 0 else DONE,
                excluded=excluded or ("" if fits else PROMPT_MISMATCH),
                longest_turn=seg.longest_turn, trajectory=k))
    return prompt, samples


class AgentRunner:
    """Plays groups of trajectories with the agent ``config`` names, through
    ``gateway``; see the module docstring. Made in the rollout worker's process."""

    def __init__(self, config: AgentConfig, gateway: Gateway, tokenizer: Any,
                 solve: Solve | None = None, sessions: SessionRecorder | None = None
                 ) -> None:
        """``sessions``: where each closed session goes for the trace (None: nowhere)."""
        self.config, self.gateway, self._tokenizer = config, gateway, tokenizer
        self.sessions = sessions
        self._solve = solve or agent_function(config.agent)
        self._loop = LoopThread("async-rl-agents")
        self._failures = 0
        self.outcomes: Counter[str] = Counter()
        self._http: Any = None  # one connection pool for every session's client

    async def close(self) -> None:
        """Stops the agents' loop (calls still running are cancelled, then the shared
        connection pool is closed) and the gateway."""
        http, self._http = self._http, None
        if http is not None:
            try:
                await self._loop.run(_close_pool(http), 2.0)
            except Exception:
                log.debug("could not close the agents' connection pool", exc_info=True)
        self._loop.close()
        await self.gateway.close()

    async def group(self, prompt: Prompt, size: int, seeds: Sequence[int] = (),
                    greedy: bool = False) -> tuple[list[int], list[Sample], int]:
        """``size`` trajectories of ``prompt`` side by side: (the group's prompt ids,
        the unscored samples, each with its trajectory's reward and outcome, the
        requests of their sessions the gateway refused)."""
        row = dict(prompt.columns)
        table = self.gateway.table
        sessions = [table.open(self.config.max_turns, greedy=greedy,
                               seed=seeds[k] if seeds else None) for k in range(size)]
        try:
            ended = await asyncio.gather(*(self._play(s.token, row) for s in sessions))
        finally:
            closed = [table.close(s.token) for s in sessions]
        self.outcomes.update(outcome for outcome, _ in ended)
        if self.sessions is not None:
            for k, (session, (outcome, _)) in enumerate(zip(closed, ended, strict=True)):
                self.sessions.keep(session.span(self.sessions.worker, prompt.prompt_id, k,
                                                outcome))
        prompt_ids, samples = agent_samples(
            [(s.segments, outcome, reward)
             for s, (outcome, reward) in zip(closed, ended, strict=True)],
            self.config.on_timeout, self.config.on_error,
            lambda ids: str(self._tokenizer.decode(ids, skip_special_tokens=True)))
        return prompt_ids, samples, sum(s.refused for s in closed)

    async def _play(self, token: str, row: dict[str, Any]) -> tuple[str, float]:
        cfg = self.config

        async def call() -> Any:
            import openai

            if self._http is None:  # made on the agents' loop, which alone uses it
                self._http = shared_http_client()
            client = openai.AsyncOpenAI(base_url=self.gateway.base_url, api_key=token,
                                        max_retries=0, timeout=cfg.agent_timeout_s,
                                        http_client=self._http)
            return await self._solve(client, dict(row))

        try:
            return DONE, reward_of(await self._loop.run(call(), cfg.agent_timeout_s))
        except TimeoutError:
            self._log(TIMEOUT, f"ran past task.agent_timeout_s = {cfg.agent_timeout_s} s")
            return TIMEOUT, 0.0
        except Exception as err:
            self._log(ERROR, f"raised {first_line(err)}")
            return ERROR, 0.0

    def _log(self, outcome: str, why: str) -> None:
        self._failures += 1
        policy = self.config.on_timeout if outcome == TIMEOUT else self.config.on_error
        level = logging.WARNING if self._failures <= _LOGGED else logging.DEBUG
        more = " (further ones are logged at DEBUG)" if self._failures == _LOGGED else ""
        log.log(level, "agent %s: a trajectory %s; it ends (on_%s = %r)%s",
                self.config.agent, why, outcome, policy, more)


async def serve_agents(config: AgentConfig, *, engine: Any, rollout: Any, tokenizer: Any,
                       params: dict[str, Any], generate: Generate, model_name: str,
                       sessions: SessionRecorder, tool_parser: ToolParser | None = None,
                       chat_template: str = "") -> AgentRunner:
    """The gateway in front of ``engine`` (vLLM's, on the running loop), started, and the
    runner of the agents that use it, its sessions kept in ``sessions``. ``rollout``:
    the rollout section (its token budget, and the in-flight bound:
    max_inflight_prompts x group_size requests); ``tool_parser``:
    rollout.tool_call_parser's (None: function calling off); ``chat_template``:
    rollout.chat_template's text ("": the tokenizer's own)."""
    model = engine.model_config
    gateway = Gateway(
        model_name=model_name, tokenizer=tokenizer, params=params, generate=generate,
        limits=GatewayLimits(max_new_tokens=rollout.max_new_tokens,
                             max_context=model.max_model_len,
                             max_trajectory_tokens=config.max_trajectory_tokens,
                             max_concurrency=rollout.max_inflight_prompts * rollout.group_size,
                             vocab_size=model.get_vocab_size()),
        tool_parser=tool_parser, chat_template=chat_template)
    await gateway.start()
    return AgentRunner(config, gateway, tokenizer, sessions=sessions)
