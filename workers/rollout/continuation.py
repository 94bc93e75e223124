"""Handing partial rollouts back and continuing them: a rollout worker's side of it.

Owns: ``HandBack``, the worker's state while it hands its rollouts back (the sampling
requests to abort, the multi-turn groups to cancel, whether the engine is leaving), and
the arithmetic of a continuation, without vLLM: the partial a cut-short sample leaves
(``partial_sample``), what is left to generate of each kept sample (``remaining``: its
prompt is the group's prompt ids plus the kept tokens, its budget rollout.max_new_tokens
less the kept count; none when it had finished, reached the budget, or ends with EOS),
the continuation's seed (``continuation_seed``) and the sample a continuation makes
(``joined``: the kept tokens, log-probs and versions unchanged, then the new ones).

Exactness (docs/operations.md, "Stopping and resuming"): the kept prefix's tokens,
log-probs and per-token versions are bit-identical to what the engine produced before
the hand-back; the continuation is a fresh sample conditioned on that prefix. With
rollout.sampling_seed its seed is derived from the sample's own seed and the kept
length, so it is reproducible, but it need not equal the tokens an uninterrupted
request would have sampled. A sample with nothing kept starts again with its own seed,
so it samples what it would have. Multi-turn trajectories are not continued: a
trajectory's environment cannot be saved, so it restarts from its prompt. Knows nothing
about engines, queues or checkpoints.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import anyio

from buffers.common.partials import PartialGroup, PartialSample
from buffers.common.records import Prompt, Sample

__all__ = ["HandBack", "any_cut", "continuation_seed", "continue_samples", "joined",
           "partial_sample", "remaining"]

StreamAll = Callable[..., Awaitable[list[tuple[tuple[int, ...], Sample]]]]
"""The worker's ``_stream_all``: (contexts, kind, seeds, max_tokens) -> one
(prompt ids, sample) per context."""


class HandBack:
    """What a worker hands back, and what it must abort to do so."""

    def __init__(self) -> None:
        self.handing_back = False
        """Set by ``start``: cut-short groups come back as partial groups from now on."""
        self.leaving = False
        """The engine stops itself (``RolloutWorker.leave``): it takes no more work."""
        self.requests: set[str] = set()
        """Sampling requests in the engine now (greedy evaluations are not handed back)."""
        self.scopes: set[anyio.CancelScope] = set()
        """Multi-turn groups in progress: cancelled, they restart from their prompt."""
        self.groups = 0
        """Groups (and continuations) in progress."""

    def start(self, leaving: bool) -> int:
        """Hands back from now on; returns the groups in progress (what comes back)."""
        self.handing_back = True
        self.leaving = self.leaving or leaving
        for scope in self.scopes:
            scope.cancel()
        return self.groups

    async def abort(self, engine: Any) -> None:
        """Aborts the sampling requests in ``engine`` (vLLM's ``AsyncLLM``): each ends
        with the tokens it has. A request added just after an abort is aborted again."""
        for _ in range(100):
            if not self.requests:
                return
            await engine.abort(list(self.requests))
            await anyio.sleep(0.01)

    def partial(self, prompt: Prompt, prompt_ids: Sequence[int], samples: Sequence[Sample],
                *, rank: int, restarts: str = "", kept: PartialGroup | None = None
                ) -> PartialGroup:
        """``samples`` (cut short or finished) as the partial group engine ``rank`` hands
        back; with no token kept and none finished, a restart (``restarts`` says why);
        ``kept``: a partial group handed on as it came."""
        if kept is not None:
            parts = kept.samples
        else:
            parts = tuple(partial_sample(s) for s in samples)
            if not any(p.token_ids or p.finished for p in parts):
                parts, restarts = (), restarts or "not_started"
        return PartialGroup(prompt=prompt, prompt_token_ids=tuple(prompt_ids) if parts else (),
                            samples=parts, rollout_rank=rank,
                            restarts="" if parts else restarts, leaving=self.leaving)


def partial_sample(sample: Sample) -> PartialSample:
    """What a sample keeps when it is handed back: everything it had; finished, its
    finish reason too."""
    finished = sample.finish_reason if sample.finish_reason in ("stop", "length") else ""
    return PartialSample(token_ids=sample.token_ids, logprobs=sample.logprobs,
                         versions=sample.versions, finish_reason=finished)


def remaining(sample: PartialSample, max_new_tokens: int, eos_ids: Collection[int]
              ) -> tuple[int, str]:
    """(tokens left to generate, finish reason): (n > 0, "") to continue it; (0, why)
    when it is complete as it stands: it had finished, it already holds max_new_tokens
    ("length"), or its last token is an end of sequence ("stop"; ``eos_ids`` empty
    with rollout.ignore_eos)."""
    if sample.finished:
        return 0, sample.finish_reason
    left = max_new_tokens - len(sample.token_ids)
    if left <= 0:
        return 0, "length"
    if sample.token_ids and sample.token_ids[-1] in eos_ids:
        return 0, "stop"
    return left, ""


def request_seed(sampling_seed: int, prompt: Prompt, sample: int) -> int:
    """The seed of one sample request: the same wherever and whenever it runs (a
    signed int64)."""
    return continuation_seed(sampling_seed, prompt, sample, kept=0)


def continuation_seed(seed: int, prompt: Prompt, sample: int, kept: int) -> int:
    """The seed of sample ``sample``'s continuation after ``kept`` tokens (``seed``:
    rollout.sampling_seed): ``request_seed``'s own when nothing was kept."""
    key = f"{seed}/{prompt.prompt_id}/{prompt.attempt}/{sample}"
    if kept:
        key += f"/+{kept}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> 1


