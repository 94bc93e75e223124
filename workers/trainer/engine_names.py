"""A policy's parameters under the names and layout vLLM loads them in: its checkpoint's.

Owns: ``engine_weights`` and ``engine_shapes``, what a weight version carries. transformers
5 holds some families' weights in memory otherwise than their checkpoint does and
converts them back only when it saves: the experts of Qwen3-MoE, Mixtral, OLMoE,
GraniteMoE, Qwen3-Next and Qwen3.5-MoE are fused into one 3-D tensor per projection (and
Mixtral's ``block_sparse_moe`` is renamed ``mlp``). vLLM's loader reads the checkpoint's
names, at start and at every version: sent as they are in memory, a Mixtral version
fails ("no module or parameter named 'layers.0.mlp'"). Each parameter is converted on
its own with transformers' ``revert_weight_conversion`` (what ``save_pretrained`` runs),
so a gather can convert bucket by bucket; ``engine_shapes`` checks once per model that
this gives what converting them all together gives. A model without conversions passes
through unchanged. Knows nothing about sending.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from transformers import PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion


def _revert(module: torch.nn.Module, name: str, tensor: torch.Tensor
            ) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(module, PreTrainedModel):  # not a transformers model: as it is
        return [(name, tensor)]
    return list(revert_weight_conversion(module, {name: tensor}).items())


def engine_weights(module: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` (``module``'s parameters in ``named_parameters`` order, possibly a lazy
    gather) as the checkpoint names them, parameter by parameter: ``engine_shapes``."""
    for name, tensor in named:
        yield from _revert(module, name, tensor.detach())


def engine_shapes(module: torch.nn.Module) -> list[tuple[str, torch.Size, torch.dtype]]:
    """(name, shape, dtype) of what ``engine_weights`` yields for every parameter of
    ``module`` in ``named_parameters`` order (computed on the meta device: no copies).
    Raises ValueError when the model's conversion needs parameters together (then no
    bucket-by-bucket conversion is right)."""
    # (an fsdp2 shard's parameters are DTensors, whose shape is the whole one)
    meta = [(name, torch.empty(p.shape, dtype=p.dtype, device="meta"))
            for name, p in module.named_parameters()]
    one_by_one = [pair for name, t in meta for pair in _revert(module, name, t)]
    together = (revert_weight_conversion(module, dict(meta))
                if isinstance(module, PreTrainedModel) else dict(meta))
    if sorted(n for n, _ in one_by_one) != sorted(together):
        raise ValueError(f"{type(module).__name__}: its checkpoint's weights are not each "
                         "made from one parameter; versions cannot be sent as vLLM loads "
                         "them")
    return [(name, t.shape, t.dtype) for name, t in one_by_one]
