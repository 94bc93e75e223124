"""The roles beside one trainer shard's policy (placement "trainer"): the frozen reference
and the critic, and the step they share with the policy.

Owns: one step's data as the PPO dataflow moves it on this shard (``PpoStep``: its
sequences laid out once in packed micro-batches, then the reference's logprobs, the
critic's values, the per-token advantages and returns), each stage as one call the
orchestrator makes in order (``StepRoles.prepare``, ``reference_logprobs``,
``critic_values``, ``advantages``, ``critic_update``; with trainer.kl_in_reward the
step-start policy's own logprobs too, ``policy_logprobs``; the policy's update between the
last two is ``TrainerShard.train_step``, which takes the laid-out step from here), and
the frozen reference itself (a copy of the initial weights, or reference.path, with no
gradient). With a role on workers of its own (placement "own",
``workers.trainer.role_workers``) the shard takes that role's output for its step instead
(``take_reference``, ``take_advantages``, ``step_lost``) and its idle time waiting for
it has a cause of its own. The stages' arithmetic is ``workers.trainer.ppo_stages``'s
(GAE's ``workers.trainer.gae``'s, the KL estimators ``workers.trainer.kl``'s), the value
model ``workers.trainer.critic``'s. Knows nothing about Ray, queues or versions: the
reference is fixed, so staleness and per-token versions are untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from buffers.common.records import GroupTokens, TrainSequence
from buffers.common.reports import CriticStepResult
from buffers.common.train_records import ShardBatch
from workers.common.spans import UNRESOLVED, SpanRecorder
from workers.trainer.attention import use_packed_attention
from workers.trainer.config import TrainerConfig
from workers.trainer.critic import Critic
from workers.trainer.packing import packed_forward
from workers.trainer.ppo_stages import Tensors, critic_step, step_advantages, with_advantages
from workers.trainer.ppo_update import Prepared, StepLoss
from workers.trainer.roles_config import CriticConfig


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
    policy: Tensors = field(default_factory=list)
    """The step-start policy's logprobs (``StepRoles.policy_logprobs``), once computed."""
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
                 critic: Critic | None, spans: tuple[SpanRecorder, SpanRecorder],
                 awaited: tuple[str, ...] = ()) -> None:
        """``spans``: the policy's track and the critic's (the critic's device time is
        the policy's ``critic`` idle cause). ``awaited``: what the shard waits for from
        roles on workers of their own, in stage order ("wait_reference",
        "wait_critic"): the policy's idle causes from ``prepare`` until they deliver."""
        self.trainer = trainer
        self.losses = losses
        self.device = device
        self.world_size = world_size
        self.temperature = temperature
        self.reference = reference
        self.critic = critic
        self.spans, self.critic_spans = spans
        self.awaited = awaited
        self.step: PpoStep | None = None
        """The step in progress: from ``prepare`` to the end of ``critic_update`` (or of
        the policy's update, without a critic)."""

    def _all_reduce(self, values: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
        """Host ``values`` reduced over every shard, on the host: the group's CPU backend
        takes them, so they never go to the device and back."""
        if self.world_size > 1:
            dist.all_reduce(values, op=op)
        return values

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
        if not lost:
            self._awaiting()
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

    def policy_logprobs(self, step: int) -> Tensors:
        """The step-start policy's logprob of every trained token (the proximal pass: no
        gradient, no dropout), computed once per step: the KL in the reward is this
        policy's (trainer.kl_in_reward; verl's old logprobs), and the policy's update
        takes them as its proximal logprobs if it needs some. Empty for a lost step."""
        current = self.current(step)
        if not current.lost and not current.policy:
            with self._policy_busy():
                current.policy = self.losses.proximal(current.prepared)
        return current.policy

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
        kl_coef * KL per token with trainer.kl_in_reward (KL of the step-start policy,
        ``policy_logprobs``, against the reference)."""
        current = self.current(step)
        if self.critic is None:
            return
        policy = (self.policy_logprobs(step) if self.trainer.kl_in_reward and current.reference
                  else [])
        with self._critic_busy("forward"):
            self._advantages(current, policy)

    def _advantages(self, current: PpoStep, policy: Tensors) -> None:
        if current.lost:
            return  # every shard agreed in ``prepare``: none calls the collective
        assert self.critic is not None
        advantages, current.returns = step_advantages(
            current.prepared, current.values, current.reference, policy,
            trainer=self.trainer, critic=self.critic.config,
            sum_shards=lambda totals: self._all_reduce(totals, dist.ReduceOp.SUM))
        current.prepared = with_advantages(current.prepared, advantages)

    # ---- what roles on workers of their own send (placement "own") ------------------------

    def _awaiting(self, done: str = "") -> None:
        """The policy's track waits for the next role of its own still to deliver
        (``awaited``, in stage order, after ``done``)."""
        later = self.awaited[self.awaited.index(done) + 1:] if done else self.awaited
        self.spans.switch(later[0] if later else UNRESOLVED)

    def take_reference(self, step: int, logprobs: Tensors) -> None:
        """The reference's logprobs of this shard's micro-batches, from its own worker."""
        current = self.current(step)
        if not current.lost:
            current.reference = [None if t is None else t.to(self.device) for t in logprobs]
        self._awaiting("wait_reference")

    def take_advantages(self, step: int, advantages: Tensors) -> None:
        """The per-token advantages of this shard's micro-batches, from the critic's own
        workers (whitened over the whole step there)."""
        current = self.current(step)
        if not current.lost:
            current.prepared = with_advantages(current.prepared, advantages)
        self._awaiting("wait_critic")

    def step_lost(self, step: int) -> None:
        """A role of its own could not fetch the step's groups: no shard trains on them
        (the policy's update agrees on it in its first all-reduce)."""
        self.current(step).lost = True
        self.spans.switch(UNRESOLVED)

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
        with self._critic_busy("backward"), self.losses.autocast():
            return critic_step(critic, step, batch.per_update(current.prepared),
                               batch.per_update(current.values),
                               batch.per_update(current.returns),
                               lambda counts: self._all_reduce(counts, dist.ReduceOp.SUM))

    def policy_done(self) -> None:
        """The policy's update used the step: without a critic, nothing more needs it."""
        if self.critic is None:
            self.step = None


def build_roles(*, trainer: TrainerConfig, losses: StepLoss, device: torch.device,
                dtype: torch.dtype, world_size: int, rank: int, temperature: float,
                reference_path: str, critic: CriticConfig | None,
                spans: tuple[SpanRecorder, SpanRecorder], own_roles: tuple[str, ...] = ()
                ) -> StepRoles:
    """The roles a shard holds: a reference when ``reference_path`` is set, a critic
    when ``critic`` is (its path resolved); ``own_roles``: the roles on workers of
    their own ("reference", "critic") whose outputs the shard takes."""
    return StepRoles(
        trainer=trainer, losses=losses, device=device, world_size=world_size,
        temperature=temperature, spans=spans,
        awaited=tuple(f"wait_{role}" for role in ("reference", "critic") if role in own_roles),
        reference=(load_reference(reference_path, dtype=dtype, device=device)
                   if reference_path else None),
        critic=(Critic(critic, trainer=trainer, dtype=dtype, device=device,
                       world_size=world_size, rank=rank)
                if critic is not None else None))
