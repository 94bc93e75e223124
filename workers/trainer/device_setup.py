"""What a trainer-side process switches on for its device before training: TF32, compiled layers.

Owns: ``use_tf32``: TF32 matmuls for float32 compute on CUDA (10-bit mantissa products,
float32 accumulation: what every recipe training in float32 on Ampere or later uses),
switched on for the whole process, which runs nothing but the trainer's compute (a
shard's policy, and the critic and reference beside it, or a reference or critic on a
worker of its own); and, in ``speed_up`` with it, ``trainer.compile``:
``torch.compile`` on each decoder layer's ``forward`` (dynamic shapes, so micro-batches
of any length share one graph; the attention's ``max_len`` arrives rounded up to a power
of two, ``workers.trainer.attention.round_up_pow2``), by default only where the packed
attention is one varlen kernel call per layer (``compiles``). Compiling the layers'
``forward`` (not the modules) keeps their state-dict names and leaves FSDP2's and DDP's
hooks outside the compiled code. Knows nothing about the loss.
"""

from __future__ import annotations

import logging

import torch

from workers.trainer.attention import varlen_kernel
from workers.trainer.config import TrainerConfig

log = logging.getLogger(__name__)


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules of the classes its Hugging Face class
    names in ``_no_split_modules``, matched anywhere in their class's MRO, since
    ``fully_shard`` gives each layer it shards a subclass of its own
    (``FSDPQwen2DecoderLayer``)."""
    wanted = set(getattr(module, "_no_split_modules", None) or ())
    return [m for m in module.modules()
            if any(cls.__name__ in wanted for cls in type(m).__mro__)]


def attention_dtype(module: torch.nn.Module, config: TrainerConfig) -> torch.dtype:
    """The dtype the layers' attention computes in: autocast's with
    ``trainer.compute_dtype = "bfloat16"``, else FSDP2's ``param_dtype`` where it casts
    the gathered weights, else the weights' own."""
    if config.compute_dtype == "bfloat16":
        return torch.bfloat16
    if config.backend == "fsdp2" and config.param_dtype != "model":
        cast: torch.dtype = getattr(torch, config.param_dtype)  # "float32" or "bfloat16"
        return cast
    return next(module.parameters()).dtype


def compiles(config: TrainerConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """``trainer.compile``, its default resolved for attention in ``dtype`` on
    ``device``: on only where the packed attention is one varlen kernel call per layer
    (CUDA in bf16 or fp16). Elsewhere the layer's attention is the per-sequence loop
    (the CPU, float32 on CUDA), which dynamo would unroll into one SDPA call per
    sequence and compile again for every new sequence count; on the CPU compiling also
    costs minutes for little (the step is matmul-bound). The padded layout
    (``trainer.packed = false``, a reference for comparisons) is never compiled by
    default."""
    if config.compile != "auto":
        return bool(config.compile)
    return config.packed and varlen_kernel(device, dtype) is not None


def use_tf32(config: TrainerConfig, device: torch.device) -> None:
    """TF32 matmuls for the whole process where ``trainer.compute_dtype`` is float32 on
    CUDA: on purpose, since a trainer-side process (a shard's, or a reference's or
    critic's of its own) runs nothing but that compute, and all of it alike."""
    if device.type == "cuda" and config.compute_dtype == "float32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def speed_up(module: torch.nn.Module, config: TrainerConfig, device: torch.device) -> int:
    """Switches on TF32 (``use_tf32``) and compiles the decoder layers where
    ``trainer.compile`` says so; returns the layers compiled."""
    use_tf32(config, device)
    if not compiles(config, device, attention_dtype(module, config)):
        return 0
    layers = decoder_layers(module)
    for layer in layers:
        # An instance attribute shadows the class's forward; _call_impl (hooks) stays eager.
        layer.forward = torch.compile(layer.forward, dynamic=True)
    log.info("compiling %d decoder layers (trainer.compile): the first step pays for it",
             len(layers))
    return len(layers)
