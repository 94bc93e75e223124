"""Loading a whole weight version into the model of vLLM's worker process.

Owns: ``load_version``: vLLM's layerwise reload (what its own NCCL and IPC transports
use) of a version's checkpoint-format tensors, then the post-load steps that reload
leaves stale in vLLM 0.32: a tied head's packed copy of the embedding and a mixture of
experts' packed experts, both on the CPU build. Used by the "gloo" transport
(``workers.weights.gloo_transfer``) and by the model matrix's engine rows, which check
that a version reaches each family's engine. vLLM is imported inside the functions:
this module is imported by the trainer too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch


def load_version(model: torch.nn.Module, model_config: Any,
                 staged: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Loads ``staged`` (every tensor of a version, as the checkpoint names them) into
    vLLM's ``model`` (``model_config``: its ``ModelConfig``), in place."""
    from vllm.model_executor.model_loader.mtp_validation import (
        disable_mtp_completeness_check,
    )
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    load_weights: Any = model.load_weights  # every vLLM model defines it
    with _reloaded_experts() as reloaded:
        initialize_layerwise_reload(model)
        with disable_mtp_completeness_check():
            load_weights(staged)
        finalize_layerwise_reload(model, model_config)
    _refresh_tied_head(model)
    for method, layer in reloaded:
        # vLLM 0.32 converts reloaded experts to its kernel's format but runs the
        # experts' own post-load step (on the CPU build: repacking them into its
        # grouped-GEMM layout) only at the first load: after an update its CPU kernel
        # read raw weights as packed ones (log-probs 0.06 nats off on a tiny Qwen3-MoE
        # reloaded with unchanged weights). Run it for the layers reloaded now.
        method.moe_kernel.fused_experts.process_weights_after_loading(layer)


@contextmanager
def _reloaded_experts() -> Iterator[list[tuple[Any, torch.nn.Module]]]:
    """Within: the unquantized MoE layers whose experts a reload sets up again (vLLM's
    ``_setup_kernel`` with a kernel already built), each with its method. Only those:
    a layer the reload could not load (vLLM keeps its old, already packed tensors) must
    not be repacked."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    reloaded: list[tuple[Any, torch.nn.Module]] = []
    setup = UnquantizedFusedMoEMethod._setup_kernel

    def recorded(method: Any, layer: Any, *args: Any, **kwargs: Any) -> None:
        update = method.moe_kernel is not None
        setup(method, layer, *args, **kwargs)
        if update:
            reloaded.append((method, layer))

    UnquantizedFusedMoEMethod._setup_kernel = recorded  # type: ignore[method-assign,assignment]
    try:
        yield reloaded
    finally:
        UnquantizedFusedMoEMethod._setup_kernel = setup  # type: ignore[method-assign]


def _refresh_tied_head(model: torch.nn.Module) -> None:
    # With tied embeddings the checkpoint has no lm_head tensor, so the reload skips
    # the head and keeps its old kernel state. On the CPU build that state is a packed
    # copy of the old embedding (oneDNN / sgl GEMM), and logits would stay stale.
    # Re-running the head's post-load processing packs the new embedding; elsewhere
    # it is a no-op.
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and method is not None:
        method.process_weights_after_loading(head)
