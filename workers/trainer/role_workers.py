"""The reference and the critic on workers of their own (placement "own").

Owns: what such a worker shares with a trainer shard's process (``OwnRole``: its cores,
its device, the spans of its role, and a step's batches, those of one or several trainer
shards, laid out exactly as the shards lay them out, so every per-token tensor it makes
lines up with a shard's micro-batches), the frozen reference's logprobs
(``ReferenceWorker``) and the critic (``CriticWorker``: its values, GAE's advantages
whitened over the whole step (with trainer.kl_in_reward, from the reference's logprobs
and the trainer shards' own of their step-start policy), and its update, which runs
while the policy's does; N of
them form a DDP group of their own, each fitting the batches of trainer shards
``rank, rank + N, ...``). Every stage's output is one list per trainer shard given, one
CPU tensor per micro-batch (None for a pad), for that shard to take. The value model,
the reference's loading, the packing and the arithmetic are the same as beside a
trainer shard (``workers.trainer.critic``, ``workers.trainer.shard_roles``,
``workers.trainer.packing``, ``workers.trainer.ppo_stages``). Knows nothing about Ray:
``workers.actors`` wraps these classes and resolves their groups' references.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from buffers.common.records import GroupTokens
from buffers.common.reports import CriticStepResult, UsageReading
from buffers.common.train_records import ShardBatch
from workers.common.spans import UNRESOLVED, Span, SpanRecorder
from workers.trainer.critic import Critic
from workers.trainer.device_setup import use_tf32
from workers.trainer.packing import packed_forward
from workers.trainer.policy_model import DTYPES
from workers.trainer.ppo_stages import (
    Tensors,
    critic_step,
    merged_updates,
    step_advantages,
)
from workers.trainer.ppo_update import Prepared, compute_autocast, lay_out
from workers.trainer.process import device_label, join_process_group, start_process
from workers.trainer.shard_roles import load_reference
from workers.trainer.spec import CriticSpec, OwnRoleSpec, ReferenceSpec


@dataclass
class OwnStep:
    """One step's batches on a role's worker, filled stage by stage."""

    step: int
    batches: Sequence[ShardBatch]
    prepared: list[list[Prepared]]
    """Per batch, its micro-batches laid out; empty when the groups were lost."""
    lost: bool
    values: list[Tensors] = field(default_factory=list)
    returns: list[Tensors] = field(default_factory=list)


def _to_host(tensors: Tensors) -> Tensors:
    return [None if t is None else t.detach().cpu() for t in tensors]


class OwnRole:
    """A role's worker process: its cores, device, spans and the step it holds."""

    def __init__(self, role: str, spec: OwnRoleSpec) -> None:
        self.role, self.rank = role, spec.rank
        self.trainer = spec.trainer
        self.temperature = spec.temperature
        """Rollout's sampling temperature: logprobs are of logits / temperature."""
        self.dtype = DTYPES[spec.model.dtype]
        self.cpu_ids = spec.cpu_ids
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.spans = SpanRecorder(worker=f"{role}-{spec.rank}", role=role, rank=spec.rank,
                                  device=device_label(self.device, spec.cpu_ids),
                                  enabled=spec.record_spans)
        self.step: OwnStep | None = None

    def _setup_process(self) -> None:
        self.usage_meter = start_process(self.device, self.cpu_ids)
        use_tf32(self.trainer, self.device)  # its matmuls as precise as the policy's

    @contextlib.contextmanager
    def _busy(self, cause: str, version: int | None = None) -> Iterator[None]:
        """The role's track in ``cause`` for the block, unresolved idle after it."""
        self.spans.switch(cause, version)
        try:
            yield
        finally:
            self.spans.switch(UNRESOLVED)

    def current(self, step: int) -> OwnStep:
        if self.step is None or self.step.step != step:
            raise RuntimeError(f"{self.role}-{self.rank}: step {step} was not prepared here")
        return self.step

    def prepare(self, batches: Sequence[ShardBatch],
                tokens: Sequence[Sequence[GroupTokens]] | None) -> bool:
        """Lays out the micro-batches of ``batches`` (``tokens``: their groups resolved,
        batch by batch; None when some were lost). Returns whether they were lost."""
        step = batches[0].step
        with self._busy("forward", step - 1):
            prepared = ([] if tokens is None else
                        [lay_out(batch.sequences(groups), self.device)
                         for batch, groups in zip(batches, tokens, strict=True)])
            self.step = OwnStep(step=step, batches=batches, prepared=prepared,
                                lost=tokens is None)
        return tokens is None

    def autocast(self) -> torch.autocast:
        return compute_autocast(self.device, self.trainer)

    # ---- what every worker reports ---------------------------------------------------

    def drain_spans(self) -> list[Span]:
        return self.spans.flush()

    def usage(self) -> UsageReading:
        return self.usage_meter.read()

    def clock(self) -> float:
        return time.time()

    def mean_cores(self) -> float:
        return float(torch.get_num_threads())

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class ReferenceWorker(OwnRole):
    """The frozen reference policy on a worker of its own."""

    def __init__(self, spec: ReferenceSpec) -> None:
        super().__init__("reference", spec)
        self.path = spec.path

    def setup(self) -> int:
        """Loads the reference; returns the pid."""
        self._setup_process()
        self.model = load_reference(self.path, dtype=self.dtype, device=self.device)
        return os.getpid()

    def logprobs(self, step: int) -> list[Tensors]:
        """Per batch, the reference's logprob of every trained token of each micro-batch
        (None for a pad), on the packed layout the shard trains on, no gradient."""
        current = self.current(step)
        model = self.model
        with self._busy("forward"), torch.no_grad(), self.autocast():
            return [_to_host([None if mb.packed is None
                              else packed_forward(model, model, mb.packed, self.temperature)[0]
                              for mb in batch])
                    for batch in current.prepared]