def joined(kept: PartialSample, new: Sample | None, finish_reason: str, text: str) -> Sample:
    """The whole sample: ``kept`` unchanged, then ``new``'s tokens (None: nothing was
    generated, the sample ends as ``finish_reason`` says); ``text``: the decoded whole."""
    if new is None:
        return Sample(token_ids=kept.token_ids, logprobs=kept.logprobs,
                      versions=kept.versions, finish_reason=finish_reason, text=text)
    return Sample(token_ids=kept.token_ids + new.token_ids,
                  logprobs=kept.logprobs + new.logprobs,
                  versions=kept.versions + new.versions,
                  finish_reason=new.finish_reason, text=text)


def any_cut(samples: Sequence[Sample]) -> bool:
    """Some sample was cut short (aborted) rather than finished."""
    return any(s.finish_reason not in ("stop", "length") for s in samples)


async def continue_samples(partial: PartialGroup, stream_all: StreamAll,
                           decode: Callable[[Sequence[int]], str], max_new_tokens: int,
                           eos_ids: Collection[int], sampling_seed: int) -> list[Sample]:
    """Every sample of ``partial``, whole: those cut short continued by one request each
    (the prompt ids plus the kept tokens as its prompt, the budget less the kept count,
    ``continuation_seed`` when ``sampling_seed`` >= 0), the others as they were."""
    left = [remaining(s, max_new_tokens, eos_ids) for s in partial.samples]
    todo = [k for k, (n, _) in enumerate(left) if n > 0]
    contexts = [[*partial.prompt_token_ids, *partial.samples[k].token_ids] for k in todo]
    seeds = ([continuation_seed(sampling_seed, partial.prompt, k,
                                len(partial.samples[k].token_ids)) for k in todo]
             if sampling_seed >= 0 else [])
    streams = (await stream_all(contexts, "sample", seeds, [left[k][0] for k in todo])
               if todo else [])
    new = dict(zip(todo, (sample for _, sample in streams), strict=True))
    samples = []
    for k, kept in enumerate(partial.samples):
        more = new.get(k)
        tokens = kept.token_ids + (more.token_ids if more is not None else ())
        samples.append(joined(kept, more, left[k][1], decode(tokens)))
    return samples
