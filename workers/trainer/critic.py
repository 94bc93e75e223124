"""The critic: a value model beside one trainer shard, trained with PPO's clipped value loss.

Owns: the value model (``ValueModel``: the policy's architecture, its decoder with a
scalar head on the final hidden state, zero-initialised so every value starts at 0),
its optimizer and data-parallel form (``Critic``: as the policy's trainer.backend, a DDP
replica, or an FSDP2 shard built, sharded and loaded by ``workers.trainer.fsdp``'s
``build_sharded``), its values of a step's packed micro-batches (one no-grad forward
each, at the position that predicts each trained token: the value of the state the
policy chose that token in), its updates (``Critic.update``: per token ``0.5 *
max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``, token-mean over the update's
tokens on every shard, as the policy's loss divides), and its state in a checkpoint
(ddp: ``CRITIC_STATE``, one replica's; fsdp2: ``CRITIC_SHARDED``, each shard's slices
through ``torch.distributed.checkpoint``). Knows nothing about GAE, Ray, queues or
versions: the returns it fits come from ``workers.trainer.shard_roles``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel

from buffers.common.reports import CriticStepResult
from workers.trainer.attention import attention_kwargs, use_packed_attention
from workers.trainer.checkpoint_folder import load_sharded, sharded_state
from workers.trainer.config import TrainerConfig
from workers.trainer.fsdp import build_sharded, clip_grad_norm
from workers.trainer.packing import PackedBatch
from workers.trainer.ppo_update import Prepared, without_dropout
from workers.trainer.roles_config import CriticConfig

log = logging.getLogger(__name__)

CRITIC_STATE = "critic.pt"
"""ddp: the critic's weights and optimizer state in a checkpoint's trainer folder."""
CRITIC_SHARDED = "critic_sharded"
"""fsdp2: the ``torch.distributed.checkpoint`` folder of the critic's model and optimizer
shards, in a checkpoint's trainer folder."""


