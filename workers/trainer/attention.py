"""Attention inside a packed row: each sequence attends to itself only, from offsets the
host already knows.

Owns: the transformers attention function the trainer registers (``packed_attention``,
``use_packed_attention``) and the kernel it runs per device and dtype (``varlen_kernel``,
named by ``kernel_name``; ``per_sequence_attention`` where there is none).
``workers.trainer.packing.pack`` computes a micro-batch's offsets once, on the host; the
forward passes them as keyword arguments (``attention_kwargs``), which transformers hands
unchanged to every layer's attention call. Nothing here reads a device value on the
host, so the CPU can queue a whole micro-batch ahead of a GPU.

- CPU, and float32 compute on CUDA: causal SDPA on each sequence's slice, split on the
  host lengths (``HostLengths``), never inside a compiled graph (``_uncompiled_loop``)
  (on CPU nothing is faster: FlexAttention has no CPU backward here and the varlen flash
  kernel no CPU build). Flash kernels take no float32, so a float32 CUDA
  run keeps this loop (now without a sync per layer): use ``trainer.compute_dtype =
  "bfloat16"`` there (docs/fsdp.md).
- CUDA in bf16/fp16: one variable-length flash call per layer over the whole row:
  ``torch.nn.attention.varlen.varlen_attn`` where this torch's signature can express the
  call (causal: ``is_causal`` in older builds, ``window_size=(-1, 0)`` in newer;
  grouped-query heads need its ``enable_gqa``), else ``aten._flash_attention_forward``,
  which takes grouped-query heads natively and has its own backward.

Why not transformers' own masks: with packed ``position_ids`` and no attention mask it
builds a dense block-diagonal mask, so SDPA still computes (and masks away) every pair
of the row; registered under its own name with no mask function, this attention gets no
mask at all (``attention_mask`` is None).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

PACKED_ATTENTION = "async_rl_packed_sdpa"
"""Name under which ``packed_attention`` is registered with transformers."""

VarlenKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int,
                         float | None], torch.Tensor]
"""``(q, k, v, cu_seqlens, max_len, scale) -> out``: q ``(T, H, d)``, k and v
``(T, H_kv, d)``, ``cu_seqlens`` int32 ``(S + 1,)`` on the device; out ``(T, H, d)``."""


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                   max_len: int, scale: float | None) -> torch.Tensor:
    out: torch.Tensor = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)[0]
    return out


def _varlen_attn_call() -> Callable[..., torch.Tensor] | None:
    """torch's public varlen attention with this build's causal and GQA keywords bound;
    None where it is missing or cannot say causal."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        causal: dict[str, Any] = {"is_causal": True}
    elif "window_size" in params:
        causal = {"window_size": (-1, 0)}
    else:
        return None
    if "scale" not in params:
        return None
    takes_gqa = "enable_gqa" in params
    call_varlen: Callable[..., torch.Tensor] = varlen_attn  # type: ignore[assignment]

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
             max_len: int, scale: float | None) -> torch.Tensor:
        gqa = k.shape[1] != q.shape[1]
        if gqa and not takes_gqa:
            return _flash_forward(q, k, v, cu, max_len, scale)
        return call_varlen(q, k, v, cu, cu, max_len, max_len, scale=scale, **causal,
                           **({"enable_gqa": True} if gqa else {}))

    return call


TORCH_VARLEN = _varlen_attn_call()
"""Resolved once, at import: a compiled layer then reads a plain global (inspecting a
signature inside compiled code would break its graph)."""


def varlen_kernel(device: torch.device, dtype: torch.dtype) -> VarlenKernel | None:
    """The one-call-per-layer kernel for tensors of ``dtype`` on ``device``; None means
    the per-sequence loop (CPU, or float32)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    return TORCH_VARLEN or _flash_forward


def _varlen_takes_gqa() -> bool:
    """Whether this torch's ``varlen_attn`` has ``enable_gqa`` (torch 2.11's has not)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def kernel_name(kernel: VarlenKernel | None, *, gqa: bool = False) -> str:
    """What runs for ``varlen_kernel``'s pick, by name, for reports; ``gqa``: the model
    has fewer key/value heads than query heads, which torch's call hands to
    ``aten._flash_attention_forward`` where its ``varlen_attn`` cannot take them."""
    if kernel is None:
        return "per-sequence loop"
    if kernel is _flash_forward or (gqa and not _varlen_takes_gqa()):
        return "aten._flash_attention_forward"
    return "torch varlen_attn"


