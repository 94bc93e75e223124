"""The roles beside one trainer shard's policy (placement "trainer"): the frozen reference
and the critic, and the step they share with the policy.

Owns: one step's data as the PPO dataflow moves it on this shard (``PpoStep``: its
sequences laid out once in packed micro-batches, then the reference's logprobs, the
critic's values, the per-token advantages and returns), each stage as one call the
orchestrator makes in order (``StepRoles.prepare``, ``reference_logprobs``,
``critic_values``, ``advantages``, ``critic_update``; the policy's update between the
last two is ``TrainerShard.train_step``, which takes the laid-out step from here), and
the frozen reference itself (a copy of the initial weights, or reference.path, with no
gradient). GAE's arithmetic is ``workers.trainer.gae``'s, the KL estimators
``workers.trainer.kl``'s, the value model ``workers.trainer.critic``'s. Knows nothing
about Ray, queues or versions: the reference is fixed, so staleness and per-token
versions are untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from buffers.records import GroupTokens, ShardBatch, TrainSequence
from buffers.reports import CriticStepResult
from workers.spans import UNRESOLVED, SpanRecorder
from workers.trainer.attention import use_packed_attention
from workers.trainer.config import TrainerConfig
from workers.trainer.critic import Critic
from workers.trainer.gae import from_rows, gae, moments, to_rows, token_rewards, whiten
from workers.trainer.kl import kl_estimate
from workers.trainer.packing import packed_forward
from workers.trainer.ppo_update import Prepared, StepLoss
from workers.trainer.roles_config import CriticConfig

Tensors = list[torch.Tensor | None]
"""One entry per micro-batch of the step; None for a pad."""


@dataclass
class PpoStep:
    """One step's data on this shard, filled stage by stage."""

    batch: ShardBatch
    tokens: Sequence[GroupTokens] | None
    """The batch's groups resolved; None when this shard could not fetch them."""
    sequences: tuple[tuple[TrainSequence, ...], ...]
    prepared: list[Prepared]
    """Laid out once; ``advantages`` swaps in each one's per-token advantages."""
    lost: bool
    """Some shard could not fetch its groups: no stage computes, no shard trains."""
    reference: Tensors = field(default_factory=list)
    values: Tensors = field(default_factory=list)
    returns: Tensors = field(default_factory=list)


def load_reference(path: str, *, dtype: torch.dtype, device: torch.device
                   ) -> torch.nn.Module:
    """The frozen reference policy: no gradient, never trained, on the shard's device."""
    from transformers import AutoModelForCausalLM

    module = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    use_packed_attention(module)
    module.to(device)  # type: ignore[arg-type]
    module.eval()
    module.requires_grad_(False)
    return module


