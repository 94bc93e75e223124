"""A colocated refit from first principles: what time-shared devices (run.colocate =
"time") pay to hand themselves from the rollout engines to the trainer and back.

Owns: ``RefitStages`` (seconds of each part of one turn, every device moving its own
share at once) and ``refit_stages``, which derives them from the bytes each part moves
and the link it crosses, unless the hardware gives the fixed costs
(``engine_release_s``, ``engine_reload_s``: then those replace the derived parts, as
before). A turn, as verl's hybrid engine, NeMo RL's and slime's colocated modes make it:

- **release** (before a training step): the engine sleeps, its KV cache freed (no bytes
  move) and its weights discarded (vLLM's sleep level 2: the new version replaces them)
  or offloaded to host memory (level 1: its devices' share over the host link); the
  trainer brings back what it offloaded (``simulate.refit_offload``): the optimizer
  state (``simulate.optimizer_bytes_per_parameter`` a trained parameter, 12 for Adam:
  two fp32 moments and an fp32 master copy; sharded over every trainer device, as ZeRO,
  FSDP and Megatron's distributed optimizer shard it), and with ``"all"`` its weights
  (the model's dtype, split over the devices holding a distinct slice);
- **reload** (after the step): the trainer offloads the same bytes again; the weights
  are resharded from the training layout into the inference layout (each device gathers
  the full tensors from the ``holders`` devices holding a slice, a ring all-gather:
  ``(n-1)/n`` of the trained weights over the node's links, or the network's when the
  holders span nodes, as verl's and NeMo RL's per-tensor gathers do); a level-1 engine
  brings its weights back from host memory; the version is copied into the engine's
  parameters at its devices' memory bandwidth (``copy``: paid whichever way the rest is
  costed; with a tensor-by-tensor update, its calls per tensor besides). The sequences
  an engine kept across the turn lost their KV cache: it recomputes it, a prefill of
  their context (``SimEngine``; only when derived).

Gradients are freed after the update, not moved. Every device has a host link of its
own (``host_bandwidth``: PCIe), all used at once. Knows nothing about the event loop.
"""

from __future__ import annotations

import msgspec

from async_rl.sim.parallel import Links

OFFLOADS = ("none", "optimizer", "all")
"""simulate.refit_offload: what the trainer moves to host memory while the engines
generate."""


class RefitStages(msgspec.Struct, frozen=True, kw_only=True):
    """Seconds of the parts of one time-shared turn (each device moving its share)."""

    engine_offload: float = 0.0
    """Release: the engine's weights to host memory (sleep level 1)."""
    trainer_onload: float = 0.0
    """Release: the trainer's offloaded state back from host memory."""
    trainer_offload: float = 0.0
    """Reload: the trainer's state to host memory."""
    reshard: float = 0.0
    """Reload: the training layout's slices gathered into the inference layout."""
    engine_onload: float = 0.0
    """Reload: the engine's weights back from host memory (sleep level 1)."""
    copy: float = 0.0
    """Reload: the new version copied into the engine's parameters."""
    release_given: float | None = None
    """engine_release_s when the hardware gives it: it replaces the derived release."""
    reload_given: float | None = None
    """engine_reload_s when the hardware gives it: it replaces the derived reload (the
    copy is paid besides)."""

    @property
    def release_s(self) -> float:
        if self.release_given is not None:
            return self.release_given
        return self.engine_offload + self.trainer_onload

    @property
    def reload_s(self) -> float:
        if self.reload_given is not None:
            return self.reload_given + self.copy
        return self.trainer_offload + self.reshard + self.engine_onload + self.copy

    @property
    def derived(self) -> bool:
        """The reload is derived (not given): the KV cache lost is recomputed."""
        return self.reload_given is None


def refit_stages(*, weight_bytes: float, trained_bytes: float, version_bytes: float,
                 optimizer_bytes: float, offload: str, sleep_level: int,
                 trainer_devices: int, holders: int, engine_devices: int,
                 host_bandwidth: float, memory_bandwidth: float, links: Links,
                 release_s: float | None = None, reload_s: float | None = None,
                 calls_s: float = 0.0) -> RefitStages:
    """The parts of one turn. ``weight_bytes``: the whole model at its dtype;
    ``trained_bytes``: the trained parameters at it (with LoRA, the adapters);
    ``optimizer_bytes``: the optimizer's state in all; ``trainer_devices``: devices the
    trainer spans (the engines span the same); ``holders``: those holding a distinct
    slice of its weights; ``memory_bandwidth``: one device's, achieved; ``calls_s``: a
    tensor-by-tensor update's calls (tensors x weight_tensor_s), paid with the copy."""
    assert offload in OFFLOADS and sleep_level in (1, 2), (offload, sleep_level)
    moved = 0.0
    if offload != "none":
        moved += optimizer_bytes / trainer_devices
    if offload == "all":
        moved += weight_bytes / max(min(holders, trainer_devices), 1)
    engine_share = weight_bytes / engine_devices if sleep_level == 1 else 0.0
    reshard = links.all_gather(trained_bytes, holders)
    return RefitStages(
        engine_offload=engine_share / host_bandwidth,
        trainer_onload=moved / host_bandwidth, trainer_offload=moved / host_bandwidth,
        reshard=reshard, engine_onload=engine_share / host_bandwidth,
        copy=version_bytes / (memory_bandwidth * engine_devices) + calls_s,
        release_given=release_s, reload_given=reload_s)
