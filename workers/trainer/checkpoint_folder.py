"""The trainer's folder of a checkpoint: what each backend writes there, in the background,
and reads back on resume.

Owns: the folder's layout per ``trainer.backend`` — both: a Hugging Face model with its
tokenizer (rollout engines of a resumed run start from it); ddp: ``TRAINING_STATE``
(optimizer and RNG state, written by one shard: shards are replicas); fsdp2: ``SHARDED``,
the sharded model and optimizer state through ``torch.distributed.checkpoint`` (each
shard writes its own part: ``sharded_state``, read back by ``load_sharded``, which the
critic's sharded state uses too), and ``RNG`` — and ``CheckpointWriter``, which snapshots that
state (a copy, taken in order with training, into CPU buffers it keeps from one
checkpoint to the next) and writes the copy in a thread of its own at the lowest CPU
priority, so the next step trains meanwhile; ``wait`` blocks until the write is
complete and re-raises its error. Knows nothing about the checkpoint's manifest, its
atomic rename or the run's state (``async_rl.control.checkpoint_files``), nor about Ray.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from workers.trainer.config import Backend

TRAINING_STATE = "training_state.pt"
"""ddp: optimizer and RNG state, beside the model."""
SHARDED = "sharded"
"""fsdp2: the ``torch.distributed.checkpoint`` folder of model and optimizer shards."""
RNG = "rng.pt"
"""fsdp2: rank 0's RNG state (every shard starts from the same seed, as with ddp)."""


WAIT_GROUP = "checkpoint"
"""Ray concurrency group of ``checkpoint_written``: waiting for a write is not queued
behind (nor holds up) the shard's training calls."""


class BackendMismatch(Exception):
    """The folder was written by the other backend: the message is one line."""


def written_by(folder: Path) -> Backend | None:
    """Which backend wrote the trainer folder (None: neither's state is there)."""
    if (folder / SHARDED).is_dir():
        return "fsdp2"
    if (folder / TRAINING_STATE).is_file():
        return "ddp"
    return None


def _copy(state: Any, previous: Any = None) -> Any:
    """Every tensor in ``state`` copied (a DTensor keeps its shard on its device; a
    plain tensor goes to CPU memory): training may change the originals meanwhile.

    ``previous``: an earlier copy of a state of the same structure; its CPU tensors are
    refilled in place instead of allocated again (a fresh 4 GB buffer costs its page
    faults, about as much as the copy itself).
    """
    leaves, spec = tree_flatten(state)
    reuse: list[Any] = [None] * len(leaves)
    if previous is not None:
        old, old_spec = tree_flatten(previous)
        if old_spec == spec:
            reuse = old
    out = []
    for leaf, buffer in zip(leaves, reuse, strict=True):
        if not isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif (isinstance(buffer, torch.Tensor) and buffer.device.type == "cpu"
              and type(buffer) is type(leaf) and buffer.shape == leaf.shape
              and buffer.dtype == leaf.dtype):
            out.append(buffer.copy_(leaf.detach()))
        elif isinstance(leaf, DTensor):
            out.append(leaf.detach().clone())
        else:
            out.append(leaf.detach().to("cpu", copy=True))
    return tree_unflatten(out, spec)


def _allocate(state: Any) -> Any:
    """CPU buffers shaped like ``state``'s tensors, every page written once (a DTensor
    gets a local one like it; one on an accelerator gets none: its copy stays there).

    Written, not just allocated: ``torch.zeros`` would map the zero page and leave the
    page faults to the first snapshot, which is the cost this moves off the trainer."""
    leaves, spec = tree_flatten(state)
    out: list[Any] = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor) or leaf.device.type not in ("cpu", "meta"):
            out.append(None)
        elif isinstance(leaf, DTensor):
            out.append(torch.empty_like(leaf).zero_())
        else:
            out.append(torch.empty(leaf.shape, dtype=leaf.dtype, device="cpu").zero_())
    return tree_unflatten(out, spec)


