"""Stub workers for bench/data/scale.py: no vLLM, no torch; groups at a set rate, work per token.

Owns: the stub rollout actor (``StubRollout``), the stub trainer actor (``StubTrainer``),
what a point asks of them (``StubSpec``) and the by-value records the "before" data
path moves (``ValueTokens``, ``ValueSequence``, ``ValueShardBatch``). The stubs answer
the same calls as ``workers.actors.RolloutActor`` / ``TrainerActor``, so the real
``async_rl.shell.ray_shell`` adapters drive them. A separate module from the bench script so
Ray's workers import these classes by name (a class defined in ``__main__`` would be
pickled by value with every record that crosses a process).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence

import msgspec
import numpy as np
import ray

from buffers.common.records import Group, GroupTokens, Prompt, Sample
from buffers.common.reports import EvalResult, UsageReading
from buffers.common.train_records import LossStats, ShardBatch, ShardStepResult
from workers.common.spans import Span

VOCAB = 151_936
"""Token ids are drawn below a real vocabulary's size: ids above 256 are not Python's
cached small ints, so the by-value path pays for them as the old path did."""


class StubSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What one rollout stub emits during one sweep point."""

    by_value: bool
    """Return the tokens inline as Python tuples (the old path) instead of a reference."""
    group_size: int
    prompt_length: int
    median_completion: float
    """Median of the lognormal completion length."""
    sigma: float
    """Lognormal shape: 1.0 puts the 99th percentile about 10x the median."""
    max_completion: int
    """Lengths are clipped here (finish reason "length")."""
    groups_per_s: float
    """This stub's emission rate."""
    seed: int

    @staticmethod
    def for_tokens(tokens_per_step: int, groups_per_step: int, group_size: int, sigma: float,
                   *, by_value: bool, groups_per_s: float, seed: int) -> StubSpec:
        """Lengths whose mean sequence (prompt + completion) makes ``tokens_per_step``.

        The prompt is an eighth of the mean sequence, the rest lognormal completion; the
        clip sits at 16x the mean, so it trims well under 1% of the tokens at sigma 1.
        """
        mean_sequence = tokens_per_step / (groups_per_step * group_size)
        prompt = max(1, round(mean_sequence / 8))
        completion = max(1.0, mean_sequence - prompt)
        return StubSpec(by_value=by_value, group_size=group_size, prompt_length=prompt,
                        median_completion=completion / math.exp(sigma**2 / 2), sigma=sigma,
                        max_completion=max(16, round(16 * completion)),
                        groups_per_s=groups_per_s, seed=seed)


class ValueTokens(msgspec.Struct, frozen=True, kw_only=True):
    """A group's tokens by value, as the old ``Group`` carried them: Python tuples."""

    prompt_token_ids: tuple[int, ...]
    samples: tuple[Sample, ...]