class CriticWorker(OwnRole):
    """One shard of the critic on a worker of its own (a DDP replica among N)."""

    def __init__(self, spec: CriticSpec) -> None:
        super().__init__("critic", spec)
        self.config = spec.critic
        self.world_size = spec.world_size
        self.master_addr, self.master_port = spec.master_addr, spec.master_port

    def setup(self) -> int:
        """Joins the critic workers' group and builds the value model; returns the pid."""
        self._setup_process()
        if self.world_size > 1:
            join_process_group(self.device, master_addr=self.master_addr,
                               master_port=self.master_port, rank=self.rank,
                               world_size=self.world_size)
        self.critic = Critic(self.config, trainer=self.trainer, dtype=self.dtype,
                             device=self.device, world_size=self.world_size, rank=self.rank)
        return os.getpid()

    def _sum_shards(self, values: torch.Tensor) -> torch.Tensor:
        """Host ``values`` summed over the critic workers, on the host (the group's CPU
        backend)."""
        if self.world_size > 1:
            dist.all_reduce(values)
        return values

    def values(self, step: int) -> None:
        """The critic's current weights' value of every trained token of the step."""
        current = self.current(step)
        with self._busy("forward"), self.autocast():
            current.values = [self.critic.values(batch) for batch in current.prepared]

    def advantages(self, step: int, reference: Sequence[Tensors] = (),
                   policy: Sequence[Tensors] = ()) -> list[Tensors]:
        """Per batch, its micro-batches' advantages, whitened over every critic shard's
        tokens (one all-reduce); the returns stay here for the update. ``reference`` and
        ``policy``: the reference's and the step-start policy's logprobs per batch (the
        latter from the batch's trainer shard), for the KL in the reward
        (trainer.kl_in_reward)."""
        current = self.current(step)
        flat = [mb for batch in current.prepared for mb in batch]
        values = [v for batch in current.values for v in batch]
        references = [r for batch in reference for r in batch]
        policies = [p for batch in policy for p in batch]
        with self._busy("forward"):
            advantages, returns = step_advantages(
                flat, values, references, policies, trainer=self.trainer,
                critic=self.config, sum_shards=self._sum_shards)
        cuts = [len(batch) for batch in current.prepared]
        current.returns = _split(returns, cuts)
        return [_to_host(part) for part in _split(advantages, cuts)]

    def update(self, step: int) -> CriticStepResult:
        """The critic's updates on the step, cut as the policy's are (every batch of the
        step is cut into the same updates); ends the step here."""
        current = self.current(step)
        self.step = None
        if current.lost:
            return CriticStepResult(rank=self.rank, step=step, samples_lost=True)
        batches = current.batches
        with self._busy("backward"), self.autocast():
            return critic_step(self.critic, step, merged_updates(batches, current.prepared),
                               merged_updates(batches, current.values),
                               merged_updates(batches, current.returns), self._sum_shards)

    def save(self, folder: str) -> None:
        """The critic's weights and optimizer state into a checkpoint's trainer folder."""
        self.critic.save(folder)

    def load_training_state(self, folder: str) -> None:
        """What ``save`` wrote, on resume."""
        self.critic.load(folder)


def _split(items: Sequence[torch.Tensor | None], counts: Sequence[int]) -> list[Tensors]:
    out, start = [], 0
    for count in counts:
        out.append(list(items[start:start + count]))
        start += count
    return out
