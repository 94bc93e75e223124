"""A policy version as LoRA adapter tensors (``model.lora.rank > 0``): their names on the
wire and on disk, and the folder format that ``peft`` and vLLM both read.

Owns: ``ADAPTER_DIR`` (where a policy folder keeps its adapter beside the base weights),
the adapter's tensor names (peft's saved names: ``base_model.model.<module>.lora_A.weight``
and ``lora_B``; ``wire_name`` / ``module_name`` convert from and to the names inside the
trainer's model, which carry peft's adapter name ``default``), ``peft_config`` (a
``LoraConfig`` section as peft's), ``write_adapter`` / ``read_adapter`` (a folder of
``adapter_config.json`` and ``adapter_model.safetensors``, what ``PeftModel.from_pretrained``
and vLLM's ``LoRARequest`` load), ``zero_adapter`` (an adapter that changes nothing, for an
engine whose policy has no adapter yet) and ``is_adapter_version`` (how a receiving engine
tells an adapter version from a full one). Knows nothing about training or transports.
peft and transformers are imported inside the functions.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from workers.model_config import LoraConfig

ADAPTER_DIR = "adapter"
"""The adapter's folder inside a policy folder (a checkpoint's, a restarted rollout
worker's): the base model's files sit beside it."""
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
"""What peft puts before a module's name in a saved adapter (vLLM strips it too)."""
ADAPTER_NAME = "default"
"""peft's name for the one adapter in the trainer's model."""


def wire_name(module_name: str) -> str:
    """``model.layers.0.self_attn.q_proj.lora_A.default.weight`` (inside the trainer's
    model) as peft saves it: ``base_model.model.model.layers.0...q_proj.lora_A.weight``."""
    return PEFT_PREFIX + module_name.replace(f".{ADAPTER_NAME}.", ".")


def module_name(saved: str) -> str:
    """The inverse of ``wire_name``."""
    name = saved.removeprefix(PEFT_PREFIX)
    for part in (".lora_A.", ".lora_B."):
        name = name.replace(part, f"{part}{ADAPTER_NAME}.")
    return name


def is_adapter_tensor(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def is_adapter_version(names: Iterable[str]) -> bool:
    """True when a version's tensors are all adapter tensors (and there are some)."""
    names = list(names)
    return bool(names) and all(is_adapter_tensor(n) for n in names)


def peft_config(lora: LoraConfig, base_model: str = "") -> Any:
    """``lora`` as peft's ``LoraConfig`` (inference_mode off: the trainer's)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=list(lora.target_modules),
                          base_model_name_or_path=base_model or None)


def write_adapter(out_dir: str | Path, tensors: Mapping[str, torch.Tensor], lora: LoraConfig,
                  base_model: str = "") -> None:
    """Writes ``tensors`` (wire names) as a peft adapter folder. The weights file is
    replaced atomically: an engine reading the folder never sees half of it."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    peft_config(lora, base_model).save_pretrained(str(out))
    fd, tmp = tempfile.mkstemp(dir=out, suffix=".tmp")
    os.close(fd)
    save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, tmp)
    os.replace(tmp, out / WEIGHTS_FILE)


def read_adapter(folder: str | Path) -> dict[str, torch.Tensor]:
    """The adapter tensors of a peft adapter folder, by wire name."""
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / WEIGHTS_FILE))


def adapter_shapes(model_path: str, lora: LoraConfig) -> dict[str, tuple[int, ...]]:
    """Every adapter tensor's shape for the model at ``model_path`` (built on the meta
    device: no memory, no weights read), by wire name."""
    from peft import inject_adapter_in_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        inject_adapter_in_model(peft_config(lora), model)
    return {wire_name(name): tuple(p.shape) for name, p in model.named_parameters()
            if is_adapter_tensor(name)}


POLICY_ADAPTER_ID = 1
"""The one adapter an engine serves: every version replaces it under this id."""


def policy_lora_request(adapter_dir: str, *, reload: bool = False) -> Any:
    """vLLM's request for the policy's adapter in ``adapter_dir``; ``reload``: load it
    again in place (a new version), not just look it up."""
    from vllm.lora.request import LoRARequest

    return LoRARequest("policy", POLICY_ADAPTER_ID, adapter_dir, load_inplace=reload)


def zero_adapter(out_dir: str | Path, model_path: str, lora: LoraConfig,
                 dtype: torch.dtype = torch.float32) -> None:
    """An adapter folder whose adapters are all zero: the base model unchanged (a fresh
    LoRA policy is too, its B matrices being zero)."""
    shapes = adapter_shapes(model_path, lora)
    write_adapter(out_dir, {name: torch.zeros(shape, dtype=dtype)
                            for name, shape in shapes.items()}, lora, model_path)