class ValueSequence(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """The old ``TrainSequence``: one sample's tuples, pickled into its shard's batch."""

    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    behaviour_logprobs: tuple[float, ...]
    advantage: float


class ValueShardBatch(msgspec.Struct, frozen=True, kw_only=True):
    """The old ``ShardBatch``: a shard's micro-batches with every token inline."""

    step: int
    micro_batches: tuple[tuple[ValueSequence, ...], ...]


class ObservedStub:
    """What every stub reports for the shell's observation calls: its own process's
    CPU time, its clock, and no spans (the bench measures the driver, not the stubs)."""

    def usage(self) -> UsageReading:
        return UsageReading(wall=time.time(), cpu_s=time.process_time())

    def clock(self) -> float:
        return time.time()

    def drain_spans(self) -> list[Span]:
        return []


class StubRollout(ObservedStub):
    """Emits one group per ``1 / groups_per_s`` seconds, lognormal lengths, random tokens.

    Token data are slices of pools drawn at ``reset``, so building a group costs little
    and the stub is not what limits a point.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.epoch = 0
        self.in_flight = 0
        self.current_version = 0
        self.spec: StubSpec | None = None
        self.next_slot = 0.0
        self.rng = np.random.default_rng(rank)
        self.ids = np.zeros(0, np.int32)
        self.logprobs = np.zeros(0, np.float32)
        self.id_tuple: tuple[int, ...] = ()
        self.logprob_tuple: tuple[float, ...] = ()

    def reset(self, spec: StubSpec) -> None:
        """Starts a point: ``spec``'s lengths and rate, version 0."""
        self.spec, self.current_version = spec, 0
        self.next_slot = time.monotonic()
        self.rng = np.random.default_rng(spec.seed * 1000 + self.rank)
        if spec.by_value:
            # Per-sample tuple slices: twice the longest sample, so no slice is the whole
            # pool (a full slice is the pool itself, not a new tuple).
            size = 2 * spec.max_completion + spec.prompt_length
            self.id_tuple = tuple(self.rng.integers(0, VOCAB, size).tolist())
            self.logprob_tuple = tuple((-self.rng.exponential(1.0, size)).tolist())
            self.ids, self.logprobs = np.zeros(0, np.int32), np.zeros(0, np.float32)
        else:
            # One contiguous slice per group: room for a group of longest samples.
            size = spec.group_size * spec.max_completion + spec.prompt_length + 1
            self.ids = self.rng.integers(0, VOCAB, size, dtype=np.int32)
            self.logprobs = -self.rng.exponential(1.0, size).astype(np.float32)
            self.id_tuple, self.logprob_tuple = (), ()

    async def quiesce(self) -> None:
        """Ends a point: the calls still sleeping (the run that made them has ended)
        return None unbuilt, so their results cost the driver nothing after it; returns
        once none is left."""
        self.epoch += 1
        while self.in_flight:
            await asyncio.sleep(0.005)

    async def generate_group_ref(self, prompt: Prompt) -> Group | None:
        spec, epoch = self.spec, self.epoch
        assert spec is not None, "reset() first"
        now = time.monotonic()
        self.next_slot = max(self.next_slot, now) + 1 / spec.groups_per_s
        self.in_flight += 1
        try:
            await asyncio.sleep(self.next_slot - now)
        finally:
            self.in_flight -= 1
        if epoch != self.epoch:
            return None
        # The version when the group finishes: staleness drops are not what this measures.
        version = self.current_version
        lengths = np.clip(np.rint(self.rng.lognormal(math.log(spec.median_completion),
                                                     spec.sigma, spec.group_size)),
                          1, spec.max_completion).astype(np.int64)
        rewards = tuple(float(r) for r in self.rng.integers(0, 2, spec.group_size))
        finish = tuple("length" if n == spec.max_completion else "stop" for n in lengths)
        tokens = (self._value_tokens(spec, lengths, rewards, finish, version) if spec.by_value
                  else ray.put(self._array_tokens(spec, lengths, version)))
        return Group(prompt=prompt, prompt_length=spec.prompt_length,
                     completion_lengths=tuple(int(n) for n in lengths), rewards=rewards,
                     finish_reasons=finish, min_version=version, max_version=version,
                     num_tokens=int(lengths.sum()) + spec.prompt_length * spec.group_size,
                     rollout_rank=self.rank, finished_at=time.time(), tokens=tokens)

    def _array_tokens(self, spec: StubSpec, lengths: np.ndarray, version: int) -> GroupTokens:
        total = int(lengths.sum())
        start = int(self.rng.integers(spec.prompt_length, len(self.ids) - total))
        return GroupTokens(prompt_token_ids=self.ids[:spec.prompt_length],
                           completion_token_ids=self.ids[start:start + total],
                           logprobs=self.logprobs[start:start + total],
                           versions=np.full(total, version, np.int32),
                           offsets=np.concatenate([[0], np.cumsum(lengths)]))

    def _value_tokens(self, spec: StubSpec, lengths: np.ndarray, rewards: tuple[float, ...],
                      finish: tuple[str, ...], version: int) -> ValueTokens:
        samples = []
        for n, reward, reason in zip(lengths.tolist(), rewards, finish, strict=True):
            start = int(self.rng.integers(spec.prompt_length, len(self.id_tuple) - n))
            # No decoded text: the old Sample carried it too, so this understates the
            # old path's cost a little.
            samples.append(Sample(token_ids=self.id_tuple[start:start + n],
                                  logprobs=self.logprob_tuple[start:start + n],
                                  versions=(version,) * n, finish_reason=reason, text="",
                                  reward=reward))
        return ValueTokens(prompt_token_ids=self.id_tuple[:spec.prompt_length],
                           samples=tuple(samples))

    async def evaluate(self, prompts: Sequence[Prompt]) -> EvalResult:
        return EvalResult(accuracy=0.0, version_min=self.current_version,
                          version_max=self.current_version, num_prompts=len(prompts),
                          rollout_rank=self.rank, seconds=0.0)

    def set_version(self, version: int) -> None:
        """The stub weight path's delivery: later groups carry ``version``."""
        self.current_version = version

    def version(self) -> int:
        return self.current_version

    def shutdown(self) -> None:
        pass


class StubTrainer(ObservedStub):
    """Resolves its batch's tokens, then sleeps ``ns_per_token`` per token it trains."""

    def __init__(self, rank: int, ns_per_token: float) -> None:
        self.rank, self.ns_per_token = rank, ns_per_token

    def train_step_by_ref(self, batch: ShardBatch) -> ShardStepResult:
        """The new path: fetch the groups from the object store, as ``TrainerActor`` does."""
        tokens = ray.get(list(batch.groups))
        sequences = [s for mb in batch.sequences(tokens) for s in mb]
        return self._train(batch.step,
                           prompt=sum(len(s.prompt_token_ids) for s in sequences),
                           completion=sum(len(s.completion_token_ids) for s in sequences))

    def train_step_by_value(self, batch: ValueShardBatch) -> ShardStepResult:
        """The old path: every token arrived inside the batch."""
        sequences = [s for mb in batch.micro_batches for s in mb]
        return self._train(batch.step,
                           prompt=sum(len(s.prompt_token_ids) for s in sequences),
                           completion=sum(len(s.completion_token_ids) for s in sequences))

    def _train(self, step: int, *, prompt: int, completion: int) -> ShardStepResult:
        # Sleeping, not spinning: on a shared 2-core machine busy stub compute would slow
        # the driver it is meant to measure.
        seconds = (prompt + completion) * self.ns_per_token * 1e-9
        time.sleep(seconds)
        return ShardStepResult(
            rank=self.rank, step=step, grad_norm=0.0,
            loss=LossStats(tokens=completion, loss_sum=0.0, clipped=0,
                           is_weight_sum=float(completion), is_weight_sq_sum=float(completion),
                           is_weight_max=1.0, kl_sum=0.0),
            forward_s=seconds, backward_s=0.0, optimizer_s=0.0, barrier_s=0.0,
            input_tokens=prompt + completion, computed_positions=prompt + completion)

    def mean_cores(self) -> float:
        return 1.0

    def save(self, out_dir: str) -> None:
        pass

    def save_policy(self, out_dir: str) -> None:
        pass

    def save_checkpoint(self, out_dir: str) -> None:
        pass
