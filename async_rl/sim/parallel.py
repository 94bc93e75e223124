"""The simulator's parallelism model: how an engine and a trainer replica span their
devices, and the collectives each layout costs per layer.

Owns: ``Layout`` (tp, pp, cp, ep of one engine or one trainer replica, resolved from
simulate.rollout_layout / trainer_layout), ``Links`` (a hardware file's intra-node and
inter-node bandwidth and latency: which a group of devices crosses), the collectives'
formulas (``all_reduce``, ``all_to_all``) and ``Collectives``: the seconds a layout adds to
a decode step, a prefill token and a training micro-batch's token, from the model's layers,
hidden size, MoE layers and experts per token (``Dims``). Without a layout (none of its keys
given) nothing is added: the devices' FLOP/s and bandwidth add up and talk for free, as
before. Knows nothing about the orchestrator or the event loop.

Per layer (``b``: bytes of an activation element, ``h``: hidden size, ``k``: experts per
token, ``L``: layers, ``M``: MoE layers, each stage of a pipeline holding 1/pp of them):

- tensor parallel: 2 all-reduces of the layer's activations in a forward (after
  attention, after the MLP), 2 more in the backward;
- expert parallel: 2 all-to-alls per MoE layer in a forward (dispatch to the experts,
  combine), 2 more in the backward; each device sends its tokens' ``k x h x b`` bytes;
- context parallel: a ring of K/V blocks per layer: each device receives ``(cp-1)/cp``
  of the sequence's K/V in the forward, twice that in the backward;
- pipeline parallel: the stages work on different micro-batches (or batches of
  sequences) at once, so a replica's time per micro-batch is one stage's: its L/pp
  layers' collectives and one hop of its activations to the next stage a forward (one
  more a backward); the bubble is not counted;
- activation recompute ("full") runs every forward's collectives once more.
"""

from __future__ import annotations

import msgspec

from buffers.common.config import ConfigError

FORWARD_TP, BACKWARD_TP = 2, 2
"""All-reduces per layer of a tensor-parallel forward, and of its backward."""
FORWARD_A2A, BACKWARD_A2A = 2, 2
"""All-to-alls per MoE layer of an expert-parallel forward (dispatch, combine), and of
its backward."""
FORWARD_CP, BACKWARD_CP = 1, 2
"""K/V rings per layer of a context-parallel forward, and of its backward (K/V again and
their gradients)."""


class Layout(msgspec.Struct, frozen=True, kw_only=True):
    """One engine's or one trainer replica's layout (every size at least 1)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    expert_stride: int = 1
    """Devices between two members of an expert-parallel group (Megatron: tp; vLLM: 1)."""
    given: bool = False
    """False: no layout was given; its collectives cost nothing."""

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.cp


def rollout_layout(tp: int, pp: int, ep: int, devices: int) -> Layout:
    """simulate.rollout_layout (0: not given); ``devices``: devices_per_rollout_worker."""
    if not (tp or pp or ep):
        return Layout(tp=devices)
    layout = Layout(tp=tp or 1, pp=pp or 1, ep=ep or 1, given=True)
    if layout.ep > layout.devices:
        raise ConfigError(f"config error: simulate.rollout_layout.ep = {ep}: more than the "
                          f"engine's {layout.devices} devices (tp x pp)")
    return layout


def trainer_layout(tp: int, pp: int, cp: int, ep: int, dp: int, devices: int,
                   shards: int) -> Layout:
    """simulate.trainer_layout (0: not given); ``devices``: devices_per_trainer_shard."""
    if not (tp or pp or cp or ep or dp):
        return Layout(tp=devices)
    if dp and dp != shards:
        raise ConfigError(f"config error: simulate.trainer_layout.dp = {dp}: the trainer has "
                          f"trainer.num_shards = {shards} data-parallel replicas")
    layout = Layout(tp=tp or 1, pp=pp or 1, cp=cp or 1, ep=ep or 1, expert_stride=tp or 1,
                    given=True)
    if layout.ep * layout.expert_stride > layout.devices * shards:
        raise ConfigError(f"config error: simulate.trainer_layout.ep = {ep}: its group spans "
                          f"ep x tp = {layout.ep * layout.expert_stride} devices, more than "
                          f"the trainer's {layout.devices * shards}")
    return layout


class Links(msgspec.Struct, frozen=True, kw_only=True):
    """A node's devices and the two kinds of link between devices."""

    per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float

    def crossed(self, span: int) -> tuple[float, float]:
        """(bandwidth, latency) of a group spanning ``span`` consecutive devices: a node's
        links (NVLink) if it fits in one, else the network's (each device its NIC)."""
        if span <= self.per_node:
            return self.intra_bandwidth, self.intra_latency
        return self.inter_bandwidth, self.inter_latency

    def all_gather(self, size: float, members: int) -> float:
        """A ring all-gather of ``size`` bytes among ``members`` consecutive devices: each
        receives ``(n-1)/n`` of them over the slowest link the group crosses, plus one
        small collective's latency; nothing for one member."""
        if members <= 1:
            return 0.0
        bandwidth, latency = self.crossed(members)
        return (members - 1) / members * size / bandwidth + latency


