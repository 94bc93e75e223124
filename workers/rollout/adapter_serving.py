"""A rollout engine serving the policy as base model + one LoRA adapter (model.lora on).

Owns: the engine's adapter folder (a private copy: the policy folder's ``adapter/`` when
the engine starts from one, a resumed run's or a restarted worker's, else an adapter of
zeros, which is what a fresh LoRA policy computes) and telling the engine's worker to
load every weight version into it (``WorkerExtension.serve_adapter``). Every request
names the adapter with the ``LoRARequest`` returned. Knows nothing about how versions
travel (``workers.weights``) or when they come.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.model_config import ModelConfig
from workers.weights.adapter import ADAPTER_DIR, policy_lora_request, zero_adapter

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM


async def serve_policy_adapter(engine: AsyncLLM, model: ModelConfig) -> tuple[Any, str]:
    """Makes the engine's adapter folder and has its worker load versions into it;
    returns the ``LoRARequest`` every request carries and the folder (the caller removes
    it when the engine stops)."""
    folder = tempfile.mkdtemp(prefix="async-rl-adapter-")
    saved = Path(model.path) / ADAPTER_DIR
    if saved.is_dir():
        shutil.copytree(saved, folder, dirs_exist_ok=True)
    else:
        zero_adapter(folder, model.path, model.lora)
    await engine.collective_rpc("serve_adapter", args=(folder,))
    return policy_lora_request(folder), folder
