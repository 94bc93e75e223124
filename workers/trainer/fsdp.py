"""FSDP2 for the trainer shards: the policy built sharded, and read back whole.

Owns: finding a model's decoder layers (the classes its Hugging Face class names in
``_no_split_modules``: ``layer_classes``), building the policy on the meta device,
sharding it with ``fully_shard`` (every decoder layer, then the root) under
``trainer.param_dtype`` / ``trainer.reduce_dtype`` (``MixedPrecisionPolicy``) and
``trainer.offload`` (``CPUOffloadPolicy``), loading each parameter's own shard from the
model's safetensors files one tensor at a time, so no shard ever holds the whole model
(``build_sharded``), and gathering the whole weights onto rank 0: at once
(``full_state``: for evaluation and Hugging Face saves) or bucket by bucket
(``gather_buckets``: for weight publishing, so no rank holds a second whole copy beside
the snapshot it fills), and clipping gradients that are DTensors to a norm of the whole
model (``clip_grad_norm``). ``build_sharded`` also shards a module built around the
causal LM (``wrap``: the critic's value model around its decoder). Knows nothing about
the loss, the optimizer, checkpoints or Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from itertools import chain
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from workers.model_config import LoraConfig
from workers.trainer.config import FsdpDtype, TrainerConfig
from workers.trainer.device_setup import decoder_layers
from workers.trainer.lora import attach, base_name
from workers.weights.adapter import is_adapter_tensor

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def layer_classes(model_path: str) -> tuple[str, ...]:
    """The class names of the decoder layers FSDP2 shards one by one, from the model's
    Hugging Face class (``_no_split_modules``); empty when it names none."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_path)
    names: list[str] = []
    for architecture in config.architectures or ():
        cls = getattr(transformers, architecture, None)
        names += getattr(cls, "_no_split_modules", None) or ()
    return tuple(names)


def _dtype(name: FsdpDtype) -> torch.dtype | None:
    return None if name == "model" else _DTYPES[name]


def _policies(trainer: TrainerConfig, device: torch.device
              ) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    precision = MixedPrecisionPolicy(param_dtype=_dtype(trainer.param_dtype),
                                     reduce_dtype=_dtype(trainer.reduce_dtype))
    # Pinning needs an accelerator: on a CPU-only machine it fails inside fully_shard.
    offload = (CPUOffloadPolicy(pin_memory=device.type != "cpu") if trainer.offload
               else OffloadPolicy())
    return precision, offload


