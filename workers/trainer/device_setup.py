"""What a trainer shard switches on for its device before training: TF32 and compiled layers.

Owns: ``speed_up``: TF32 matmuls for float32 compute on CUDA (10-bit mantissa products,
float32 accumulation: what every recipe training in float32 on Ampere or later uses),
and ``trainer.compile``: ``torch.compile`` on each decoder layer's ``forward`` (dynamic
shapes, so micro-batches of any length share one graph; the attention's ``max_len``
arrives rounded up to a power of two, ``workers.trainer.attention.round_up_pow2``).
Compiling the layers' ``forward`` (not the modules) keeps their state-dict names and
leaves FSDP2's and DDP's hooks outside the compiled code. Knows nothing about the loss.
"""

from __future__ import annotations

import logging

import torch

from workers.trainer.config import TrainerConfig

log = logging.getLogger(__name__)


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the classes its Hugging Face class names in
    ``_no_split_modules``."""
    wanted = set(getattr(module, "_no_split_modules", None) or ())
    return [m for m in module.modules() if type(m).__name__ in wanted]


def compiles(config: TrainerConfig, device: torch.device) -> bool:
    """``trainer.compile``, its default resolved: on for CUDA, off for the CPU (compiling
    there costs minutes per run for little: the CPU step is matmul-bound)."""
    return device.type == "cuda" if config.compile == "auto" else bool(config.compile)


def speed_up(module: torch.nn.Module, config: TrainerConfig, device: torch.device) -> int:
    """Switches on TF32 (float32 compute on CUDA) and compiles the decoder layers where
    ``trainer.compile`` says so; returns the layers compiled."""
    if device.type == "cuda" and config.compute_dtype == "float32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if not compiles(config, device):
        return 0
    layers = decoder_layers(module)
    for layer in layers:
        # An instance attribute shadows the class's forward; _call_impl (hooks) stays eager.
        layer.forward = torch.compile(layer.forward, dynamic=True)
    log.info("compiling %d decoder layers (trainer.compile): the first step pays for it",
             len(layers))
    return len(layers)