class StepRoles:
    """The reference and the critic of one trainer shard, and the step they work on."""

    def __init__(self, *, trainer: TrainerConfig, losses: StepLoss, device: torch.device,
                 world_size: int, temperature: float, reference: torch.nn.Module | None,
                 critic: Critic | None, spans: tuple[SpanRecorder, SpanRecorder]) -> None:
        """``spans``: the policy's track and the critic's (the critic's device time is
        the policy's ``critic`` idle cause)."""
        self.trainer = trainer
        self.losses = losses
        self.device = device
        self.world_size = world_size
        self.temperature = temperature
        self.reference = reference
        self.critic = critic
        self.spans, self.critic_spans = spans
        self.step: PpoStep | None = None
        """The step in progress: from ``prepare`` to the end of ``critic_update`` (or of
        the policy's update, without a critic)."""

    def _all_reduce(self, values: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
        if self.world_size > 1:
            values = values.to(self.device)
            dist.all_reduce(values, op=op)
        return values.cpu()

    @contextlib.contextmanager
    def _policy_busy(self, version: int | None = None) -> Iterator[None]:
        self.spans.switch("forward", version)
        try:
            yield
        finally:
            self.spans.switch(UNRESOLVED)

    @contextlib.contextmanager
    def _critic_busy(self, cause: str) -> Iterator[None]:
        """The co-located critic computes: busy on its track, ``critic`` on the
        policy's (idle for the policy: the device computes the other role)."""
        self.spans.switch("critic")
        self.critic_spans.switch(cause)
        try:
            yield
        finally:
            self.critic_spans.switch(UNRESOLVED)
            self.spans.switch(UNRESOLVED)

    def current(self, step: int) -> PpoStep:
        if self.step is None or self.step.batch.step != step:
            raise RuntimeError(f"step {step} was not prepared on this shard")
        return self.step

    def holds(self, step: int) -> bool:
        """Whether ``step`` was laid out here (the policy's update then reuses it)."""
        return self.step is not None and self.step.batch.step == step

    # ---- the stages, in the orchestrator's order ------------------------------------------

    def prepare(self, batch: ShardBatch, tokens: Sequence[GroupTokens] | None) -> bool:
        """Lays the step's micro-batches out once (packed rows on the device); every
        shard agrees whether any lost its groups. Returns that."""
        with self._policy_busy(batch.step - 1):
            flag = torch.tensor([int(tokens is None)], dtype=torch.long)
            lost = bool(self._all_reduce(flag, dist.ReduceOp.MAX)[0])
            sequences = (batch.sequences(tokens) if tokens is not None and not lost
                         else ((),) * len(batch.micro_batches))
            self.step = PpoStep(batch=batch, tokens=tokens, sequences=sequences,
                                prepared=self.losses.prepare(sequences), lost=lost)
        return lost

    def reference_logprobs(self, step: int) -> None:
        """The reference's logprob of every trained token, once per sample, on the same
        packed layout the policy trains on (no gradient)."""
        current = self.current(step)
        if self.reference is None or current.lost:
            return
        reference = self.reference
        with self._policy_busy(), torch.no_grad(), self.losses.autocast():
            current.reference = [
                None if mb.packed is None
                else packed_forward(reference, reference, mb.packed, self.temperature)[0]
                for mb in current.prepared]

    def critic_values(self, step: int) -> None:
        """The critic's current weights' value of every trained token."""
        current = self.current(step)
        if self.critic is None or current.lost:
            return
        with self._critic_busy("forward"), self.losses.autocast():
            current.values = self.critic.values(current.prepared)

    def advantages(self, step: int) -> None:
        """Per-token GAE advantages (whitened over every shard's trained tokens) and
        returns; the outcome reward on each sequence's last policy token, minus
        kl_coef * KL per token with trainer.kl_in_reward (KL of the behaviour policy
        that sampled the tokens, against the reference)."""
        current = self.current(step)
        if self.critic is None:
            return
        with self._critic_busy("forward"):
            self._advantages(current)

    def _advantages(self, current: PpoStep) -> None:
        raw: Tensors = []
        totals = torch.zeros(3, dtype=torch.float64)
        current.returns = []
        for index, mb in enumerate(current.prepared):
            if mb.packed is None or current.lost:
                raw.append(None)
                current.returns.append(None)
                continue
            advantages, returns = self._gae(mb, current.values[index],
                                            current.reference[index] if current.reference
                                            else None)
            raw.append(advantages)
            current.returns.append(returns)
            totals += moments(advantages).cpu()
        totals = self._all_reduce(totals, dist.ReduceOp.SUM)
        current.prepared = [
            mb if advantages is None or mb.packed is None
            else dataclasses.replace(mb, packed=dataclasses.replace(
                mb.packed, advantages=whiten(advantages, totals).float()))
            for mb, advantages in zip(current.prepared, raw, strict=True)]

    def _gae(self, micro_batch: Prepared, values: torch.Tensor | None,
             reference: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch's raw advantages and returns, flat over its trained tokens."""
        assert micro_batch.packed is not None and values is not None
        values = values.double()
        rows, mask = to_rows(values, micro_batch.lengths)
        outcome = torch.tensor([s.reward for s in micro_batch.sequences],
                               dtype=torch.float64, device=values.device)
        rewards = token_rewards(outcome, mask)
        if self.trainer.kl_in_reward and reference is not None:
            kl = kl_estimate(micro_batch.packed.behaviour_logprobs.double(),
                             reference.double(), self.trainer.kl_estimator)
            rewards = rewards - self.trainer.kl_coef * to_rows(kl, micro_batch.lengths)[0]
        critic = self.critic
        assert critic is not None
        advantages, returns = gae(rewards, rows, mask, gamma=critic.config.gamma,
                                  lam=critic.config.lam)
        return from_rows(advantages, mask), from_rows(returns, mask).float()

    def critic_update(self, step: int, rank: int) -> CriticStepResult:
        """The critic's updates on the step (cut as the policy's are), towards the
        returns, clipped around the values the advantages were computed from."""
        critic = self.critic
        if critic is None:  # the policy's update ended the step
            return CriticStepResult(rank=rank, step=step)
        current = self.current(step)
        self.step = None
        if current.lost:
            return CriticStepResult(rank=rank, step=step, samples_lost=True)
        batch = current.batch
        updates = batch.per_update(current.prepared)
        counts = torch.tensor([sum(sum(mb.lengths) for mb in update) for update in updates],
                              dtype=torch.long)
        tokens = [int(c) for c in self._all_reduce(counts, dist.ReduceOp.SUM).tolist()]
        with self._critic_busy("backward"), self.losses.autocast():
            return critic.update(step, updates, batch.per_update(current.values),
                                 batch.per_update(current.returns), tokens)

    def policy_done(self) -> None:
        """The policy's update used the step: without a critic, nothing more needs it."""
        if self.critic is None:
            self.step = None


def build_roles(*, trainer: TrainerConfig, losses: StepLoss, device: torch.device,
                dtype: torch.dtype, world_size: int, rank: int, temperature: float,
                reference_path: str, critic: CriticConfig | None,
                spans: tuple[SpanRecorder, SpanRecorder]) -> StepRoles:
    """The roles a shard holds: a reference when ``reference_path`` is set, a critic
    when ``critic`` is (its path resolved)."""
    return StepRoles(
        trainer=trainer, losses=losses, device=device, world_size=world_size,
        temperature=temperature, spans=spans,
        reference=(load_reference(reference_path, dtype=dtype, device=device)
                   if reference_path else None),
        critic=(Critic(critic, trainer=trainer, dtype=dtype, device=device,
                       world_size=world_size, rank=rank)
                if critic is not None else None))
