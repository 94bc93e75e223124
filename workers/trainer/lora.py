"""LoRA on the trainer shards (``model.lora.rank > 0``): adapters injected into the policy,
the only parameters trained.

Owns: injecting peft's LoRA layers into the Hugging Face model in place (``attach``; the
model keeps its class, so packed attention, the fused head, ``trainer.compile`` and
FSDP2's per-layer sharding see the model they know), starting the adapters from a policy
folder's ``adapter/`` (a checkpoint's, on resume) or from peft's initialisation (B = 0: the
base model's function) on a DDP replica and on an FSDP2 shard alike, the adapter's
tensors as a weight version carries them (``adapter_state``), the merged weights (base +
alpha/rank x B A: what evaluation and ``run.save_merged`` use, ``merged_state``), the base
weight file names behind the injected ones (``base_name``), the policy folder of a LoRA
policy (``save_policy_folder``: the base files linked beside the adapter) and what
target modules may name (``layer_names``; ``head_targets``: the ones that would wrap
the output embedding). Knows nothing about the loss, optimizers or Ray.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from workers.model_config import LoraConfig
from workers.weights.adapter import (
    ADAPTER_DIR,
    is_adapter_tensor,
    module_name,
    peft_config,
    read_adapter,
    wire_name,
    write_adapter,
)

BASE_FILES = (".safetensors", ".json", ".jinja", ".txt", ".model")
"""The suffixes of a base model folder's files that a policy folder takes (weights,
configs, tokenizer); a checkpoint's training state stays behind."""
MERGED_DIR = "merged"
"""final_model's folder of the merged policy (``run.save_merged``)."""
BASE_LAYER = ".base_layer"
"""What peft's injection puts in the name of a wrapped layer's own weights."""


def base_name(name: str) -> str:
    """A parameter's name in the base model's weight files (``q_proj.base_layer.weight``
    is ``q_proj.weight`` there)."""
    return name.replace(BASE_LAYER, "")


def attach(module: torch.nn.Module, lora: LoraConfig, model_path: str) -> torch.nn.Module:
    """Injects the adapters into ``module`` (in place; returned), freezing every other
    parameter. Their values are peft's until ``init_adapters`` sets them (on the meta
    device, where FSDP2 builds, they have none)."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(peft_config(lora, model_path), module)
    return module


def init_adapters(module: torch.nn.Module, model_path: str, seed: int) -> None:
    """Sets the adapters of a model built with ``attach`` and materialised (a DDP
    replica's, or an FSDP2 shard's slices): ``model_path``'s ``adapter/`` when it has
    one (a LoRA checkpoint or policy folder), else peft's initialisation (A
    Kaiming-uniform, B zero: the base model's function), drawn whole from ``seed`` in
    the parameters' order. So every shard, and both backends, start from the same
    adapters."""
    saved = Path(model_path) / ADAPTER_DIR
    given = ({module_name(n): t for n, t in read_adapter(saved).items()}
             if saved.is_dir() else {})
    wanted = [name for name, _ in module.named_parameters() if is_adapter_tensor(name)]
    if given and set(given) != set(wanted):
        missing, extra = sorted(set(wanted) - set(given)), sorted(set(given) - set(wanted))
        raise ValueError(f"{saved}: the saved adapter does not fit model.lora: missing "
                         f"{missing[:3]}, unexpected {extra[:3]}")
    draws = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if not is_adapter_tensor(name):
                continue
            whole = given.get(name)
            if whole is None:
                whole = torch.zeros(param.shape, dtype=torch.float32)
                if ".lora_A." in name:  # peft's own initialisation of A
                    torch.nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=draws)
            whole = whole.to(device=param.device, dtype=param.dtype)
            if isinstance(param, DTensor):
                whole = distribute_tensor(whole, param.device_mesh, param.placements,
                                          src_data_rank=None)
            param.copy_(whole)


def adapter_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a model's state dict, by wire name (what a version
    carries and what peft saves)."""
    return {wire_name(name): t for name, t in state.items() if is_adapter_tensor(name)}


