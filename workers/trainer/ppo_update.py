"""The losses of one trainer shard's step: normalisers, proximal logprobs, micro-batch losses.

Owns: what every optimizer update of a step divides its loss by (the per-update token
and sequence counts of all shards, agreed in one all-reduce: ``StepLoss.agree``), the
proximal logprobs (one no-grad forward over the step's micro-batches before any update,
only when the step makes more than one update: ``StepLoss.proximal``), and each
micro-batch's forward pass and loss (``StepLoss.micro_batch``), all over trained tokens
only (loss mask 1: an observation's tokens are context, never counted or trained).
Knows nothing about the optimizer, DDP's gradient sync, spans or cores:
``workers.trainer.shard`` runs the updates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from buffers.records import LossStats, TrainSequence
from workers.trainer.config import TrainerConfig
from workers.trainer.loss import Normaliser, token_loss
from workers.trainer.packing import (
    completion_logprobs,
    pack,
    packed_logits,
    padded_logits,
    token_entropy,
    trained_positions,
)

MicroBatch = tuple[TrainSequence, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Forward:
    """One micro-batch's forward pass, one row per completion token."""

    logits: torch.Tensor
    targets: torch.Tensor
    behaviour: torch.Tensor
    advantages: torch.Tensor
    positions: int
    """Positions the model computed (padding included)."""


def _lengths(sequences: Sequence[TrainSequence]) -> list[int]:
    """Trained completion tokens per sequence (loss mask 1): what every count, the
    normaliser's and seq_mean's, counts."""
    return [s.trained_tokens for s in sequences]


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

    def agree(self, updates: Sequence[Sequence[MicroBatch]], lost: bool
              ) -> tuple[list[Normaliser], bool]:
        """Each update's normaliser from every shard's counts, and whether any shard
        lost its groups.

        One all-reduce carries every update's tokens and sequences and the lost flag, so
        a shard that could not fetch its groups makes every shard skip the step together
        rather than leave the others waiting in the gradient all-reduce. The tensor lives
        on the group's device: NCCL takes only CUDA tensors.
        """
        counts = [int(lost)]
        for micro_batches in updates:
            counts += [sum(sum(_lengths(mb)) for mb in micro_batches),
                       sum(len(mb) for mb in micro_batches)]
        if self.world_size > 1:
            summed = torch.tensor(counts, dtype=torch.long, device=self.device)
            dist.all_reduce(summed)
            counts = [int(c) for c in summed.tolist()]
        norms = [Normaliser(agg=self.config.loss_agg, tokens=int(tokens),
                            sequences=int(sequences),
                            max_response_tokens=self.max_response_tokens)
                 for tokens, sequences in zip(counts[1::2], counts[2::2], strict=True)]
        return norms, bool(counts[0])

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.config.compute_dtype == "bfloat16")

    def _forward(self, model: torch.nn.Module, sequences: MicroBatch) -> _Forward:
        if self.packed:
            batch = pack(sequences, self.device)
            return _Forward(logits=packed_logits(model, batch), targets=batch.targets,
                            behaviour=batch.behaviour_logprobs, advantages=batch.advantages,
                            positions=batch.num_tokens)
        logits, targets, positions = padded_logits(model, sequences, self.device)
        behaviour = torch.from_numpy(
            np.concatenate([s.behaviour_logprobs for s in sequences]).astype(np.float32))
        advantages = torch.repeat_interleave(
            torch.tensor([s.advantage for s in sequences], dtype=torch.float32),
            torch.tensor([len(s.completion_token_ids) for s in sequences]))
        keep = trained_positions(sequences)
        if keep is not None:
            behaviour, advantages = behaviour[keep], advantages[keep]
        return _Forward(logits=logits, targets=targets, behaviour=behaviour.to(self.device),
                        advantages=advantages.to(self.device), positions=positions)

    def _pad_logits(self, model: torch.nn.Module) -> torch.Tensor:
        """The model run on one dummy position (a pad's forward)."""
        dummy = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        logits: torch.Tensor = model(input_ids=dummy, use_cache=False).logits
        return logits

    def proximal(self, micro_batches: Sequence[MicroBatch]) -> list[torch.Tensor | None]:
        """The step-start policy's logprobs of each micro-batch (None for a pad), without
        gradient: call before the step's first update."""
        out: list[torch.Tensor | None] = []
        with torch.no_grad(), self._autocast():
            for sequences in micro_batches:
                if not sequences:
                    if self.sharded:
                        self._pad_logits(self.module)
                    out.append(None)
                    continue
                run = self._forward(self.module, sequences)
                out.append(completion_logprobs(run.logits, run.targets, self.temperature))
        return out

    def micro_batch(self, sequences: MicroBatch, norm: Normaliser,
                    proximal: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, LossStats, int]:
        """Forward pass over one micro-batch: (loss, statistics, positions computed).

        ``proximal``: its logprobs from ``proximal``; None when the update is the step's
        only one (then the proximal policy is the current one, detached: same value, no
        extra forward). An empty micro-batch is a zero-loss pad (its one dummy position
        is not counted).
        """
        if not sequences:
            # A pad still runs the model so DDP's gradient hooks fire on every shard.
            return self._pad_logits(self.model).sum() * 0.0, LossStats(), 0
        with self._autocast():
            run = self._forward(self.model, sequences)
            logprobs = completion_logprobs(run.logits, run.targets, self.temperature)
        loss, stats = token_loss(
            logprobs, run.behaviour, run.advantages, lengths=_lengths(sequences), norm=norm,
            config=self.config, proximal_logprobs=proximal,
            entropy=token_entropy(run.logits, self.temperature),
        )
        return loss, stats, run.positions
