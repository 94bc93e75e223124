"""Attention inside a packed row: each sequence attends to itself only, from offsets the
host already knows.

Owns: the transformers attention function the trainer registers (``packed_attention``,
``use_packed_attention``) and the kernel it runs per device and dtype (``varlen_kernel``,
named by ``kernel_name``; ``per_sequence_attention`` where there is none), with the
families' variants of attention: a sliding window (transformers' ``sliding_window``: a
token sees itself and the ``sliding_window - 1`` tokens before it, as its
``sliding_window_overlay`` masks), logit soft-capping (Gemma 2's ``softcap``) and
attention sinks (gpt-oss's ``s_aux``: one logit per head in every softmax's
denominator). A hybrid model's linear-attention layers (Qwen3-Next's and Qwen3.5's
gated delta-nets, whose recurrence and causal convolution would run across sequence
boundaries) run once per packed sequence: ``workers.trainer.linear_attention``.
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
  A sliding window shorter than a sequence masks it (SDPA's boolean mask); soft-capping
  and sinks need the scores themselves, so they run an explicit softmax per sequence
  (``_explicit_attention``, the formula of the families' eager attention).
- CUDA in bf16/fp16: one variable-length flash call per layer over the whole row:
  ``torch.nn.attention.varlen.varlen_attn`` where this torch's signature can express the
  call (causal: ``is_causal`` in older builds, ``window_size=(-1, 0)`` in newer, a
  window ``(sliding_window - 1, 0)``; grouped-query heads need its ``enable_gqa``), else
  ``aten._flash_attention_forward``, which takes grouped-query heads natively, a window
  as ``window_size_left`` where its schema has it (``FLASH_WINDOW``), and has its own
  backward. A window no kernel here takes, soft-capping and sinks run the per-sequence
  loop on CUDA too (flash takes neither).

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

from workers.trainer.linear_attention import split_linear_attention

PACKED_ATTENTION = "async_rl_packed"
"""Name under which ``packed_attention`` is registered with transformers. Not one with
"sdpa" in it: transformers then checks the class supports SDPA (gpt-oss does not)."""

VarlenKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int,
                         float | None, int | None], torch.Tensor]
"""``(q, k, v, cu_seqlens, max_len, scale, window) -> out``: q ``(T, H, d)``, k and v
``(T, H_kv, d)``, ``cu_seqlens`` int32 ``(S + 1,)`` on the device, ``window`` the tokens
each query sees (itself included; None: all before it); out ``(T, H, d)``."""


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                   max_len: int, scale: float | None, window: int | None) -> torch.Tensor:
    # flash's window counts the keys left of the query: the query itself is not one.
    windowed = {} if window is None else {"window_size_left": window - 1,
                                          "window_size_right": 0}
    out: torch.Tensor = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale, **windowed)[0]
    return out


def _flash_takes_window() -> bool:
    """This torch's ``aten._flash_attention_forward`` takes ``window_size_left``."""
    schema = torch.ops.aten._flash_attention_forward.default._schema
    return any(arg.name == "window_size_left" for arg in schema.arguments)


FLASH_WINDOW = _flash_takes_window()
"""Resolved once, at import: a windowed layer has a kernel on CUDA only where flash
takes the window (``varlen_attn`` falls back to flash where its own signature cannot
say it)."""


def _varlen_attn_call() -> Callable[..., torch.Tensor] | None:
    """torch's public varlen attention with this build's causal, window and GQA keywords
    bound; None where it is missing or cannot say causal. A call its signature cannot
    express (grouped-query heads without ``enable_gqa``, a window without
    ``window_size``) goes to ``_flash_forward``."""
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
    takes_window = "window_size" in params
    call_varlen: Callable[..., torch.Tensor] = varlen_attn  # type: ignore[assignment]

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
             max_len: int, scale: float | None, window: int | None) -> torch.Tensor:
        gqa = k.shape[1] != q.shape[1]
        if (gqa and not takes_gqa) or (window is not None and not takes_window):
            return _flash_forward(q, k, v, cu, max_len, scale, window)
        mask = causal if window is None else {"window_size": (window - 1, 0)}
        return call_varlen(q, k, v, cu, cu, max_len, max_len, scale=scale, **mask,
                           **({"enable_gqa": True} if gqa else {}))

    return call


TORCH_VARLEN = _varlen_attn_call()
"""Resolved once, at import: a compiled layer then reads a plain global (inspecting a
signature inside compiled code would break its graph)."""