def merged_state(state: Mapping[str, torch.Tensor], lora: LoraConfig
                 ) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter merged in (W + alpha/rank x B A),
    under the base model's names: a plain Hugging Face model loads it."""
    scaling = lora.alpha / lora.rank
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_adapter_tensor(name):
            continue
        if name.endswith(f"{BASE_LAYER}.weight"):
            layer = name.removesuffix(f"{BASE_LAYER}.weight")
            a = state[f"{layer}.lora_A.default.weight"].float()
            b = state[f"{layer}.lora_B.default.weight"].float()
            tensor = (tensor.float() + scaling * (b @ a)).to(tensor.dtype)
        merged[base_name(name)] = tensor
    return merged


def save_policy_folder(out_dir: str | Path, *, base_dir: str | Path,
                       adapter: Mapping[str, torch.Tensor], lora: LoraConfig) -> None:
    """A LoRA policy folder: the base model's files of ``base_dir`` (hard links where
    the file system allows: a folder per version costs no copy of the base), and the
    adapter in ``adapter/``. Engines start from it (base + adapter), and so does a
    resumed trainer."""
    out, base = Path(out_dir), Path(base_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in base.iterdir():
        if not path.is_file() or path.suffix not in BASE_FILES or (out / path.name).exists():
            continue
        # Linked, the weights only: nothing ever writes into them, while the small files
        # (the tokenizer's) may be written again into this folder.
        if path.suffix == ".safetensors":
            try:
                os.link(path, out / path.name)
                continue
            except OSError:  # another file system
                pass
        shutil.copy2(path, out / path.name)
    write_adapter(out / ADAPTER_DIR, adapter, lora)


def layer_names(model_path: str) -> tuple[set[str], str]:
    """The last part of the name of every linear layer of the model at ``model_path``
    (built on the meta device), and the full name of its output embedding (the head)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {sub: name for name, sub in model.named_modules()}
    linear = {name.rsplit(".", 1)[-1] for sub, name in names.items()
              if isinstance(sub, torch.nn.Linear)}
    return linear, names[model.get_output_embeddings()]


def head_targets(targets: Sequence[str], head: str) -> list[str]:
    """The ``targets`` that name the module ``head`` as peft matches a list of names:
    the whole name, or its last dotted parts."""
    return [t for t in targets if head == t or head.endswith(f".{t}")]



class LoraPolicy:
    """What a trainer shard does differently with LoRA on: which tensors a version, a
    checkpoint and a saved policy hold. Built at setup, after ``attach``; every method
    takes the model's whole state dict (a DDP replica's own, or FSDP2's gathered one)."""

    def __init__(self, lora: LoraConfig, model_path: str) -> None:
        self.lora = lora
        self.model_path = model_path
        # The base files, linked (or copied) aside once: model.path may be a checkpoint
        # that run.keep_checkpoints rotates away while this run still saves policies.
        self.base_dir = Path(tempfile.mkdtemp(prefix="async-rl-lora-base-"))
        save_policy_folder(self.base_dir, base_dir=model_path, adapter={}, lora=lora)
        shutil.rmtree(self.base_dir / ADAPTER_DIR)

    def save_policy(self, out_dir: str | Path, adapters: Mapping[str, torch.Tensor],
                    tokenizer: Any) -> None:
        """The policy folder an engine (or a resumed trainer) starts from; ``adapters``
        by wire name (``adapter_state``)."""
        save_policy_folder(out_dir, base_dir=self.base_dir, adapter=adapters,
                           lora=self.lora)
        tokenizer.save_pretrained(str(out_dir))

    def save_final(self, out_dir: str | Path, whole: Mapping[str, torch.Tensor],
                   tokenizer: Any, module: torch.nn.Module, *, merged: bool) -> None:
        """``final_model``: the adapter in peft's format (``PeftModel.from_pretrained``
        onto the base model loads it) with the tokenizer; with ``merged`` also the merged
        policy, a plain Hugging Face model, in ``merged/``."""
        write_adapter(out_dir, adapter_state(whole), self.lora, self.model_path)
        tokenizer.save_pretrained(str(out_dir))
        if merged:
            from transformers import AutoModelForCausalLM

            config = module.config
            with torch.device("meta"):
                plain = AutoModelForCausalLM.from_config(config)
            plain.save_pretrained(Path(out_dir, MERGED_DIR), state_dict=merged_state(
                whole, self.lora))
            tokenizer.save_pretrained(str(Path(out_dir, MERGED_DIR)))

    def close(self) -> None:
        shutil.rmtree(self.base_dir, ignore_errors=True)
