"""A weight version as the stages it passes through, each costed from its bytes and the
bandwidth it crosses.

Owns: ``VersionStages`` (seconds of each stage of one version: gather, convert, stage,
transfer, load) and ``VersionPath``, which costs them for simulate.weights_path:

- "direct" (buckets streamed from the trainer's devices: slime's and NeMo RL's NCCL path,
  this project's): no gather; a conversion only when the version's dtype is not the
  model's (each trainer device converts its slice); the snapshot in device memory
  (``publish_s`` plus the version's bytes at the memory bandwidth); the broadcast; the
  engine's fixed pause ``weight_load_s`` (each bucket is loaded as it arrives). These are
  the simulator's costs from before the stages, unchanged.
- "gathered" (verl's FSDP state dict: the whole state on one rank first): the state's
  bytes gathered onto one rank over the trainer's links (a ring all-gather among the
  devices holding a distinct slice: the node's links if they fit in one node, else the
  network's), converted on that rank (read the model's bytes, write the version's, at its
  memory bandwidth), staged in host memory over the host link (``publish_s`` plus the
  version's bytes at ``host_bandwidth``), broadcast as above, and loaded by each engine
  (``weight_load_s`` plus the version's bytes at its devices' memory bandwidth).
- "host" (Moonshot's checkpoint engine: the version registered in host memory): no
  gather and no device snapshot (``publish_s`` alone); each bucket is copied up to a
  device over its host link, then broadcast, the two pipelined, so the wire takes the
  slower of the version over one host link and the broadcast, plus one bucket through
  the faster (the pipeline's fill); the engine's fixed pause ``weight_load_s``.
- "p2p" (one-sided RDMA writes or NIXL pulls: Perplexity's, NeMo RL's and prime-rl's
  NIXL path, miles' P2P mode): every device of every receiving engine takes its own
  shard (the version over the engine's devices) at once, from the trainer's devices,
  straight from their memory: no gather, no snapshot and none of the fixed pauses
  (``publish_s``, ``weight_load_s``: those belong to a path that stages a copy and
  pauses the engine around a collective); a conversion only when the dtype changes
  (each trainer device its slice). The wire is the slower of a receiving device's
  shard over its NIC rails and every receiver's bytes over the senders' NICs, plus one
  message's latency; the load is the receiving engine's per-tensor calls alone.
- "stage_heads" (a Megatron trainer's NCCL path: miles', slime's): each pipeline
  stage's weights are all-gathered over the stage's ranks (tensor and expert parallel
  shards) onto its head rank, which broadcasts them to every device of every engine
  (each keeps its shard); the stages go in turn, each a gather then a chain broadcast of
  its part. No snapshot; the engine's fixed pause and its calls.
- "host_replica" (miles' P2P mode): each stage's weights are all-gathered over the
  stage's ranks as above, the stages at once; every rank of a stage serves its share of
  the engines' devices one by one, loading each target's part (the version over the
  stages and the engine's devices) into a replica of the target's shard in its host's
  pageable memory (``host_copy_bandwidth``: the copy off the device and the CPU's copy
  into the replica's tensors) and writing it over RDMA; the load is the calls alone.

A transfer over the network may stripe each device's share over several NIC rails
(``rails``: NCCL's channels over the node's NICs, a NIXL pull over several): at most the
node's rails (``nic_rails``) shared by the node's devices moving bytes at once; the
chain broadcast's hops each take ``rails`` times the link's bandwidth.

Whatever the path, a framework that moves a version tensor by tensor (an all-gather or a
broadcast call, a CUDA IPC handle, an engine's loader call per tensor: verl's and slime's
paths) pays ``tensor_s`` (the hardware's ``weight_tensor_s``) per tensor, ``tensors`` of
them (simulate.version_tensors, else counted from the model's layers and experts:
``version_tensors``), in the engine's load; buckets pay none (``tensor_s`` 0). A version
already at its bytes per parameter (``native``: an FP8 checkpoint served as FP8) is not
converted.

A version's bytes: the trained parameters (with LoRA the adapters) x
simulate.version_fraction (a delta or sparse version) x its bytes per parameter
(simulate.version_bytes_per_parameter: 1 for FP8). Knows nothing about the event loop.
"""

from __future__ import annotations

import msgspec

from async_rl.sim.parallel import Links

PATHS = ("direct", "gathered", "host", "p2p", "stage_heads", "host_replica")


