"""The policy's model on one trainer shard, as training needs it.

Owns: ``load_policy``: the model loaded in its dtype, whole (ddp) or sharded (fsdp2),
with LoRA adapters injected and drawn from the seed when model.lora is on, in train
mode, with packed attention and ``trainer.compile`` applied. Knows nothing about the
optimizer, the loss or weight broadcasts.
"""

from __future__ import annotations

import torch

from workers.model_config import ModelConfig
from workers.trainer.attention import use_packed_attention
from workers.trainer.config import TrainerConfig
from workers.trainer.device_setup import speed_up
from workers.trainer.fsdp import build_sharded
from workers.trainer.lora import LoraPolicy, attach, init_adapters

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""model.dtype's names, as torch dtypes."""


def load_policy(model: ModelConfig, trainer: TrainerConfig, device: torch.device, seed: int
                ) -> tuple[torch.nn.Module, LoraPolicy | None, int]:
    """The model (with fsdp2, sharded: every forward is then a collective), its LoRA
    policy (None without LoRA) and how many decoder layers ``trainer.compile``
    compiled."""
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[model.dtype]
    lora = model.lora
    module: torch.nn.Module
    if trainer.backend == "fsdp2":
        module = build_sharded(model.path, dtype=dtype, device=device, trainer=trainer,
                               lora=lora)
    else:
        module = AutoModelForCausalLM.from_pretrained(model.path, dtype=dtype)
        if lora.enabled:
            attach(module, lora, model.path)
        module.to(device)  # type: ignore[arg-type]
    policy = None
    if lora.enabled:
        init_adapters(module, model.path, seed)
        policy = LoraPolicy(lora, model.path)
    module.train()
    if trainer.packed:
        use_packed_attention(module)
    return module, policy, speed_up(module, trainer, device)
