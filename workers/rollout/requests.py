"""One rollout engine's requests: each sample streamed from the engine, and what the
engine is doing while they run.

Owns: ``EngineRequests``, which sends one engine request per sample (a text, or token
ids), streams its tokens with their behaviour log-probs and a policy version per token
(the engine's own labels where it has them), keeps the requests in flight (tokens so far,
which of them are evaluations, which a hand-back may cut: ``HandBack.requests``), and
switches the worker's spans between generate, evaluate, a weight update's phases and
idle as they start and end. It knows the engine only through the worker's ``ready``
(which raises once the worker cannot generate) and nothing about groups, rewards or
turns: the rollout worker (``workers.rollout.worker``) builds those from its samples.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from buffers.common.records import Sample
from workers.common.spans import UNRESOLVED, SpanRecorder
from workers.rollout.config import RolloutConfig
from workers.rollout.continuation import HandBack
from workers.rollout.engine import (
    engine_request,
    token_logprobs,
    versions_from_spans,
)
from workers.rollout.idle_spin import IdleSpin
from workers.weights.receiver import WeightReceiver

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

Streamed = tuple[tuple[int, ...], Sample]
"""The prompt ids vLLM used and the unscored sample."""


class EngineRequests:
    """See the module docstring. ``lora_request`` and ``decode`` are set once the engine
    has started (the worker's ``start``)."""

    def __init__(self, rank: int, rollout: RolloutConfig, *, ready: Callable[[], AsyncLLM],
                 receiver: WeightReceiver, spans: SpanRecorder, hand_back: HandBack,
                 failed: Callable[[], bool]) -> None:
        """``failed``: whether the worker failed (its idle engine may then block)."""
        self._rank, self._rollout, self._ready = rank, rollout, ready
        self._receiver, self._spans, self._hand_back = receiver, spans, hand_back
        self._ids = itertools.count()
        self.in_flight: dict[str, int] = {}
        """Request id -> tokens generated so far."""
        self._evaluating = 0  # greedy (evaluation) requests among those in flight
        self.idle = IdleSpin(busy=lambda: bool(self.in_flight) or receiver.updating
                             or failed())
        self.lora_request: Any = None
        """With model.lora on: the policy's adapter, which every request names."""
        self.decode: Callable[[Sequence[int]], str] = lambda tokens: ""

    def switch_span(self) -> None:
        """The worker's span after a request starts or ends or the weights change."""
        # Busy whenever the engine holds requests; idle causes are resolved later by
        # the controller, which knows why nothing was submitted. A span has one cause:
        # generation wins, so "evaluate" is time the engine ran nothing but evaluation.
        version = self._receiver.version
        if self._receiver.updating:
            # A version's cost per engine: bytes arriving, then the load (the rest of the
            # pause, waiting on the group and the trainer's calls, is weight_sync).
            phase = self._receiver.phase
            self._spans.switch(f"weight_{phase}" if phase else "weight_sync", version)
        elif len(self.in_flight) > self._evaluating:
            self._spans.switch("generate", version)
        else:
            self._spans.switch("evaluate" if self.in_flight else UNRESOLVED, version)

    async def sample(self, ids: list[int], params: SamplingParams, greedy: bool) -> Sample:
        """``stream``'s sample alone (an evaluation's when ``greedy``): a turn of a
        multi-turn trajectory, or a gateway request."""
        return (await self.stream(ids, params, evaluation=greedy))[1]

    async def stream(self, prompt: str | list[int], params: SamplingParams, *,
                     evaluation: bool = False) -> Streamed:
        """One engine request (a text, or token ids from ``render``)."""
        engine = self._ready()
        request_id = f"rollout{self._rank}-{next(self._ids)}"
        prompt_ids: tuple[int, ...] = ()
        sampling = not evaluation
        if sampling and self._hand_back.handing_back:  # handed back before it started
            return prompt_ids, Sample(token_ids=(), logprobs=(), versions=(),
                                      finish_reason="abort", text="")
        tokens: list[int] = []
        logprobs: list[float] = []
        # Fallback tag if the engine's spans are unusable. Streaming: the version current
        # as each step's tokens arrive. Otherwise the version the request started under,
        # the oldest its tokens can have (staleness errs high, never low).
        started_version = self._receiver.version
        arrival_versions: list[int] = []
        finish_reason, spans = "abort", None
        self.in_flight[request_id] = 0
        self._evaluating += evaluation
        if sampling:  # ``hand_back`` aborts it (it ends with the tokens it has)
            self._hand_back.requests.add(request_id)
        self.switch_span()
        try:
            # A text prompt: vLLM tokenises it itself. Either way the ids it really used
            # come back on the outputs (the trainer must see exactly those).
            # Prefix caching: the version's salt, so no request reuses blocks an older
            # version computed (weights.kv_policy "keep" leaves them in the cache).
            salt = f"v{started_version}" if self._rollout.prefix_caching else ""
            async for out in engine.generate(engine_request(engine, prompt, salt), params,
                                             request_id, lora_request=self.lora_request):
                prompt_ids = prompt_ids or tuple(out.prompt_token_ids or ())
                completion = out.outputs[0]
                new = list(completion.token_ids)
                logprobs.extend(token_logprobs(request_id, new, completion.logprobs))
                tokens.extend(new)
                arrival_versions.extend([self._receiver.version if self._rollout.stream_tokens
                                         else started_version] * len(new))
                self.in_flight[request_id] = len(tokens)
                if completion.finish_reason is not None:
                    finish_reason = str(completion.finish_reason)
                    spans = completion.weight_versions
        finally:
            del self.in_flight[request_id]
            self._hand_back.requests.discard(request_id)
            self._evaluating -= evaluation
            self.switch_span()
            self.idle.soon()
        # The engine labels each step's tokens with the label set while it was paused
        # for the load, so its spans are exact; a token sampled just before a pause may
        # reach this process only after the version changed.
        versions = versions_from_spans(spans, len(tokens)) or arrival_versions
        return prompt_ids, Sample(token_ids=tuple(tokens), logprobs=tuple(logprobs),
                                  versions=tuple(versions), finish_reason=finish_reason,
                                  text=self.decode(tokens))

    async def stream_all(self, texts: Sequence[str | list[int]], params: SamplingParams, *,
                         evaluation: bool, seeds: Sequence[int] = (),
                         max_tokens: Sequence[int] = ()) -> list[Streamed]:
        """One request per text (or token ids) with ``params``; ``seeds``, when given, one
        per text (see ``rollout.sampling_seed``); ``max_tokens``, when given, each one's
        budget."""
        self._ready()
        each = [params] * len(texts)
        for i, seed in enumerate(seeds):
            each[i] = each[i].clone()
            each[i].seed = seed
        for i, budget in enumerate(max_tokens):
            each[i] = each[i].clone()
            each[i].max_tokens = budget
        try:
            async with asyncio.TaskGroup() as tasks:
                running = [tasks.create_task(self.stream(t, p, evaluation=evaluation))
                           for t, p in zip(texts, each, strict=True)]
        except ExceptionGroup as group:
            # One error (the engine died, say) fails the call; the others were cancelled,
            # which aborts their requests in the engine.
            raise group.exceptions[0] from group
        self._ready()  # a failed weight load aborted the requests: their output is void
        return [task.result() for task in running]
