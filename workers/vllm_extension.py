"""Weight loading inside vLLM's worker process.

Owns: ``WeightLoaderExtension``, the mix-in vLLM grafts onto its worker class when the
engine is built with ``worker_extension_cls="workers.vllm_extension.WeightLoaderExtension"``;
the rollout engine reaches it with ``collective_rpc("load_weights_from_file", args=(path,))``.
Knows nothing about Ray, versions, pausing or where the file came from: it reads one
safetensors file of Hugging Face-named tensors and hands them to the worker's own
``reload_weights`` (the model's ``load_weights`` does the q/k/v and gate/up stacking and
the dtype cast).

It runs in the engine's worker process, imported by dotted path, so it imports only
torch-side libraries that the worker has anyway.
"""

from __future__ import annotations

from typing import Any

from safetensors.torch import load_file


class WeightLoaderExtension:
    """Mixed into vLLM's worker class; ``self.model_runner`` is the worker's."""

    # Provided by the vLLM worker class this one is mixed into.
    model_runner: Any
    reload_weights: Any

    def load_weights_from_file(self, path: str) -> int:
        """Loads every tensor in the safetensors file at ``path``; returns how many.

        A file rather than tensors in the rpc arguments: collective_rpc serialises
        tensors in its arguments as Python lists, which is slow and loses the dtype.
        """
        # Read on the CPU; the weight loaders copy into the model's device and dtype.
        state = load_file(path, device="cpu")
        # Not model_runner.model.load_weights: after the first load vLLM repacks weights
        # into kernel layouts (the CPU build leaves 0-element parameters behind), so a
        # second plain load fails. reload_weights restores the checkpoint-format
        # parameters layer by layer, loads, and re-runs the post-load processing.
        self.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)
        self._refresh_tied_head()
        return len(state)

    def _refresh_tied_head(self) -> None:
        # With tied embeddings the checkpoint has no lm_head tensor, so reload_weights
        # skips the head and keeps its old kernel state. On the CPU build that state is
        # a packed copy of the old embedding (oneDNN / sgl GEMM), and logits would stay
        # stale. Re-running the head's post-load processing packs the new embedding;
        # elsewhere it is a no-op.
        model = self.model_runner.get_model()  # unwrapped (CUDA graph wrappers on GPUs)
        head = getattr(model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and method:
            method.process_weights_after_loading(head)