def varlen_kernel(device: torch.device, dtype: torch.dtype, *, windowed: bool = False
                  ) -> VarlenKernel | None:
    """The one-call-per-layer kernel for tensors of ``dtype`` on ``device`` (``windowed``:
    for a sliding-window layer); None means the per-sequence loop (CPU, float32, or a
    window this torch's flash cannot take)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    if windowed and not FLASH_WINDOW:
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
    """A packed row's sequence lengths on the host, for the per-sequence loops. A holder,
    not the tuple itself: a compiled layer guards on a tuple's length (one graph per
    sequence count) but on this only by its type, and only the loops outside the graph
    (``_uncompiled_loop``, ``workers.trainer.linear_attention``) read it."""

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


def _window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """``(length, length)`` bool, True where query ``i`` sees key ``j``: ``i - window < j
    <= i`` (transformers' sliding window with its causal mask)."""
    query = torch.arange(length, device=device).unsqueeze(1)
    offset = query - torch.arange(length, device=device).unsqueeze(0)
    return (offset >= 0) & (offset < window)


def _explicit_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        allowed: torch.Tensor, dropout_p: float, scaling: float | None,
                        softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """One sequence's attention with the scores in hand, as the families' eager attention
    computes it: ``softcap * tanh(s / softcap)`` on the scaled scores, the mask, each
    head's sink logit as one more column of the softmax (then dropped), the softmax in
    float32. ``(1, H, L, d)`` in, ``(1, H, L, d)`` out."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = query @ key.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.float().masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], -1)
    probs = torch.softmax(scores, -1)
    if sinks is not None:
        probs = probs[..., :-1]
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    return probs.to(value.dtype) @ value


def _sequence_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        dropout_p: float, scaling: float | None, window: int | None,
                        softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Causal attention over one whole sequence ``(1, H, L, d)``."""
    length = query.shape[2]
    if softcap is not None or sinks is not None:
        allowed = _window_mask(length, min(window or length, length), query.device)
        return _explicit_attention(query, key, value, allowed, dropout_p, scaling,
                                   softcap, sinks)
    gqa = key.shape[1] != query.shape[1]
    if window is None or window >= length:
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p,
                                              is_causal=True, scale=scaling, enable_gqa=gqa)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=_window_mask(length, window, query.device),
        dropout_p=dropout_p, scale=scaling, enable_gqa=gqa)


def per_sequence_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           lengths: tuple[int, ...] | list[int], dropout_p: float,
                           scaling: float | None, window: int | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None
                           ) -> torch.Tensor:
    """Causal attention on each sequence's slice of a ``(1, H, T, d)`` row; ``(1, H, T,
    d)``. ``window``: the tokens a query sees, itself included (a sliding-window layer);
    ``softcap``, ``sinks``: Gemma 2's logit soft-capping, gpt-oss's per-head sink logits.

    The per-sequence loop: what ``packed_attention`` runs where ``varlen_kernel`` has
    no kernel, and the reference a kernel is checked against (``bench/trainer/gpu_check.py``).
    SDPA where it can express the layer (causal, or with a window's boolean mask), the
    explicit softmax where it cannot (soft-capping, sinks)."""
    parts = [_sequence_attention(q, k, v, dropout_p, scaling, window, softcap, sinks)
             for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2),
                                value.split(lengths, 2), strict=True)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, 2)


@torch.compiler.disable
def _uncompiled_loop(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     lengths: HostLengths | None, dropout_p: float, scaling: float | None,
                     window: int | None, softcap: float | None, sinks: torch.Tensor | None
                     ) -> torch.Tensor:
    """``per_sequence_attention`` over ``lengths`` (None: the row is one sequence) as
    ``(1, T, H, d)``, never compiled: traced, the loop would unroll into one SDPA call
    per sequence, and its layer compile again for every new sequence count."""
    split = lengths.lengths if lengths is not None else (query.shape[2],)
    out = per_sequence_attention(query, key, value, split, dropout_p, scaling, window,
                                 softcap, sinks)
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
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
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
    causal attention keeps real tokens from the pads after them). ``sliding_window``,
    ``softcap`` and ``s_aux`` are what the families' attention layers pass (a window,
    Gemma 2's soft-capping, gpt-oss's sinks). Returns ``(B, T, heads, d)``.
    """
    if key.shape[2] != query.shape[2]:
        raise ValueError("packed attention is for training: it takes no KV cache")
    dtype = _compute_dtype(query, key, value)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    dropout_p = dropout if module.training else 0.0
    # A window at least as long as the longest sequence (max_length_q bounds it) masks
    # nothing: plain causal attention.
    bound = max_length_q if max_length_q is not None else query.shape[2]
    window = sliding_window if sliding_window is not None and sliding_window < bound else None
    scores_needed = softcap is not None or s_aux is not None
    kernel = None if scores_needed else varlen_kernel(query.device, dtype,
                                                      windowed=window is not None)
    if kernel is not None and cu_seq_lens_q is not None and max_length_q is not None \
            and dropout_p == 0.0 and query.shape[0] == 1:
        out = kernel(query[0].transpose(0, 1), key[0].transpose(0, 1),
                     value[0].transpose(0, 1), cu_seq_lens_q, max_length_q, scaling, window)
        return out.unsqueeze(0), None
    return _uncompiled_loop(query, key, value, packed_lengths, dropout_p, scaling, window,
                            softcap, s_aux), None


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switches a transformers model to ``packed_attention``, and its linear-attention
    layers, if any, to one run per packed sequence (``split_linear_attention``); False if
    the attention cannot switch.

    Without the switch transformers builds the (dense) block-diagonal mask from the
    packed position ids itself: still correct, slower.
    """
    from transformers import AttentionInterface

    split_linear_attention(model)
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        return False
    setter(PACKED_ATTENTION)
    return getattr(model.config, "_attn_implementation", None) == PACKED_ATTENTION
