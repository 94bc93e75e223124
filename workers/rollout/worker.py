"""The rollout worker: one vLLM ``AsyncLLM`` engine that turns prompts into scored groups.

Owns: starting and warming up the engine (built by ``workers.rollout.engine``), generating
a prompt's ``group_size`` samples with behaviour logprobs and a policy version per
token (each sample's engine request and the spans they switch:
``workers.rollout.requests``; multi-turn trajectories with an environment:
``workers.rollout.turns``), scoring them, greedy evaluation, handing groups in progress
back at a clean stop and continuing handed-back ones (``workers.rollout.continuation``),
its counters; the calls through which the trainer's weight-transfer engine updates its
weights are its base's (``workers.rollout.weight_calls``). A plain class; every method
is async, so one actor serves many concurrent ``generate_group`` calls and a weight
update between them (``workers.actors`` is the Ray actor around it). vLLM is imported
only when the engine is built, so importing this module stays cheap.

Knows nothing about admission, staleness bounds, queues, advantages or training: it
generates what it is asked to and labels every token with the weights that produced it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from buffers.common.partials import PartialGroup
from buffers.common.records import NO_VERSION, Group, Prompt, Sample, make_group
from buffers.common.reports import EvalResult, RolloutStatistics, UsageReading
from workers.common.errors import RolloutWorkerError
from workers.common.spans import SessionRecorder, SessionSpan, Span, SpanRecorder
from workers.common.usage import UsageMeter, cuda_uuid
from workers.rollout.adapter_serving import serve_policy_adapter
from workers.rollout.agents import AgentRunner, serve_agents
from workers.rollout.continuation import (
    HandBack,
    any_cut,
    continue_samples,
    request_seed,
)
from workers.rollout.engine import (
    build_engine,
    move_own_threads,
    sampling_params,
)
from workers.rollout.prompts import render
from workers.rollout.requests import EngineRequests, Streamed
from workers.rollout.scoring import Scored, Scorer
from workers.rollout.spec import RolloutSpec
from workers.rollout.task import WorkerTask
from workers.rollout.tool_parser import VllmToolParser
from workers.rollout.turns import TurnRunner
from workers.rollout.weight_calls import WeightUpdateCalls
from workers.weights.receiver import WeightReceiver

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

WARMUP_TEXT = "warm up"
"""Prompt of the start-up warm-up requests (their output is thrown away)."""


class RolloutWorker(WeightUpdateCalls):
    """A vLLM engine with a policy version; see the module docstring. Its weight-update
    calls are ``WeightUpdateCalls``'."""

    def __init__(self, spec: RolloutSpec, task: WorkerTask, version: int = 0) -> None:
        """Cheap: records the arguments; ``start()`` builds the engine.

        ``spec``: the sections it owns (rollout) or runs (model, weights: how its weights
        arrive), its seed and its cores (``workers.rollout.spec``). ``task``: what it gets
        of the task (``workers.rollout.task``: the reward, the prompts' format, the
        environment of a multi-turn task, this rank's own). ``version``: policy version
        of the weights at ``spec.model.path`` (a resumed run starts its engines from the
        checkpoint of that version).
        """
        rank = spec.rank
        self._rank, self._model, self._rollout = rank, spec.model, spec.rollout
        self._transport, self._seed = spec.weights.transport, spec.seed
        self._format = task.prompt_format
        self._scorer = Scorer(task.reward_fn, task.user_rewards, self._format)
        self._cpu_ids = tuple(spec.cpu_ids)
        self._worker_cpu_ids = tuple(spec.worker_cpu_ids)
        device = "cpu:" + ",".join(map(str, self._cpu_ids)) if self._cpu_ids else "cpu"
        self._spans = SpanRecorder(worker=f"rollout-{rank}", role="rollout", rank=rank,
                                   device=device, enabled=spec.record_spans)
        self._sessions = SessionRecorder(worker=f"rollout-{rank}", enabled=spec.record_spans)

        self._engine: AsyncLLM | None = None
        self._adapter_dir = ""  # the engine's adapter folder, removed at shutdown
        self._tokenizer: Any = None  # the model's tokenizer, from start()
        environment = task.environment
        self._environment = environment if environment and environment.enabled else None
        self._make_environment = task.own_environment(rank)
        self._turns: TurnRunner | None = None  # from start(), with an environment
        self._agent = task.agent
        self._model_name = task.model_name or spec.model.path
        self._agents: AgentRunner | None = None  # from start(), with an agent task
        self._usage = UsageMeter()
        self._params: dict[str, SamplingParams] = {}  # "sample" and "greedy", from start()
        self._failed: str | None = None
        super().__init__(WeightReceiver(rank, spec.weights, on_change=self._weights_changed,
                                        version=version),
                         ready=self._ready, built=lambda: self._engine)
        self._hand_back = HandBack()  # partial rollouts handed back (a clean stop)
        self._requests = EngineRequests(rank, spec.rollout, ready=self._ready,
                                        receiver=self._receiver, spans=self._spans,
                                        hand_back=self._hand_back,
                                        failed=lambda: self._failed is not None)
        self._idle = self._requests.idle

        self._groups = self._samples = self._tokens = 0
        self._engine_start_s = self._warmup_s = 0.0

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> int:
        """Builds the engine (tens of seconds on a CPU); returns this actor's pid."""
        if self._engine is not None:
            return os.getpid()
        began = time.perf_counter()
        self._scorer.start()  # the reward processes load while the engine starts
        self._engine = build_engine(self._model, self._rollout, rank=self._rank,
                                    seed=self._seed, cpu_ids=self._cpu_ids,
                                    transport=self._transport)
        import torch

        if torch.cuda.is_available():  # the NVML cross-check samples the engine's GPU
            self._usage.close()
            self._usage = UsageMeter(gpu_uuid=cuda_uuid(0))
        else:
            move_own_threads(self._rank, self._worker_cpu_ids)
        # The engine labels every step's tokens with this: the version of model.path.
        await self._engine.update_weight_version(str(self._receiver.version))
        if self._model.lora.enabled:
            self._requests.lora_request, self._adapter_dir = await serve_policy_adapter(
                self._engine, self._model)
        await self._idle.start(self._engine, self._rollout)
        cfg = self._rollout
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self._model.path)
        self._requests.decode = self._decode
        self._params = sampling_params(cfg)
        if self._environment is not None:
            self._turns = TurnRunner(self._environment, self._tokenizer, self._format,
                                     cfg.max_new_tokens, self._make_environment)
        if self._agent is not None:  # the gateway on this engine, and the agents' loop
            tools = (VllmToolParser(cfg.tool_call_parser, self._tokenizer)
                     if cfg.tool_call_parser else None)
            self._agents = await serve_agents(
                self._agent, engine=self._engine, rollout=cfg, tokenizer=self._tokenizer,
                params=self._params, generate=self._requests.sample, model_name=self._model_name,
                sessions=self._sessions, tool_parser=tools,
                chat_template=(Path(cfg.chat_template).read_text() if cfg.chat_template
                               else ""))
        # Warm-up: the CPU build's first steps at each new batch shape are many times
        # slower than later ones (a run's first 16 groups took 2.1 s to generate cold
        # against 0.18 s warm), which would otherwise land in the first training step as
        # trainer wait. One full in-flight load of throwaway requests takes that cost
        # here, as engine start-up; its spans are discarded and nothing is counted.
        warm_began = time.perf_counter()
        warm_requests = cfg.max_inflight_prompts * cfg.group_size
        await self._stream_all([WARMUP_TEXT] * warm_requests, "sample")
        self._spans.flush()
        self._warmup_s = time.perf_counter() - warm_began
        self._engine_start_s = time.perf_counter() - began
        return os.getpid()

    async def gateway_address(self) -> str:
        """The gateway's base URL (``http://127.0.0.1:PORT/v1``); "" without one."""
        return self._agents.gateway.base_url if self._agents is not None else ""

    async def shutdown(self) -> None:
        """Stops the engine and its processes; the worker cannot generate afterwards."""
        engine, self._engine = self._engine, None
        self._failed = self._failed or "shut down"
        self._idle.close()
        self._scorer.close()
        if self._turns is not None:
            self._turns.close()
        if self._agents is not None:
            await self._agents.close()
        if engine is not None:
            engine.shutdown()
        if self._adapter_dir:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)

    def _ready(self) -> AsyncLLM:
        failed = self._failed or self._idle.failed or self._receiver.failed
        if failed is not None:
            raise RolloutWorkerError(f"rollout worker {self._rank}: {failed}")
        if self._engine is None:
            raise RolloutWorkerError(f"rollout worker {self._rank}: start() was not called")
        return self._engine

    # ---------------------------------------------------------------- spans

    async def drain_spans(self) -> list[Span]:
        """Closed spans since the last call (the current one is closed at now first)."""
        return self._spans.flush()

    async def drain_sessions(self) -> list[SessionSpan]:
        """The agent sessions kept for the trace since the last call (an agent task's)."""
        return self._sessions.drain()

    async def clock(self) -> float:
        """This process's wall clock, for aligning span times across nodes."""
        return time.time()

    async def usage(self) -> UsageReading:
        """CPU time of this actor and its engine processes, for the span cross-check."""
        return self._usage.read()

    # ---------------------------------------------------------------- generation

    async def _stream_all(
        self, texts: Sequence[str | list[int]], kind: str, seeds: Sequence[int] = (),
        max_tokens: Sequence[int] = (),
    ) -> list[Streamed]:
        """One request per text (or token ids) with ``kind``'s sampling ("sample" or
        "greedy": an evaluation's); ``EngineRequests.stream_all`` says the rest."""
        return await self._requests.stream_all(texts, self._params[kind],
                                               evaluation=kind == "greedy", seeds=seeds,
                                               max_tokens=max_tokens)

    async def _play(self, prompt: Prompt, size: int, kind: str,
                    seeds: Sequence[int] = ()) -> tuple[list[int], list[Sample]]:
        """``size`` multi-turn trajectories of ``prompt`` (``TurnRunner.group``)."""
        assert self._turns is not None
        stream = partial(self._requests.sample, greedy=kind == "greedy")
        played = await self._turns.group(prompt, size, stream, self._params[kind], seeds)
        self._ready()  # a failed weight load aborted the requests: their output is void
        return played

    async def generate_group(self, prompt: Prompt) -> Group | PartialGroup:
        """Generates and scores ``group_size`` samples of ``prompt``.

        Each sample is its own engine request (with prefix caching they share the
        prompt's KV). Raises ``RolloutWorkerError`` when the worker cannot generate.
        After ``hand_back`` a group cut short comes back as a ``PartialGroup`` (a
        multi-turn one keeps nothing: it restarts).
        """
        size, seed = self._rollout.group_size, self._rollout.sampling_seed
        seeds = [request_seed(seed, prompt, k) for k in range(size)] if seed >= 0 else []
        if self._hand_back.handing_back:
            return self._partial(prompt, (), [], "not_started")
        self._hand_back.groups += 1
        try:
            if self._agents is None and self._turns is None:
                rendered = render(self._tokenizer, prompt, self._format)
                streams = await self._stream_all([rendered] * size, "sample", seeds)
                # A request handed back before it reached the engine has no prompt ids.
                prompt_ids = next((list(ids) for ids, _ in streams if ids), [])
                return await self._scored(prompt, prompt_ids,
                                          [sample for _, sample in streams])
            with anyio.CancelScope() as scope:  # ``hand_back`` cancels it: it restarts
                self._hand_back.scopes.add(scope)
                refused = 0
                if self._agents is not None:  # the agent plays each trajectory (gateway)
                    prompt_ids, played, refused = await self._agents.group(prompt, size,
                                                                           seeds)
                    self._ready()  # a failed weight load aborted the requests: void output
                else:  # multi-turn: an environment answers every turn
                    prompt_ids, played = await self._play(prompt, size, "sample", seeds)
                scored = await self._scorer.score_trajectories(prompt, played)
            self._hand_back.scopes.discard(scope)
            if scope.cancelled_caught:
                return self._partial(prompt, (), [], "multi_turn")
            return self._group(prompt, prompt_ids, scored, refused)
        finally:
            self._hand_back.groups -= 1

    async def continue_group(self, partial: PartialGroup) -> Group | PartialGroup:
        """Continues a group another engine (or this one, before a stop) handed back:
        each sample cut short goes on from its kept tokens (``continue_samples``), the
        others stay as they were; then the group is scored as ``generate_group``'s.
        Handed back again, it comes back as a partial group of all it has by then."""
        if self._hand_back.handing_back:
            return self._partial(partial.prompt, partial.prompt_token_ids,
                                 [], "not_started", kept=partial)
        self._hand_back.groups += 1
        try:
            eos = (() if self._rollout.ignore_eos or self._tokenizer.eos_token_id is None
                   else (int(self._tokenizer.eos_token_id),))
            samples = await continue_samples(
                partial, self._stream_all, self._decode, self._rollout.max_new_tokens,
                eos, self._rollout.sampling_seed)
            return await self._scored(partial.prompt, list(partial.prompt_token_ids),
                                      samples)
        finally:
            self._hand_back.groups -= 1

    async def hand_back(self, leaving: bool = False) -> int:
        """Aborts every sampling request in the engine: each group in progress comes back
        as a ``PartialGroup`` (its samples' tokens so far, their log-probs and versions),
        and so does every group asked for from now on. The run's clean stop calls it;
        ``leaving``: the engine stops itself (``leave``). Returns the groups in progress."""
        groups = self._hand_back.start(leaving)
        if self._engine is not None:
            await self._hand_back.abort(self._engine)
        return groups

    async def leave(self) -> int:
        """The clean stop of this engine alone: its rollouts in progress are handed back,
        marked ``leaving`` (the run continues them on another engine and replaces this
        one), and it takes no more work. Returns the groups handed back."""
        return await self.hand_back(leaving=True)

    def _decode(self, tokens: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(tokens), skip_special_tokens=True))

    def _partial(self, prompt: Prompt, prompt_ids: Sequence[int], samples: Sequence[Sample],
                 restarts: str = "", kept: PartialGroup | None = None) -> PartialGroup:
        return self._hand_back.partial(prompt, prompt_ids, samples, rank=self._rank,
                                       restarts=restarts, kept=kept)

    async def _scored(self, prompt: Prompt, prompt_ids: list[int], samples: list[Sample]
                      ) -> Group | PartialGroup:
        """A single-turn group's samples, scored; handed back while cut short, partial."""
        if self._hand_back.handing_back and any_cut(samples):
            return self._partial(prompt, prompt_ids, samples)
        return self._group(prompt, prompt_ids, await self._scorer.score(prompt, samples))

    def _group(self, prompt: Prompt, prompt_ids: Sequence[int], scored: Scored,
               refused: int = 0) -> Group:
        samples = scored.samples
        self._groups += 1
        self._samples += len(samples)
        self._tokens += sum(len(s.token_ids) for s in samples)
        return make_group(prompt, prompt_ids, samples,
                          rollout_rank=self._rank, finished_at=time.time(),
                          reward_failures=scored.errors, reward_timeouts=scored.timeouts,
                          reward_pool_saturated=scored.saturated,
                          reward_scores=scored.scores, gateway_refused=refused)

    async def generate_greedy(self, prompts: Sequence[Prompt]) -> list[Sample]:
        """One greedy (temperature 0) completion per prompt, stopping at EOS, scored as
        evaluations are (``Scorer.score_greedy``); with an environment, one greedy
        trajectory each (an agent task: one greedy session each, its first sample)."""
        if self._agents is not None:
            agents = self._agents
            sessions = await asyncio.gather(*(agents.group(p, 1, greedy=True)
                                              for p in prompts))
            self._ready()
            return [samples[0] for _, samples, _ in sessions]
        if self._turns is not None:
            played = await asyncio.gather(*(self._play(p, 1, "greedy") for p in prompts))
            return [(await self._scorer.score_trajectories(p, s, greedy=True)).samples[0]
                    for p, (_, s) in zip(prompts, played, strict=True)]
        streams = await self._stream_all(
            [render(self._tokenizer, p, self._format) for p in prompts], "greedy")
        return [await self._scorer.score_greedy(p, s)
                for p, (_, s) in zip(prompts, streams, strict=True)]

    async def evaluate(self, prompts: Sequence[Prompt]) -> EvalResult:
        """Greedy accuracy (the mean reward of one greedy completion per prompt) and the
        policy versions that produced the scored tokens.

        Runs beside generation and does not hold off weight updates: holding them would
        keep the staleness gate shut for every worker (it opens only once all run the new
        version) and stall training for the length of the evaluation. An update landing
        mid-evaluation shows as version_min < version_max (tokens are labelled exactly).
        """
        if not prompts:
            raise ValueError("evaluate needs at least one prompt")
        began, version = time.perf_counter(), self._receiver.version
        samples = await self.generate_greedy(prompts)
        scored = [s for s in samples if s.min_version != NO_VERSION]  # none: no policy token
        return EvalResult(
            accuracy=sum(s.reward for s in samples) / len(samples),
            version_min=min((s.min_version for s in scored), default=version),
            version_max=max((s.max_version for s in scored), default=version),
            num_prompts=len(samples), rollout_rank=self._rank,
            seconds=time.perf_counter() - began,
        )

    # ---------------------------------------------------------------- weights

    def _weights_changed(self) -> None:
        self._requests.switch_span()
        self._idle.soon()

    # ---------------------------------------------------------------- state

    async def statistics(self) -> RolloutStatistics:
        return RolloutStatistics(
            rank=self._rank, version=self._receiver.version, groups_generated=self._groups,
            samples_generated=self._samples, tokens_generated=self._tokens,
            reward_failures=self._scorer.failures, rewards_skipped=self._scorer.skipped,
            weight_updates=self._receiver.updates,
            requests_running=len(self._requests.in_flight),
            tokens_in_flight=sum(self._requests.in_flight.values()),
            engine_start_s=self._engine_start_s, warmup_s=self._warmup_s,
        )
