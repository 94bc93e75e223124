"""A hardware file: one accelerator type's few physical parameters and how well the stack
uses it (all per device).

Owns: ``Hardware`` (the keys of a file; the shipped ones are in
``async_rl/sim/hardware/``), ``load_hardware`` (a file by path, or a shipped one by name)
and ``hardware_toml`` (what ``load_hardware`` reads back). The seconds each piece of work
takes on it are ``async_rl.sim.costs``'s.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import msgspec

from buffers.common.config import ConfigError

SHIPPED = Path(__file__).parent / "hardware"
"""The shipped hardware files: cpu.toml (calibrated here), h100, h200, a100, h20."""
class Hardware(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One accelerator type and how well the stack uses it (all per device)."""

    name: str
    devices_per_rollout_worker: int = 1
    """Devices one rollout engine spans (tensor parallel): its FLOP/s and bandwidth add."""
    devices_per_trainer_shard: int = 1
    """Devices one data-parallel trainer shard spans."""
    peak_flops: float
    """Dense FLOP/s of one device at the compute dtype."""
    memory_bandwidth: float
    """Bytes/s of one device's memory."""
    interconnect_bandwidth: float
    """Bytes/s of one device's link: between a trainer and a rollout engine, and
    between trainer shards."""
    train_mfu: float
    """Achieved / peak FLOP/s in training."""
    moe_train_mfu: float = 0.0
    """Achieved / peak FLOP/s in training a mixture of experts (its experts' grouped GEMMs
    over a few tokens each, the tokens' permutation, the router: Megatron-Core reaches
    167-276 TFLOP/s per H100 in BF16 on Qwen3-235B-A22B, 0.17-0.28 of peak, where dense
    models reach 0.4 and more); 0: train_mfu. The expert-parallel all-to-alls are the
    parallelism model's (``async_rl.sim.parallel``), not this."""
    decode_mfu: float
    """Achieved / peak FLOP/s in decode and prefill."""
    memory_efficiency: float = 0.8
    """Achieved / peak memory bandwidth in decode."""
    device_memory: float = 0.0
    """Bytes of one device's memory: with rollout.memory_fraction, the weights and the
    KV bytes per token, what bounds an engine's KV cache (0: not bounded)."""
    engine_release_s: float | None = None
    """run.colocate = "time": fixed seconds an engine takes to release its devices to a
    training step (vLLM's sleep: its KV cache freed, its weights kept or offloaded).
    Not given: derived from the bytes the turn moves (``async_rl.sim.refit``)."""
    engine_reload_s: float | None = None
    """run.colocate = "time": fixed seconds an engine takes to take its devices back
    after the step (wake up, the KV cache allocated anew), besides copying the new
    weights in device memory. Not given: derived (``async_rl.sim.refit``)."""
    decode_step_s: float = 0.0
    """Fixed seconds per engine step (scheduling, sampling, launches)."""
    micro_batch_s: float = 0.0
    """Fixed seconds per training micro-batch."""
    update_s: float = 0.0
    """Fixed seconds per optimizer update (the optimizer step, the step's calls)."""
    publish_s: float = 0.0
    """Fixed seconds of a weight snapshot on trainer shard 0."""
    weight_load_s: float = 0.0
    """Fixed seconds an engine stands paused for a weight update."""
    weight_member_s: float = 0.0
    """Fixed seconds each engine adds to a version's broadcast (its hop of the chain: a
    message's latency, its share of the group's calls)."""
    weight_tensor_s: float = 0.0
    """Fixed seconds per tensor of a weight version that the framework moves one by one (a
    gather or broadcast call, a CUDA IPC handle, an engine's loader call per tensor: verl's
    and slime's paths), paid in the engine's load; 0: buckets, nothing per tensor."""
    call_s: float = 0.0
    """Fixed seconds of every call to a worker (the driver's round trip)."""
    cores: int = 0
    """A CPU machine's cores, handed out as a real run hands them out (the run's roster,
    ``async_rl.roster``): a rollout engine and a trainer shard given the same core take
    turns on it while both are busy. 0: every worker owns its devices."""
    engine_processes: float = 1.0
    """Runnable processes of a busy rollout engine on a CPU machine (vLLM's AsyncLLM: its
    engine core and its front end, which turns each step's tokens into outputs): a core
    an engine shares with a trainer shard gives the engine this many shares of it and
    the shard one, as the OS scheduler shares a core between runnable processes."""
    contention: float = 0.0
    """How much slower a trainer shard computes for each rollout engine busy on other
    cores of its machine (a shared memory bus and caches): 0.5 is 1.5x beside one busy
    engine. 0 for accelerators, which own their memory. Calibration fits it unless the
    base file gives it (then it is the machine's figure, kept)."""
    devices_per_node: int = 8
    """Devices one node holds: a group of devices that fits in one crosses the node's links
    (intra_node_*), a larger one the network's (inter_node_*)."""
    intra_node_bandwidth: float = 0.0
    """Bytes/s one device sends to the others of its node (NVLink); 0: interconnect_bandwidth."""
    intra_node_latency: float = 0.0
    """Seconds of one small collective within a node (its latency, whatever its bytes)."""
    inter_node_bandwidth: float = 0.0
    """Bytes/s one device sends to other nodes (its NIC); 0: interconnect_bandwidth."""
    nic_rails: int = 0
    """NICs (rails) of one node on the network, each at inter_node_bandwidth: how many a
    weight transfer may stripe one device's bytes over (simulate.weights_rails); 0: one
    a device (devices_per_node)."""
    inter_node_latency: float = 0.0
    """Seconds of one small collective across nodes."""
    host_bandwidth: float = 0.0
    """Bytes/s between one device and its host's memory (PCIe): staging a gathered weight
    version, offloading and reloading a time-shared turn's state; 0: memory_bandwidth."""
    host_copy_bandwidth: float = 0.0
    """Bytes/s of one device's copies into a replica of an engine's shard in its host's
    pageable memory (the copy off the device, then the CPU's copy into the replica's
    tensors): simulate.weights_path = "host_replica"; 0: host_bandwidth."""
    sources: tuple[str, ...] = ()
    """Where the figures come from (data sheets, papers, a calibration run)."""


def load_hardware(name_or_path: str) -> Hardware:
    """A hardware file by path, or a shipped one by name (``cpu``, ``h100``, ...)."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = SHIPPED / f"{name_or_path}.toml"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in SHIPPED.glob("*.toml")))
        raise ConfigError(f"config error: simulate.hardware = {name_or_path!r}: no such file "
                          f"(shipped: {shipped})")
    try:
        return msgspec.convert(tomllib.loads(path.read_text()), Hardware)
    except (tomllib.TOMLDecodeError, msgspec.ValidationError) as err:
        raise ConfigError(f"config error: simulate.hardware = {name_or_path!r}: {err}") from None


def hardware_toml(hardware: Hardware) -> str:
    """The file ``load_hardware`` reads back."""
    lines = []
    for name in Hardware.__struct_fields__:
        value = getattr(hardware, name)
        if value is None:  # not given: TOML has no null
            continue
        lines.append(f"{name} = {json.dumps(list(value) if isinstance(value, tuple) else value)}")
    return "\n".join(lines) + "\n"
