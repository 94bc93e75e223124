"""The weights section: how versioned weights travel from the trainer to the engines.

Owns: ``WeightsConfig``, the update modes (``UpdateMode``), the KV policies (``KvPolicy``)
and ``check_transport``, the one weights rule that needs to know the hardware. Knows
nothing about TOML or the other sections.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from buffers.common.config import ConfigError, Positive, PositiveFloat

UpdateMode = Literal["in_flight", "drain"]
"""in_flight: pause (keep requests), load, resume; drain: finish running requests first."""
KvPolicy = Literal["keep", "recompute"]
"""What an in-flight update does with the KV cache its running requests hold
(docs/algorithm.md, "The KV cache across an in-flight update")."""


class WeightsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Versioned weight broadcast from the trainer to the rollout workers."""

    sync_every: Positive = 1
    """Publish new weights every this many optimizer steps."""
    update_mode: UpdateMode = "in_flight"
    """in_flight: pause (keep requests), load, resume; drain: finish running requests first."""
    kv_policy: KvPolicy = "keep"
    """keep: a request running through an in-flight update goes on with the keys and
    values its earlier tokens got under the old weights (no recompute; its later tokens
    are sampled from the new weights over that cache); with prefix caching each request's
    blocks are salted by the version it started under, so no later request reuses an
    older version's. recompute: the pause drops every KV block: running requests are
    preempted and rebuild their cache (prompt and tokens so far) under the new weights
    before they go on, and the prefix cache starts empty. Either way each token's
    behaviour log-prob is that of the distribution it was sampled from and its version
    that of the weights that sampled it."""
    transport: Literal["gloo", "nccl", "ipc"] = "gloo"
    """How the weights travel from trainer shard 0 to the rollout engines, through vLLM's
    weight-transfer API: one broadcast group of shard 0 and every engine, one collective
    per version. gloo: a torch.distributed gloo group over TCP, on any hardware (the CPU
    default; a pipelined chain: each engine passes every bucket on to the next). nccl:
    vLLM's NCCL engine (CUDA). ipc: vLLM's CUDA IPC engine, for a rollout engine on the
    trainer's own GPU (needs run.colocate, one rollout worker and one trainer shard)."""
    bucket_mb: Positive = 16
    """Largest message of a transfer, in MiB: tensors are packed into buckets of at most
    this size (gloo cuts larger tensors into pieces; nccl and ipc pack per buffer). On
    gloo 8-16 measured best here (bench/weights/weight_broadcast.py): larger receive buffers come
    fresh from the kernel at every update, smaller ones cost more messages."""
    shared_memory: bool = True
    """gloo: rollout engines on trainer shard 0's machine read each version from one
    shared-memory segment the shard writes once (a small message tells each one it is
    there), instead of the TCP chain, so what a version costs them does not grow with
    their number; engines elsewhere stay in the chain. The segment holds one version
    (falls back to the chain when /dev/shm has no room for it). false: every engine in
    the chain."""
    timeout_s: PositiveFloat = 300.0
    """Longest a weight update waits on a rollout worker for any one step (its pause,
    including a drain, a message, the load): a dead or stuck engine fails the broadcast
    within it, and the others take the version again over a group without it. With
    transport "nccl" or "ipc" also the longest the group's rendezvous and a whole send
    may each take on the trainer's side (their collectives have no deadline of their
    own): an engine that never joins the group is lost when it passes."""


def check_transport(weights: WeightsConfig, *, cuda: bool) -> None:
    """Refuses a CUDA-only ``weights.transport`` when the workers have no GPU (the one
    rule that needs to know the hardware: called once the cluster is known)."""
    if weights.transport != "gloo" and not cuda:
        raise ConfigError(f"config error: weights.transport = {weights.transport!r}: needs "
                          'CUDA GPUs, and the workers have none; use "gloo" on CPU')