class VersionStages(msgspec.Struct, frozen=True, kw_only=True):
    """Seconds of each stage of one version (the trainer pays the first three before its
    next step, the engines the last two while paused)."""

    gather: float = 0.0
    convert: float = 0.0
    stage: float = 0.0
    transfer: float = 0.0
    load: float = 0.0

    @property
    def trainer_s(self) -> float:
        return self.gather + self.convert + self.stage


class VersionPath:
    """The stages of ``path`` for a model of ``state_bytes`` (the trained parameters at the
    model's dtype) sent as ``version_bytes``, from a trainer whose weights are split over
    ``holders`` devices, into engines of ``engine_devices`` devices each."""

    def __init__(self, path: str, *, state_bytes: float, version_bytes: float, holders: int,
                 engine_devices: int, trainer_devices: int, links: Links,
                 memory_bandwidth: float, host_bandwidth: float, interconnect: float,
                 publish_s: float, load_s: float, member_s: float, native: bool = False,
                 tensors: int = 0, tensor_s: float = 0.0, rails: int = 1, nic_rails: int = 0,
                 pipeline_stages: int = 1, host_copy_bandwidth: float = 0.0) -> None:
        assert path in PATHS, path
        self.path, self.state_bytes, self.version_bytes = path, state_bytes, version_bytes
        self.holders, self.engine_devices = holders, engine_devices
        self.trainer_devices, self.links = trainer_devices, links
        self.memory_bandwidth, self.host_bandwidth = memory_bandwidth, host_bandwidth
        self.interconnect, self.publish_s = interconnect, publish_s
        self.load_s, self.member_s = load_s, member_s
        self.native, self.tensors, self.tensor_s = native, tensors, tensor_s
        self.rails, self.nic_rails = rails, nic_rails
        self.pipeline_stages = max(1, pipeline_stages)
        """The trainer's pipeline stages (its layout's pp)."""
        self.host_copy_bandwidth = host_copy_bandwidth or host_bandwidth

    @property
    def stage_ranks(self) -> int:
        """Trainer devices holding one pipeline stage's weights."""
        return max(1, self.trainer_devices // self.pipeline_stages)

    def stage_gather(self) -> float:
        """One pipeline stage's weights all-gathered over its ranks (each receives
        ``(n-1)/n`` of them) over the slowest link the group crosses."""
        return self.links.all_gather(self.state_bytes / self.pipeline_stages, self.stage_ranks)

    @property
    def gathered(self) -> bool:
        return self.path == "gathered"

    def rails_used(self, busy: int) -> int:
        """NIC rails one device's bytes stripe over while ``busy`` devices of its node move
        bytes at once: ``rails``, at most its share of the node's ``nic_rails`` (0: one
        rail a device, ``links.per_node`` a node), and at least one."""
        node = self.nic_rails or self.links.per_node
        return max(1, min(self.rails, node // max(1, min(busy, self.links.per_node))))

    def gather(self) -> float:
        """The state onto one rank: a ring all-gather among its ``holders`` (each receives
        ``(n-1)/n`` of it) over the slowest link the ring crosses; on the stage paths,
        each pipeline stage's part over its own ranks."""
        if self.path == "stage_heads":  # the stages in turn
            return self.pipeline_stages * self.stage_gather()
        if self.path == "host_replica":  # the stages at once
            return self.stage_gather()
        return self.links.all_gather(self.state_bytes, self.holders) if self.gathered else 0.0

    def convert(self) -> float:
        """Reading the model's bytes and writing the version's: on the gathering rank, or
        (direct) on every trainer device for its slice, and only when the dtype changes."""
        if self.native:
            return 0.0
        if self.gathered:
            return (self.state_bytes + self.version_bytes) / self.memory_bandwidth
        if self.version_bytes == self.state_bytes:
            return 0.0
        return (self.state_bytes + self.version_bytes) / (
            self.memory_bandwidth * self.trainer_devices)

    def stage(self) -> float:
        """The snapshot: in device memory (direct) or in host memory (gathered); the host
        path's version is in host memory already (its copies up are the transfer's)."""
        if self.path in ("p2p", "host_replica", "stage_heads"):  # sent from live weights
            return 0.0
        if self.path == "host":
            return self.publish_s
        bandwidth = self.host_bandwidth if self.gathered else self.memory_bandwidth
        return self.publish_s + self.version_bytes / bandwidth

    def transfer(self, receivers: int, bucket_bytes: float) -> float:
        """A pipelined chain broadcast to ``receivers`` engines in ``bucket_bytes``
        buckets: every link carries the version once and the last engine holds the last
        bucket ``receivers - 1`` bucket times after the first:
        ``(S + (N - 1) B) / bandwidth + N m``."""
        if self.path == "p2p":
            return self.pulls(receivers)
        if self.path == "host_replica":
            return self.replica_writes(receivers)
        if self.path == "stage_heads":
            return self.stage_broadcasts(receivers, bucket_bytes)
        bucket = min(bucket_bytes, self.version_bytes)
        # A chain's hops cross nodes one at a time: each may take the node's rails.
        link = self.interconnect * self.rails_used(1)
        wire = ((self.version_bytes + (receivers - 1) * bucket) / link
                + receivers * self.member_s)
        if self.path != "host":
            return wire
        # Host to device and the broadcast, pipelined: the slower bounds, one bucket fills.
        up = self.version_bytes / self.host_bandwidth
        return max(up, wire) + bucket / max(self.host_bandwidth, link)

    def pulls(self, engines: int) -> float:
        """Point to point: each of the ``engines`` x ``engine_devices`` receiving devices
        takes its shard over its rails while every device of its node pulls, and the
        ``trainer_devices`` senders send every receiver's bytes over theirs, at once; the
        slower bounds, plus one message across nodes."""
        nic = self.links.inter_bandwidth
        shard = self.version_bytes / self.engine_devices
        receive = shard / (nic * self.rails_used(self.engine_devices))
        send = engines * self.version_bytes / (
            self.trainer_devices * nic * self.rails_used(self.trainer_devices))
        return max(receive, send) + self.links.inter_latency

    def stage_broadcasts(self, receivers: int, bucket_bytes: float) -> float:
        """Each stage's part broadcast from its head rank to every device of the
        ``receivers`` engines (``N`` members) in a pipelined chain, the stages in turn:
        ``pp ((S / pp + (N - 1) B) / bandwidth + N m)``."""
        part = self.version_bytes / self.pipeline_stages
        members = receivers * self.engine_devices
        bucket = min(bucket_bytes, part)
        link = self.interconnect * self.rails_used(1)
        one_stage = (part + (members - 1) * bucket) / link + members * self.member_s
        return self.pipeline_stages * one_stage

    def replica_writes(self, receivers: int) -> float:
        """Each rank of a stage serves ``k = ceil(N / ranks)`` of the ``N`` receiving
        devices one by one: the target's part (``S / (pp x engine devices)``) copied into
        the host replica, then written over the NIC; plus one message across nodes."""
        targets = -(-receivers * self.engine_devices // self.stage_ranks)
        part = self.version_bytes / (self.pipeline_stages * self.engine_devices)
        nic = self.links.inter_bandwidth * self.rails_used(self.stage_ranks)
        return (targets * part * (1 / self.host_copy_bandwidth + 1 / nic)
                + self.links.inter_latency)

    def load(self) -> float:
        """An engine's pause beyond the wire: fixed, and (gathered) the version copied
        into its parameters at its devices' memory bandwidth; a tensor-by-tensor
        framework's calls (``tensors`` x ``tensor_s``)."""
        calls = self.tensors * self.tensor_s
        if self.path in ("p2p", "host_replica"):  # no collective to pause around
            return calls
        if not self.gathered:
            return self.load_s + calls
        return (self.load_s + calls
                + self.version_bytes / (self.memory_bandwidth * self.engine_devices))

    def stages(self, receivers: int, bucket_bytes: float) -> VersionStages:
        return VersionStages(gather=self.gather(), convert=self.convert(), stage=self.stage(),
                             transfer=self.transfer(receivers, bucket_bytes), load=self.load())


def version_tensors(*, layers: int, moe_layers: int, experts: int, dense_mlp: bool = True
                    ) -> int:
    """Tensors of a decoder's state dict as a version carries them: per layer the four
    attention projections and two norms; per MoE layer each expert's three matrices and
    the router; per dense layer its three MLP matrices (``dense_mlp``); the embeddings,
    the final norm and the output head (0 layers: 0, unknown)."""
    if layers <= 0:
        return 0
    dense = (layers - moe_layers) * 3 if dense_mlp else 0
    return layers * 6 + moe_layers * (experts * 3 + 1) + dense + 3