def build_sharded(model_path: str, *, dtype: torch.dtype, device: torch.device,
                  trainer: TrainerConfig, lora: LoraConfig | None = None,
                  wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
                  ) -> torch.nn.Module:
    """The policy, sharded over the default process group (which must be initialised).

    Built on the meta device (no memory), sharded, then each shard's memory allocated
    and filled from the safetensors files: a shard reads one whole tensor at a time
    (memory-mapped) and keeps its own slice of it. With ``lora`` on, the adapters are
    injected before sharding (each decoder layer's shard holds its adapters' slices;
    ``workers.trainer.lora.init_adapters`` sets them). ``wrap``: builds the module to
    shard around the (meta) causal LM instead of the causal LM itself; the tensors it
    takes from the causal LM are loaded under their names there, the ones it adds are
    left for the caller to set (they are not in the weight files).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        causal: torch.nn.Module = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if lora is not None and lora.enabled:
            attach(causal, lora, model_path)
        module = wrap(causal) if wrap is not None else causal
    layers = decoder_layers(causal)
    if not layers:
        raise ValueError(f"{model_path}: no decoder layers to shard (none of the classes "
                         f"{sorted(getattr(causal, '_no_split_modules', None) or ())} in "
                         "the model)")
    names = _causal_names(module, causal)
    world = dist.get_world_size()
    group = trainer.shard_group or world
    # 2-D: FSDP2 shards over the last dimension and replicates over the first (HSDP).
    mesh = (init_device_mesh(device.type, (world,)) if group == world else
            init_device_mesh(device.type, (world // group, group),
                             mesh_dim_names=("replicate", "shard")))
    precision, offload = _policies(trainer, device)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=precision, offload_policy=offload)
    fully_shard(module, mesh=mesh, mp_policy=precision, offload_policy=offload)
    module.to_empty(device="cpu" if trainer.offload else device)
    _init_buffers(module, device, getattr(causal, "_init_weights", None))
    _load_shards(module, Path(model_path), names)
    return module


def _causal_names(module: torch.nn.Module, causal: torch.nn.Module) -> dict[str, str]:
    """Each of ``module``'s parameters and buffers that is one of ``causal``'s: its name
    in ``module`` -> its name in ``causal`` (the weight files' names)."""
    def named(m: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
        return chain(m.named_parameters(), m.named_buffers())

    in_causal = {id(tensor): name for name, tensor in named(causal)}
    return {name: in_causal[id(tensor)] for name, tensor in named(module)
            if id(tensor) in in_causal}


def _init_buffers(module: torch.nn.Module, device: torch.device,
                  init: Callable[[torch.nn.Module], None] | None) -> None:
    """Computes the buffers ``to_empty`` left unset (rotary frequencies: not in the
    weight files) with the model's own initialiser ``init``, on ``device``."""
    with torch.no_grad():
        for sub in module.modules():
            if not sub._buffers:
                continue
            if init is not None:
                init(sub)
            for name, buffer in sub._buffers.items():
                if buffer is not None:
                    sub._buffers[name] = buffer.to(device)


def _load_shards(module: torch.nn.Module, model_dir: Path, names: dict[str, str]) -> None:
    """Copies every parameter's (and saved buffer's) own shard from the weight files;
    ``names``: the causal LM's name of each of ``module``'s tensors (``_causal_names``;
    the others are a wrapper's own)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights to load shards from")
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
                   for f in files]
        where = {key: handle for handle in handles for key in handle.keys()}  # noqa: SIM118
        targets = [*module.named_parameters(), *module.named_buffers()]
        with torch.no_grad():
            for own, target in targets:
                if own not in names:
                    continue  # the wrapper's own: its builder sets it
                injected = names[own]
                if is_adapter_tensor(injected):
                    continue  # not in the base files: init_adapters sets them
                name = base_name(injected)
                if name not in where:
                    if isinstance(target, DTensor):
                        raise KeyError(f"{model_dir}: no weights for {name}")
                    continue  # a buffer computed at build (_init_buffers)
                whole = where[name].get_tensor(name).to(target.dtype)
                if isinstance(target, DTensor):
                    # Every shard has the whole tensor: each keeps its slice, no message.
                    whole = distribute_tensor(whole, target.device_mesh, target.placements,
                                              src_data_rank=None)
                target.copy_(whole)


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict whole, in CPU memory, on rank 0 ({} on the others). Collective:
    every shard calls it."""
    state = get_model_state_dict(
        module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not state:
        return {}
    return {name: t for name, t in state.items() if isinstance(t, torch.Tensor)}


def full_shapes(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Meta tensors shaped like ``full_state``'s (the global shapes): no gather."""
    return {name: torch.empty(t.shape, dtype=t.dtype, device="meta")
            for name, t in module.state_dict().items() if isinstance(t, torch.Tensor)}


def gather_buckets(module: torch.nn.Module, bucket_bytes: int
                   ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The parameters whole, in ``named_parameters`` order, a bucket at a time: on rank 0
    each bucket's (name, whole tensor) pairs, at most ``bucket_bytes`` of them (or one
    parameter larger than that); [] on the other ranks. Collective: every shard iterates
    it to the end (one all-gather per parameter, ``DTensor.full_tensor``).

    Keeps no reference to a bucket once the next one is asked for: a consumer that
    copies each bucket away and drops it holds at most the bucket it copies and the
    parameters gathered for the next one, about two buckets, whatever the model's size.
    """
    rank0 = dist.get_rank() == 0
    bucket: list[tuple[str, torch.Tensor]] = []
    fill = 0
    with torch.no_grad():
        for name, param in module.named_parameters():
            whole = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            if not rank0:
                continue  # every rank gets the whole tensor: taking part was the point
            nbytes = whole.numel() * whole.element_size()
            if bucket and fill + nbytes > bucket_bytes:
                yield bucket
                bucket, fill = [], 0
            bucket.append((name, whole))
            fill += nbytes
            del whole
    if bucket:
        yield bucket


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Clips the gradients to ``max_norm`` in place; returns their norm before, of the
    whole model. FSDP2: each shard's norm is of its slice (a DTensor), the whole norm is
    one all-reduce away; every shard gets the same, so all agree to skip a non-finite
    update."""
    total = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return float(total.full_tensor() if isinstance(total, DTensor) else total)