class ValueModel(torch.nn.Module):
    """A decoder and a scalar head: one value per position asked for."""

    def __init__(self, decoder: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.decoder = decoder
        self.head = torch.nn.Linear(hidden_size, 1)
        self.zero_head()

    def zero_head(self) -> None:
        """Every value 0 until the critic learns (a sharded head: each shard its slice)."""
        with torch.no_grad():
            self.head.weight.zero_()
            self.head.bias.zero_()

    def forward(self, batch: PackedBatch | None, device: torch.device) -> torch.Tensor:
        """float32 ``(N,)``: the value at each position that predicts a trained token;
        None (a pad micro-batch): the model on one dummy position on ``device`` (the
        shard's: with FSDP2's offload the weights live in CPU memory), times 0, so
        DDP's gradient hooks fire and FSDP2's collectives run on every shard."""
        if batch is None:
            dummy = torch.zeros((1, 1), dtype=torch.long, device=device)
            out = self.decoder(input_ids=dummy, use_cache=False).last_hidden_state
            return self.head(out[0]).sum().float() * 0.0
        out = self.decoder(input_ids=batch.input_ids, position_ids=batch.position_ids,
                           use_cache=False,
                           **attention_kwargs(batch.cu_seqlens, batch.max_len, batch.lengths))
        hidden = out.last_hidden_state[0].index_select(0, batch.predict_at)
        # A copy, not a view: FSDP2's backward hook on a view output is fragile.
        return self.head(hidden).squeeze(-1).to(torch.float32, copy=True)


def _value_loss(values: torch.Tensor, old: torch.Tensor, returns: torch.Tensor,
                clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: the clipped value loss, and where the clipped term is the larger."""
    unclipped = (values - returns).square()
    if clip <= 0:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped = (old + (values - old).clamp(-clip, clip) - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def _value_model(causal: Any) -> ValueModel:
    """The value model around a causal LM's decoder (its LM head is left out)."""
    use_packed_attention(causal)
    return ValueModel(causal.get_decoder(), causal.config.hidden_size)


class Critic:
    """One shard's value model: the whole model (a DDP replica when there are several)
    or, with trainer.backend = "fsdp2", its FSDP2 shard (every forward a collective)."""

    def __init__(self, config: CriticConfig, *, trainer: TrainerConfig, dtype: torch.dtype,
                 device: torch.device, world_size: int, rank: int) -> None:
        from transformers import AutoModelForCausalLM

        self.config = config
        self.device = device
        self.world_size = world_size
        self.rank = rank
        self.sharded = trainer.backend == "fsdp2"
        self.module: ValueModel
        if self.sharded:
            self.module = build_sharded(  # type: ignore[assignment]
                config.path, dtype=dtype, device=device, trainer=trainer, wrap=_value_model)
            self.module.zero_head()  # the head is the wrapper's own: not in the files
        else:
            self.module = _value_model(AutoModelForCausalLM.from_pretrained(config.path,
                                                                            dtype=dtype))
            self.module.to(device=device, dtype=dtype)
        self.module.train()
        self.model: torch.nn.Module = (DistributedDataParallel(self.module)
                                       if world_size > 1 and not self.sharded
                                       else self.module)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=config.lr,
                                           fused=device.type in ("cpu", "cuda"))
        self._checkpoint_group: Any = (
            # DCP's plan exchange sends Python objects (gloo), beside the policy's writes.
            dist.new_group(backend="gloo") if self.sharded else None)

    def values(self, micro_batches: Sequence[Prepared]) -> list[torch.Tensor | None]:
        """The current weights' value of each micro-batch's trained tokens (None for a
        pad), without gradient or dropout: the bare model, so DDP issues no collective
        (FSDP2's forwards are collectives: a pad runs the dummy forward on every shard)."""
        out: list[torch.Tensor | None] = []
        with torch.no_grad(), without_dropout(self.module):
            for mb in micro_batches:
                if mb.packed is not None:
                    out.append(self.module(mb.packed, self.device))
                    continue
                if self.sharded:
                    self.module(None, self.device)
                out.append(None)
        return out

    def update(self, step: int, updates: Sequence[Sequence[Prepared]],
               old_values: Sequence[Sequence[torch.Tensor | None]],
               returns: Sequence[Sequence[torch.Tensor | None]],
               update_tokens: Sequence[int]) -> CriticStepResult:
        """One optimizer update per entry of ``updates`` (the policy's cut of the step),
        each over its micro-batches; ``update_tokens``: each update's trained tokens over
        every shard (the loss divides by them, so the DDP all-reduce is a plain sum)."""
        began = time.perf_counter()
        # Kept on the device and read once, after the last update; the token count is
        # known on the host.
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)
        count = 0
        norms: list[float] = []
        for micro_batches, olds, targets, tokens in zip(updates, old_values, returns,
                                                        update_tokens, strict=True):
            self.optimizer.zero_grad(set_to_none=True)
            last = len(micro_batches) - 1
            for index, (mb, old, target) in enumerate(zip(micro_batches, olds, targets,
                                                          strict=True)):
                loss, counted = self._micro_batch_loss(mb, old, target, tokens, sums)
                count += counted
                if index != last and isinstance(self.model, DistributedDataParallel):
                    with self.model.no_sync():
                        loss.backward()
                else:
                    if self.sharded:  # reduce-scatter at the last only
                        self.module.set_requires_gradient_sync(  # type: ignore[operator]
                            index == last)
                    loss.backward()
            norm = clip_grad_norm(self.module.parameters(), self.config.max_grad_norm)
            norms.append(norm)
            if math.isfinite(norm):
                self.optimizer.step()
            else:
                self.optimizer.zero_grad(set_to_none=True)
        loss_sum, clipped, value_sum, return_sum = sums.tolist()
        return CriticStepResult(rank=self.rank, step=step, tokens=count,
                                value_loss_sum=loss_sum, clipped=round(clipped),
                                value_sum=value_sum, return_sum=return_sum,
                                grad_norm=max(norms, default=0.0,
                                              key=lambda n: n if math.isfinite(n) else math.inf),
                                seconds=time.perf_counter() - began)

    def _micro_batch_loss(self, micro_batch: Prepared, old: torch.Tensor | None,
                          target: torch.Tensor | None, tokens: int,
                          sums: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(loss, tokens it counts); adds its loss, clipped tokens, old values and
        returns to ``sums``, on the device."""
        values = self.model(micro_batch.packed, self.device)
        if micro_batch.packed is None or old is None or target is None:
            return values, 0  # a pad: zero loss, gradient hooks fired
        per_token, clipped = _value_loss(values, old, target, self.config.value_clip)
        with torch.no_grad():
            sums += torch.stack([per_token.sum().double(), clipped.sum().double(),
                                 old.sum().double(), target.sum().double()])
        # DDP averages gradients over shards; the loss is a share of the global count.
        return per_token.sum() / max(tokens, 1) * self.world_size, per_token.numel()

    # ---- checkpoints ---------------------------------------------------------------------

    def save(self, folder: str) -> None:
        """Writes the weights and optimizer state into a checkpoint's trainer folder
        (fsdp2: collective, every shard writes its slices)."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        if self.sharded:
            dcp.save(sharded_state(self.module, self.optimizer),
                     checkpoint_id=out / CRITIC_SHARDED, process_group=self._checkpoint_group)
            return
        state: dict[str, Any] = {"model": self.module.state_dict(),
                                 "optimizer": self.optimizer.state_dict()}
        torch.save(state, out / CRITIC_STATE)

    def load(self, folder: str) -> None:
        """Restores what ``save`` wrote (ddp: every shard reads the same replica's copy;
        fsdp2: each its slices); a checkpoint of a run without a critic has none: the
        critic then starts afresh."""
        path = Path(folder) / (CRITIC_SHARDED if self.sharded else CRITIC_STATE)
        if not path.exists():
            log.warning("%s: no critic state in the checkpoint (a run without a critic "
                        "wrote it): the critic starts from its initial weights", path)
            return
        if self.sharded:
            load_sharded(path, module=self.module, optimizer=self.optimizer)
            return
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
