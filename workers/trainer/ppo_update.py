"""The losses of one trainer shard's step: normalisers, proximal logprobs, micro-batch losses.

Owns: what every optimizer update of a step divides its loss by (the per-update token
and sequence counts of all shards, agreed in one all-reduce: ``StepLoss.agree``), laying
out the step's micro-batches once (``StepLoss.prepare``: packed rows on the device,
reused by the proximal pass and every epoch), the proximal logprobs (one no-grad
forward over the step's micro-batches before any update, only when the step makes more
than one update or the model has dropout: ``StepLoss.proximal``), running such no-grad
passes with dropout off (``without_dropout``: model.lora.dropout, or the model's own, is
for the gradient pass only), and each micro-batch's forward pass and loss
(``StepLoss.micro_batch``), all over trained tokens only (loss mask 1: an observation's
tokens are context, never counted or trained). Statistics stay on the device
(``workers.trainer.loss.PendingStats``). Knows nothing about the optimizer, DDP's
gradient sync, spans or cores: ``workers.trainer.shard`` runs the updates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from buffers.common.records import TrainSequence
from workers.trainer.config import TrainerConfig
from workers.trainer.kl import kl_estimate
from workers.trainer.loss import Normaliser, PendingStats, token_loss
from workers.trainer.packing import (
    PackedBatch,
    completion_logprobs,
    pack,
    packed_forward,
    packed_forward_router_aux,
    padded_logits,
    token_entropy,
    trained_positions,
)

MicroBatch = tuple[TrainSequence, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Prepared:
    """One micro-batch laid out for the step: its sequences, and (packed layout) the
    packed row already on the device."""

    sequences: MicroBatch
    packed: PackedBatch | None
    """None for the padded layout and for a pad (no sequences)."""
    lengths: tuple[int, ...]
    """Trained completion tokens per sequence (loss mask 1): what every count, the
    normaliser's and seq_mean's, counts."""


def lay_out(micro_batches: Sequence[MicroBatch], device: torch.device, *, packed: bool = True
            ) -> list[Prepared]:
    """The step's micro-batches laid out once (packed rows sent to the device now;
    ``packed`` False: the padded layout, laid out at each forward). A shard and a role
    of its own (``workers.trainer.role_workers``) lay one batch out alike."""
    return [Prepared(sequences=mb, lengths=tuple(s.trained_tokens for s in mb),
                     packed=pack(mb, device) if packed and mb else None)
            for mb in micro_batches]


def has_dropout(module: torch.nn.Module) -> bool:
    """Whether ``module`` in train mode draws dropout masks: a dropout layer with p > 0
    (peft's ``lora_dropout`` among them) or an attention dropout rate above 0."""
    for sub in module.modules():
        if isinstance(sub, torch.nn.Dropout) and sub.p > 0:
            return True
        rate = getattr(sub, "attention_dropout", 0.0)
        if isinstance(rate, float) and rate > 0:
            return True
    return False


@contextlib.contextmanager
def without_dropout(module: torch.nn.Module) -> Iterator[None]:
    """``module`` in eval mode for the block when it has dropout (``has_dropout``), each
    submodule's own mode restored after. A no-grad pass whose logprobs serve as a
    policy's (the proximal pass, the KL in the reward's) runs in it: under a random mask
    two such passes differ, and so would the ratios and weights built on them. A module
    without dropout is left as it is (``trainer.compile``'s layers see one mode)."""
    if not has_dropout(module):
        yield
        return
    modes = [(sub, sub.training) for sub in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for sub, training in modes:
            sub.training = training


def compute_autocast(device: torch.device, config: TrainerConfig) -> torch.autocast:
    """bfloat16 autocast on ``device`` where trainer.compute_dtype says so."""
    return torch.autocast(device.type, dtype=torch.bfloat16,
                          enabled=config.compute_dtype == "bfloat16")


@dataclass(frozen=True, kw_only=True, slots=True)
class ForwardPass:
    """One micro-batch's forward pass (``StepLoss.forward``), one value per trained
    completion token."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    """Without gradient: a statistic."""
    behaviour: torch.Tensor
    advantages: torch.Tensor
    positions: int
    """Positions the model computed (padding included)."""
    router_aux: torch.Tensor | None = None
    """The model's router load-balancing loss over the micro-batch (a scalar, with
    gradient) when trainer.router_aux_coef > 0; else None."""


class StepLoss:
    """The loss side of ``TrainerShard.train_step``, for one shard's model replica."""

    def __init__(self, *, config: TrainerConfig, model: torch.nn.Module,
                 module: torch.nn.Module, device: torch.device, world_size: int,
                 packed: bool, temperature: float, max_response_tokens: int,
                 sharded: bool = False) -> None:
        self.config = config
        self.model = model
        """What gradients flow through (DDP-wrapped on more than one shard)."""
        self.module = module
        """The bare model: the no-grad proximal pass runs here, outside DDP, so it
        issues no collective (with FSDP2 it is the sharded model, whose forwards are)."""
        self.device = device
        self.world_size = world_size
        self.packed = packed
        self.temperature = temperature
        self.max_response_tokens = max_response_tokens
        self.sharded = sharded
        """FSDP2: every forward gathers parameters from all shards, so every shard runs
        as many forwards as the others, pads included."""
        self.kl_parts: list[torch.Tensor] = []
        """Each micro-batch's (sum, max) of the KL to the reference since ``read_kl``."""
        self.dropout = has_dropout(module)
        """The gradient pass draws dropout masks, so its logprobs are not the policy's:
        even a one-update step takes its proximal logprobs from a pass without them."""

    def agree(self, updates: Sequence[Sequence[MicroBatch]], lost: bool
              ) -> tuple[list[Normaliser], bool]:
        """Each update's normaliser from every shard's counts, and whether any shard
        lost its groups.

        One all-reduce carries every update's tokens and sequences and the lost flag, so
        a shard that could not fetch its groups makes every shard skip the step together
        rather than leave the others waiting in the gradient all-reduce. The counts are
        the host's and stay there: the group's CPU backend (gloo, beside NCCL on CUDA:
        ``workers.trainer.process``) sums them, so the step neither copies them to the
        device nor waits for the device to read them back.
        """
        counts = [int(lost)]
        for micro_batches in updates:
            counts += [sum(s.trained_tokens for mb in micro_batches for s in mb),
                       sum(len(mb) for mb in micro_batches)]
        if self.world_size > 1:
            summed = torch.tensor(counts, dtype=torch.long)
            dist.all_reduce(summed)
            counts = summed.tolist()
        norms = [Normaliser(agg=self.config.loss_agg, tokens=int(tokens),
                            sequences=int(sequences),
                            max_response_tokens=self.max_response_tokens)
                 for tokens, sequences in zip(counts[1::2], counts[2::2], strict=True)]
        return norms, bool(counts[0])

    def autocast(self) -> torch.autocast:
        """The context every forward of the step runs in: bf16 autocast with
        trainer.compute_dtype = "bfloat16", else a disabled one."""
        return compute_autocast(self.device, self.config)

    def prepare(self, micro_batches: Sequence[MicroBatch]) -> list[Prepared]:
        """The step's micro-batches laid out once, for the proximal pass and every epoch."""
        return lay_out(micro_batches, self.device, packed=self.packed)

    def forward(self, model: torch.nn.Module, micro_batch: Prepared, *,
                router_aux: bool = False) -> ForwardPass:
        """``model`` (the DDP-wrapped one, or the bare module for a no-grad pass) over
        one non-empty micro-batch, in its layout; ``router_aux``: with the model's
        router load-balancing loss (packed layout only: trainer.router_aux_coef needs
        it). Every micro-batch's loss and proximal pass runs it, so a subclass that
        replaces it changes how each is computed (``bench/trainer/trainer_step.py`` runs an
        earlier trainer's forward through it)."""
        batch = micro_batch.packed
        if batch is not None:
            aux = None
            if router_aux:
                logprobs, entropy, aux = packed_forward_router_aux(
                    model, self.module, batch, self.temperature)
            else:
                logprobs, entropy = packed_forward(model, self.module, batch,
                                                   self.temperature)
            return ForwardPass(logprobs=logprobs, entropy=entropy,
                               behaviour=batch.behaviour_logprobs,
                               advantages=batch.advantages, positions=batch.num_tokens,
                               router_aux=aux)
        sequences = micro_batch.sequences
        logits, targets, positions = padded_logits(model, sequences, self.device)
        behaviour = torch.from_numpy(
            np.concatenate([s.behaviour_logprobs for s in sequences]).astype(np.float32))
        advantages = torch.repeat_interleave(
            torch.tensor([s.advantage for s in sequences], dtype=torch.float32),
            torch.tensor([len(s.completion_token_ids) for s in sequences]))
        keep = trained_positions(sequences)
        if keep is not None:
            behaviour, advantages = behaviour[keep], advantages[keep]
        return ForwardPass(logprobs=completion_logprobs(logits, targets, self.temperature),
                           entropy=token_entropy(logits, self.temperature),
                           behaviour=behaviour.to(self.device),
                           advantages=advantages.to(self.device), positions=positions)

    def _pad_logits(self, model: torch.nn.Module) -> torch.Tensor:
        """The model run on one dummy position (a pad's forward)."""
        dummy = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        logits: torch.Tensor = model(input_ids=dummy, use_cache=False).logits
        return logits

    def needs_proximal(self, updates: int) -> bool:
        """Whether a step of ``updates`` optimizer updates (each epoch's) needs the
        proximal pass: in the decoupled form (tis_cap > 0), with more than one update
        (the policy moves within the step) or with dropout (the gradient pass's logprobs
        carry its mask). Otherwise the current policy, detached, is the proximal one."""
        return self.config.tis_cap > 0 and (updates * self.config.epochs > 1 or self.dropout)

    def proximal(self, micro_batches: Sequence[Prepared]) -> list[torch.Tensor | None]:
        """The step-start policy's logprobs of each micro-batch (None for a pad), without
        gradient and without dropout: call before the step's first update."""
        out: list[torch.Tensor | None] = []
        with torch.no_grad(), self.autocast(), without_dropout(self.module):
            for micro_batch in micro_batches:
                if not micro_batch.sequences:
                    if self.sharded:
                        self._pad_logits(self.module)
                    out.append(None)
                    continue
                out.append(self.forward(self.module, micro_batch).logprobs)
        return out

    def micro_batch(self, micro_batch: Prepared, norm: Normaliser,
                    proximal: torch.Tensor | None = None,
                    reference: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, PendingStats | None, int]:
        """Forward pass over one micro-batch: (loss, statistics on the device, positions
        computed).

        ``proximal``: its logprobs from ``proximal``; None when the update is the step's
        only one (then the proximal policy is the current one, detached: same value, no
        extra forward). ``reference``: the reference policy's logprobs of its tokens
        (``workers.trainer.shard_roles``): the KL to it is measured, and with trainer.kl_coef
        > 0 and not trainer.kl_in_reward, kl_coef times it (aggregated as the loss is)
        is added to the loss. With trainer.router_aux_coef > 0, coef times the model's
        router load-balancing loss, weighted by the micro-batch's share of the update's
        trained tokens, is added too. An empty micro-batch is a zero-loss pad (no
        statistics; its one dummy position is not counted).
        """
        if not micro_batch.sequences:
            # A pad still runs the model so DDP's gradient hooks fire on every shard.
            return self._pad_logits(self.model).sum() * 0.0, None, 0
        coef = self.config.router_aux_coef
        with self.autocast():
            run = self.forward(self.model, micro_batch, router_aux=coef > 0)
        loss, stats = token_loss(
            run.logprobs, run.behaviour, run.advantages, lengths=micro_batch.lengths,
            norm=norm, config=self.config, proximal_logprobs=proximal, entropy=run.entropy,
            router_aux=run.router_aux,
        )
        if run.router_aux is not None:
            share = run.logprobs.numel() / max(norm.tokens, 1)
            loss = loss + coef * share * run.router_aux
        if reference is not None and run.logprobs.numel():
            kl = kl_estimate(run.logprobs, reference, self.config.kl_estimator)
            if self.config.kl_coef > 0 and not self.config.kl_in_reward:
                loss = loss + self.config.kl_coef * norm.aggregate(kl, micro_batch.lengths)
            self.kl_parts.append(torch.stack([kl.detach().sum(), kl.detach().amax()]))
        return loss, stats, run.positions

    def read_kl(self) -> tuple[float, float]:
        """(sum, max) of the KL to the reference over the micro-batches since the last
        call, in one host read; (0, 0) without any."""
        parts, self.kl_parts = self.kl_parts, []
        if not parts:
            return 0.0, 0.0
        values = torch.stack(parts).double()
        total, largest = torch.stack([values[:, 0].sum(), values[:, 1].amax()]).tolist()
        return total, largest
