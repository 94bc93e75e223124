"""The critic: a value model beside one trainer shard, trained with PPO's clipped value loss.

Owns: the value model (``ValueModel``: the policy's architecture, its decoder with a
scalar head on the final hidden state, zero-initialised so every value starts at 0),
its optimizer and DDP replica (``Critic``), its values of a step's packed micro-batches
(one no-grad forward each, at the position that predicts each trained token: the value
of the state the policy chose that token in), its updates (``Critic.update``: per
token ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``, token-mean over
the update's tokens on every shard, as the policy's loss divides), and its state in a
checkpoint (``CRITIC_STATE``). Knows nothing about GAE, Ray, queues or versions: the
returns it fits come from ``workers.trainer.roles``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from buffers.reports import CriticStepResult
from workers.trainer.attention import attention_kwargs, use_packed_attention
from workers.trainer.packing import PackedBatch
from workers.trainer.ppo_update import Prepared
from workers.trainer.roles_config import CriticConfig

log = logging.getLogger(__name__)

CRITIC_STATE = "critic.pt"
"""The critic's weights and optimizer state in a checkpoint's trainer folder."""


class ValueModel(torch.nn.Module):
    """A decoder and a scalar head: one value per position asked for."""

    def __init__(self, decoder: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.decoder = decoder
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, batch: PackedBatch | None) -> torch.Tensor:
        """float32 ``(N,)``: the value at each position that predicts a trained token;
        None (a pad micro-batch): the model on one dummy position, times 0, so DDP's
        gradient hooks fire on every shard."""
        if batch is None:
            device = self.head.weight.device
            dummy = torch.zeros((1, 1), dtype=torch.long, device=device)
            out = self.decoder(input_ids=dummy, use_cache=False).last_hidden_state
            return self.head(out[0]).sum().float() * 0.0
        out = self.decoder(input_ids=batch.input_ids, position_ids=batch.position_ids,
                           use_cache=False,
                           **attention_kwargs(batch.cu_seqlens, batch.max_len, batch.lengths))
        hidden = out.last_hidden_state[0].index_select(0, batch.predict_at)
        return self.head(hidden).squeeze(-1).float()


def _value_loss(values: torch.Tensor, old: torch.Tensor, returns: torch.Tensor,
                clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: the clipped value loss, and where the clipped term is the larger."""
    unclipped = (values - returns).square()
    if clip <= 0:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped = (old + (values - old).clamp(-clip, clip) - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


class Critic:
    """One shard's value model (a DDP replica when there are several)."""

    def __init__(self, config: CriticConfig, *, dtype: torch.dtype, device: torch.device,
                 world_size: int, rank: int) -> None:
        from transformers import AutoModelForCausalLM

        self.config = config
        self.device = device
        self.world_size = world_size
        self.rank = rank
        causal = AutoModelForCausalLM.from_pretrained(config.path, dtype=dtype)
        use_packed_attention(causal)
        self.module = ValueModel(causal.get_decoder(), causal.config.hidden_size)
        self.module.to(device=device, dtype=dtype)
        self.module.train()
        self.model: torch.nn.Module = (DistributedDataParallel(self.module)
                                       if world_size > 1 else self.module)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=config.lr,
                                           fused=device.type in ("cpu", "cuda"))

    def values(self, micro_batches: Sequence[Prepared]) -> list[torch.Tensor | None]:
        """The current weights' value of each micro-batch's trained tokens (None for a
        pad), without gradient: the bare model, so no collective is issued."""
        with torch.no_grad():
            return [None if mb.packed is None else self.module(mb.packed)
                    for mb in micro_batches]

    def update(self, step: int, updates: Sequence[Sequence[Prepared]],
               old_values: Sequence[Sequence[torch.Tensor | None]],
               returns: Sequence[Sequence[torch.Tensor | None]],
               update_tokens: Sequence[int]) -> CriticStepResult:
        """One optimizer update per entry of ``updates`` (the policy's cut of the step),
        each over its micro-batches; ``update_tokens``: each update's trained tokens over
        every shard (the loss divides by them, so the DDP all-reduce is a plain sum)."""
        began = time.perf_counter()
        sums = torch.zeros(5, dtype=torch.float64, device=self.device)
        norms: list[float] = []
        for micro_batches, olds, targets, tokens in zip(updates, old_values, returns,
                                                        update_tokens, strict=True):
            self.optimizer.zero_grad(set_to_none=True)
            last = len(micro_batches) - 1
            for index, (mb, old, target) in enumerate(zip(micro_batches, olds, targets,
                                                          strict=True)):
                loss = self._micro_batch_loss(mb, old, target, tokens, sums)
                if index != last and isinstance(self.model, DistributedDataParallel):
                    with self.model.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            total = torch.nn.utils.clip_grad_norm_(self.module.parameters(),
                                                   self.config.max_grad_norm)
            norm = float(total)
            norms.append(norm)
            if math.isfinite(norm):
                self.optimizer.step()
            else:
                self.optimizer.zero_grad(set_to_none=True)
        count, loss_sum, clipped, value_sum, return_sum = sums.tolist()
        return CriticStepResult(rank=self.rank, step=step, tokens=round(count),
                                value_loss_sum=loss_sum, clipped=round(clipped),
                                value_sum=value_sum, return_sum=return_sum,
                                grad_norm=max(norms, default=0.0,
                                              key=lambda n: n if math.isfinite(n) else math.inf),
                                seconds=time.perf_counter() - began)

    def _micro_batch_loss(self, micro_batch: Prepared, old: torch.Tensor | None,
                          target: torch.Tensor | None, tokens: int,
                          sums: torch.Tensor) -> torch.Tensor:
        values = self.model(micro_batch.packed)
        if micro_batch.packed is None or old is None or target is None:
            return values  # a pad: zero loss, gradient hooks fired
        per_token, clipped = _value_loss(values, old, target, self.config.value_clip)
        with torch.no_grad():
            sums += torch.stack([per_token.new_tensor(float(per_token.numel())),
                                 per_token.sum(), clipped.sum(), old.sum(),
                                 target.sum()]).double()
        # DDP averages gradients over shards; the loss is a share of the global count.
        return per_token.sum() / max(tokens, 1) * self.world_size

    # ---- checkpoints ---------------------------------------------------------------------

    def save(self, folder: str) -> None:
        """Writes the weights and optimizer state into a checkpoint's trainer folder."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {"model": self.module.state_dict(),
                                 "optimizer": self.optimizer.state_dict()}
        torch.save(state, out / CRITIC_STATE)

    def load(self, folder: str) -> None:
        """Restores what ``save`` wrote (every shard reads the same replica's copy); a
        checkpoint of a run without a critic has none: the critic then starts afresh."""
        path = Path(folder) / CRITIC_STATE
        if not path.is_file():
            log.warning("%s: no critic state in the checkpoint (a run without a critic "
                        "wrote it): the critic starts from its initial weights", path)
            return
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
