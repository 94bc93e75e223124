"""A hybrid model's linear-attention layers in a packed row: run once per sequence.

Owns: ``split_linear_attention`` (installed by ``workers.trainer.attention.
use_packed_attention``), which makes every decoder layer's ``linear_attn`` module (the
gated delta-nets of Qwen3-Next and Qwen3.5, dense and MoE) run its forward on each
packed sequence alone (``PerSequence``). Their causal convolution and their recurrence
carry state from one token to the next, and transformers' torch path takes no sequence
offsets (``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule`` ignore
``cu_seqlens``): over a whole packed row a sequence would start from the state its
predecessor left. Per sequence, each starts from zero, exactly as in its own padded
forward (right padding follows the real tokens, so a causal layer never sees it). Like
the attention's per-sequence loop, the split runs outside a compiled graph
(``_each_sequence``): traced, a layer would compile again for every sequence count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from workers.trainer.attention import HostLengths

PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""The row's offsets (``workers.trainer.attention.attention_kwargs``): a slice holding one
sequence gets none of them, as a forward of that sequence alone would."""


@torch.compiler.disable
def _each_sequence(forward: Callable[..., torch.Tensor], hidden_states: torch.Tensor,
                   lengths: HostLengths, kwargs: dict[str, Any]) -> torch.Tensor:
    """``forward`` on each sequence's slice of the ``(1, T, hidden)`` row, end to end."""
    parts = [forward(part, **kwargs) for part in hidden_states.split(lengths.lengths, 1)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


class PerSequence:
    """A linear-attention module's forward, run on each sequence of a packed row alone
    (``packed_lengths``, on the host) and the outputs laid end to end again; a call
    without ``packed_lengths`` (a padded batch, generation) is the forward itself."""

    def __init__(self, forward: Callable[..., torch.Tensor]) -> None:
        self.forward = forward
        """The module's own forward, bound to it."""

    def __call__(self, hidden_states: torch.Tensor, *args: Any,
                 packed_lengths: HostLengths | None = None, **kwargs: Any
                 ) -> torch.Tensor:
        if packed_lengths is None:
            return self.forward(hidden_states, *args, **kwargs)
        if hidden_states.shape[0] != 1 or args or kwargs.get("cache_params") is not None:
            raise ValueError("a packed row is one row, for training: no cache, no batch")
        for key in PACKING_KEYS:
            kwargs.pop(key, None)
        return _each_sequence(self.forward, hidden_states, packed_lengths, kwargs)


def split_linear_attention(model: torch.nn.Module) -> int:
    """Makes every ``linear_attn`` module of ``model`` run per packed sequence; returns
    how many (0 for a model without linear attention). Calling it again changes
    nothing."""
    count = 0
    for module in model.modules():
        mixer = getattr(module, "linear_attn", None)
        if not isinstance(mixer, torch.nn.Module):
            continue
        count += 1
        if not isinstance(mixer.forward, PerSequence):
            # An instance attribute shadows the class's forward; hooks stay in __call__.
            mixer.forward = PerSequence(mixer.forward)
    return count