def _background_thread() -> None:
    """The writer thread's start: the lowest CPU priority, on any core, so that the
    shard's own compute (and, on CPU, the other roles') goes first and the write takes
    the time they leave (Linux: per-thread nice and affinity; elsewhere a no-op)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, 19)
        os.sched_setaffinity(thread, range(os.cpu_count() or 1))
    except OSError:  # a restricted container: the write still works, at the shard's share
        pass


class CheckpointWriter:
    """One shard's checkpoint writes, one at a time, each in a background thread."""

    def __init__(self, *, rank: int, backend: Backend) -> None:
        self.rank = rank
        self.backend = backend
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint",
                                        initializer=_background_thread)
        self._copies: tuple[Any, Any] = (None, None)
        """The last snapshot (sharded or optimizer state, whole model): its CPU buffers
        are refilled by the next one."""
        self.prepared = False
        """``prepare`` has run: the snapshot buffers exist or are being made."""
        self._pending: Future[None] | None = None
        self._lock = threading.Lock()
        self._group: Any = None
        if backend == "fsdp2" and dist.is_initialized():
            # The writes' collectives (DCP's plan exchange) run in the writer thread beside
            # training's: a group of their own, gloo since DCP exchanges Python objects.
            self._group = dist.new_group(backend="gloo")

    def prepare(self, *, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                whole: dict[str, torch.Tensor]) -> None:
        """Allocates the first snapshot's buffers in the writer thread, beside training,
        so that the first checkpoint costs the trainer only its copy, as later ones do.
        Call once the optimizer has its state (after its first step).

        ``whole``: tensors shaped like ``start``'s (meta tensors will do; empty where this
        shard writes no Hugging Face model)."""
        self.wait()
        self.prepared = True
        sharded = self._state(module, optimizer)

        def allocate() -> None:
            self._copies = (_allocate(sharded), _allocate(whole))

        with self._lock:
            self._pending = self._pool.submit(allocate)

    def _state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        """What this backend's checkpoint holds besides the Hugging Face model (live
        tensors, not copies)."""
        if self.backend == "fsdp2":
            return sharded_state(module, optimizer)
        return {"optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}

    def start(self, out_dir: str, *, module: torch.nn.Module,
              optimizer: torch.optim.Optimizer, whole: dict[str, torch.Tensor],
              tokenizer: Any,
              save_model: Callable[[Path, dict[str, torch.Tensor]], None] | None = None,
              ) -> None:
        """Snapshots the state to resume from and starts writing it into ``out_dir``.

        ``whole``: the policy's state dict, whole, where this shard writes the Hugging
        Face model (empty on fsdp2's other shards). Waits for an earlier write first.
        ``save_model``: writes the policy folder from (the copy of) ``whole`` instead of
        a Hugging Face save of it with the tokenizer (LoRA: base files and adapter).
        """
        self.wait()
        out = Path(out_dir)
        rng = torch.get_rng_state()  # fsdp2 writes it beside DCP's folder
        last_sharded, last_whole = self._copies
        sharded = _copy(self._state(module, optimizer), last_sharded)
        whole = _copy(whole, last_whole)
        self._copies = (sharded, whole)

        def write() -> None:
            out.mkdir(parents=True, exist_ok=True)
            if whole and save_model is not None:
                save_model(out, whole)
            elif whole:
                module.save_pretrained(out, state_dict=whole)  # type: ignore[operator]
                tokenizer.save_pretrained(out)
            if self.backend == "fsdp2":
                dcp.save(sharded, checkpoint_id=out / SHARDED, process_group=self._group)
                if self.rank == 0:
                    torch.save(rng, out / RNG)
            else:
                torch.save(sharded, out / TRAINING_STATE)

        with self._lock:
            self._pending = self._pool.submit(write)

    def wait(self) -> None:
        """Returns once the last write started is complete; raises its error, once."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.wait()
        self._pool.shutdown()


def sharded_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer
                  ) -> dict[str, Any]:
    """An FSDP2 module's and its optimizer's state as ``torch.distributed.checkpoint``
    saves it: each shard's own slices (live tensors, not copies)."""
    model_state, optim_state = get_state_dict(module, optimizer)
    return {"model": model_state, "optim": optim_state}


def load_sharded(folder: Path, *, module: torch.nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
    """Restores what ``dcp.save`` wrote of ``sharded_state`` into ``folder``, each shard
    its own slices. Collective: every shard calls it."""
    state = sharded_state(module, optimizer)
    dcp.load(state, checkpoint_id=folder)
    # DCP loads in place: the dicts now hold the checkpoint's values.
    set_state_dict(module, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def load(folder: str, *, backend: Backend, module: torch.nn.Module,
         optimizer: torch.optim.Optimizer) -> None:
    """Restores the optimizer (and with fsdp2 the model shards) and RNG state from a
    trainer folder; ``BackendMismatch`` when the other backend wrote it."""
    path = Path(folder)
    found = written_by(path)
    if found != backend:
        raise BackendMismatch(
            f"{path}: written by trainer.backend = {found!r}, this run has {backend!r}: "
            f"resume with trainer.backend = {found!r}" if found else
            f"{path}: no {SHARDED}/ or {TRAINING_STATE} (not a trainer checkpoint)")
    if backend == "fsdp2":
        load_sharded(path / SHARDED, module=module, optimizer=optimizer)
        torch.set_rng_state(torch.load(path / RNG, weights_only=True))
        return
    state = torch.load(path / TRAINING_STATE, weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