def all_reduce(size: float, members: int, bandwidth: float, latency: float) -> float:
    """A ring all-reduce of ``size`` bytes among ``members``: each sends and receives
    ``2 (n-1)/n`` of them, plus one small collective's latency."""
    if members <= 1:
        return 0.0
    return 2 * (members - 1) / members * size / bandwidth + latency


def all_to_all(size: float, members: int, span: int, links: Links) -> float:
    """An all-to-all in which each of ``members`` devices (spread evenly over ``span``
    consecutive devices) sends ``size`` bytes spread evenly over the group: the share for
    members on its node crosses the node's links, the rest the network, both at once."""
    if members <= 1:
        return 0.0
    on_node = min(members, max(1, members * links.per_node // span))  # itself included
    local = size * (on_node - 1) / members
    remote = size * (members - on_node) / members
    seconds = max(local / links.intra_bandwidth, remote / links.inter_bandwidth)
    return seconds + (links.inter_latency if on_node < members else links.intra_latency)


class Dims(msgspec.Struct, frozen=True, kw_only=True):
    """The model's shape as the collectives need it (0: unknown, those terms not counted)."""

    layers: int = 0
    hidden: int = 0
    moe_layers: int = 0
    experts_per_token: int = 0
    kv_bytes_per_token: float = 0.0
    """Over every layer (K and V)."""
    activation_bytes: float = 2.0


class Collectives:
    """Seconds a layout's collectives add to decode, prefill and training (see the module
    docstring); every term 0 without a layout."""

    def __init__(self, dims: Dims, links: Links, rollout: Layout, trainer: Layout,
                 *, recompute: bool = False) -> None:
        self.dims, self.links, self.rollout, self.trainer = dims, links, rollout, trainer
        self.recompute = recompute
        none = (0.0, 0.0)
        self.decode_fixed_s, self.decode_token_s = self._decode() if rollout.given else none
        """A decode step's latencies, and its seconds per running sequence (a prefill's
        per token)."""
        self.train_fixed_s, self.train_token_s = self._train() if trainer.given else none
        """A training micro-batch's latencies, and its seconds per token."""

    def _decode(self) -> tuple[float, float]:
        """Per step of one token per sequence: a stage's tensor-parallel all-reduces and
        MoE all-to-alls, and its hop to the next stage."""
        d, lay, links = self.dims, self.rollout, self.links
        token = d.hidden * d.activation_bytes
        layers, moe_layers = d.layers / lay.pp, d.moe_layers / lay.pp
        fixed = per_token = 0.0
        if lay.tp > 1:
            bandwidth, latency = links.crossed(lay.tp)
            calls = FORWARD_TP * layers
            fixed += calls * latency
            per_token += calls * all_reduce(token, lay.tp, bandwidth, 0.0)
        if lay.ep > 1:
            calls = FORWARD_A2A * moe_layers
            span = lay.ep * lay.expert_stride
            # An engine's sequences are split over its ep devices for the dispatch.
            empty = all_to_all(0.0, lay.ep, span, links)
            fixed += calls * empty
            per_token += calls * (all_to_all(d.experts_per_token * token / lay.ep, lay.ep,
                                             span, links) - empty)
        if lay.pp > 1:
            bandwidth, latency = links.crossed(lay.devices)
            fixed += latency
            per_token += token / bandwidth
        return fixed, per_token

    def _train(self) -> tuple[float, float]:
        """Per micro-batch of a replica: one stage's collectives (L/pp layers) on the
        tokens each of its devices holds, forward and backward."""
        d, lay, links = self.dims, self.trainer, self.links
        token = d.hidden * d.activation_bytes
        layers, moe_layers = d.layers / lay.pp, d.moe_layers / lay.pp
        tp_calls = (FORWARD_TP * (1 + self.recompute) + BACKWARD_TP) * layers
        a2a_calls = (FORWARD_A2A * (1 + self.recompute) + BACKWARD_A2A) * moe_layers
        cp_calls = (FORWARD_CP * (1 + self.recompute) + BACKWARD_CP) * layers
        fixed = per_token = 0.0
        if lay.tp > 1:  # each device holds the tokens of its cp share
            bandwidth, latency = links.crossed(lay.tp)
            fixed += tp_calls * latency
            per_token += tp_calls * all_reduce(token / lay.cp, lay.tp, bandwidth, 0.0)
        if lay.ep > 1:  # sequence parallel: each device routes 1/(tp cp) of the tokens
            span = lay.ep * lay.expert_stride
            empty = all_to_all(0.0, lay.ep, span, links)
            fixed += a2a_calls * empty
            per_token += a2a_calls * (all_to_all(
                d.experts_per_token * token / (lay.tp * lay.cp), lay.ep, span, links) - empty)
        if lay.cp > 1 and d.layers:  # K/V split over tp's devices; each receives (cp-1)/cp
            bandwidth, latency = links.crossed(lay.cp * lay.tp)
            kv_layer = d.kv_bytes_per_token / d.layers / lay.tp
            fixed += cp_calls * latency
            per_token += cp_calls * (lay.cp - 1) / lay.cp * kv_layer / bandwidth
        if lay.pp > 1:
            bandwidth, latency = links.crossed(lay.devices)
            fixed += 2 * latency
            per_token += 2 * token / (lay.tp * lay.cp) / bandwidth
        return fixed, per_token