def round_up_pow2(n: int) -> int:
    """``max_len`` as the kernels get it: an upper bound is all flash needs, and a power
    of two gives a compiled layer a handful of distinct values, not one per micro-batch."""
    return 1 << max(n - 1, 0).bit_length()


def attention_kwargs(cu_seqlens: torch.Tensor, max_len: int,
                     lengths: tuple[int, ...]) -> dict[str, Any]:
    """What a packed forward passes the model so that every layer's attention gets the
    offsets: transformers' own names for the varlen offsets (``cu_seqlens`` on the
    device), plus the host lengths the per-sequence loop splits on."""
    bound = round_up_pow2(max_len)
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens,
            "max_length_q": bound, "max_length_k": bound,
            "packed_lengths": HostLengths(lengths)}


class HostLengths:
    """A packed row's sequence lengths on the host, for the per-sequence loop. A holder,
    not the tuple itself: a compiled layer guards on a tuple's length (one graph per
    sequence count) but on this only by its type, and only ``_uncompiled_loop``, outside
    the graph, reads it."""

    __slots__ = ("lengths",)

    def __init__(self, lengths: tuple[int, ...]) -> None:
        self.lengths = lengths


def _compute_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                   ) -> torch.dtype:
    """One dtype for q, k and v: autocast's where it is on (RoPE leaves q and k in
    float32 while v comes out of its projection in bf16), else their common one."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)


def per_sequence_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           lengths: tuple[int, ...] | list[int], dropout_p: float,
                           scaling: float | None) -> torch.Tensor:
    """Causal SDPA on each sequence's slice of a ``(1, H, T, d)`` row; ``(1, H, T, d)``.

    The per-sequence loop: what ``packed_attention`` runs where ``varlen_kernel`` has
    no kernel, and the reference a kernel is checked against (``bench/gpu_check.py``)."""
    gqa = key.shape[1] != query.shape[1]
    parts = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                       scale=scaling, enable_gqa=gqa)
        for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2),
                           value.split(lengths, 2), strict=True)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, 2)


@torch.compiler.disable
def _uncompiled_loop(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     lengths: HostLengths | None, dropout_p: float, scaling: float | None
                     ) -> torch.Tensor:
    """``per_sequence_attention`` over ``lengths`` (None: the row is one sequence) as
    ``(1, T, H, d)``, never compiled: traced, the loop would unroll into one SDPA call
    per sequence, and its layer compile again for every new sequence count."""
    split = lengths.lengths if lengths is not None else (query.shape[2],)
    out = per_sequence_attention(query, key, value, split, dropout_p, scaling)
    return out.transpose(1, 2).contiguous()


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    packed_lengths: HostLengths | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: causal attention within each packed sequence.

    ``query`` is ``(B, heads, T, d)``, ``key``/``value`` ``(B, kv_heads, T, d)``; the
    sequences are ``packed_lengths`` (host) and ``cu_seq_lens_q`` (device offsets,
    ``max_length_q`` their longest, rounded up), from ``attention_kwargs``, for one
    packed row (B = 1). Without them each row is one sequence (a right-padded batch:
    causal attention keeps real tokens from the pads after them). Returns
    ``(B, T, heads, d)``.
    """
    if sliding_window is not None:
        raise ValueError("packed attention takes no sliding window (Qwen2 here has none)")
    if key.shape[2] != query.shape[2]:
        raise ValueError("packed attention is for training: it takes no KV cache")
    dtype = _compute_dtype(query, key, value)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    dropout_p = dropout if module.training else 0.0
    kernel = varlen_kernel(query.device, dtype)
    if kernel is not None and cu_seq_lens_q is not None and max_length_q is not None \
            and dropout_p == 0.0 and query.shape[0] == 1:
        out = kernel(query[0].transpose(0, 1), key[0].transpose(0, 1),
                     value[0].transpose(0, 1), cu_seq_lens_q, max_length_q, scaling)
        return out.unsqueeze(0), None
    return _uncompiled_loop(query, key, value, packed_lengths, dropout_p, scaling), None


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switches a transformers model to ``packed_attention``; False if it cannot switch.

    Without the switch transformers builds the (dense) block-diagonal mask from the
    packed position ids itself: still correct, slower.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        return False
    setter(PACKED_ATTENTION)
    return getattr(model.config, "_attn_implementation", None) == PACKED_ATTENTION
