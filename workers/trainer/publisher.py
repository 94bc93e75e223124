"""The source trainer shard's end of weight broadcasts.

Owns: ``PolicyPublisher``: the ``WeightSender`` (made when the first rollout worker
connects, so vLLM is imported on the source shard only), what a version's snapshot holds
(every parameter, as the model's checkpoint names and lays it out:
``workers.trainer.engine_names``; with fsdp2 gathered bucket by bucket on every shard;
with LoRA the adapters only), and its sends and release. Knows nothing about training:
the shard hands it the module (and the adapters) in order with its training calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from workers.trainer.engine_names import engine_shapes, engine_weights
from workers.trainer.fsdp import gather_buckets
from workers.weights.config import UpdateMode, WeightsConfig

if TYPE_CHECKING:
    from workers.weights.broadcast import Delivery
    from workers.weights.sender import WeightSender


class PolicyPublisher:
    """One trainer shard's part in publishing versions (only shard 0 sends)."""

    def __init__(self, *, rank: int, weights: WeightsConfig, address: str,
                 device: torch.device, dtype: torch.dtype, sharded: bool) -> None:
        """``dtype``: the engines' (rollout.dtype): published weights are cast to it;
        ``sharded``: fsdp2, where every shard takes part in each snapshot's gather."""
        self.rank, self.weights, self.address = rank, weights, address
        self.device, self.dtype, self.sharded = device, dtype, sharded
        self.sender: WeightSender | None = None
        """Shard 0's end of weight broadcasts, from the first ``connect``."""
        self.shapes: list[tuple[str, torch.Size, torch.dtype]] | None = None
        """What a whole version holds (``engine_shapes``), from the first snapshot."""
        self.converts = True
        """Whether the checkpoint names or lays out any parameter otherwise than the
        model holds it (set with ``shapes``): where not, versions skip the conversion."""

    def connect(self, rank: int, actor: Any) -> None:
        """Makes rollout worker ``rank`` a member of the weight-broadcast group (at
        start-up, and when it is replaced)."""
        if self.sender is None:
            from workers.weights.sender import WeightSender

            self.sender = WeightSender(self.weights, address=self.address,
                                       device=self.device, dtype=self.dtype)
        self.sender.connect(rank, actor)

    def _connected(self) -> WeightSender:
        if self.sender is None:
            raise RuntimeError(f"trainer shard {self.rank}: no rollout worker connected")
        return self.sender

    def snapshot(self, version: int, module: torch.nn.Module,
                 adapters: dict[str, torch.Tensor] | None) -> int:
        """Copies ``module``'s weights (or, with LoRA, ``adapters``: {} on the shards
        that only took part in their gather) as ``version``; returns their bytes (0 on
        an fsdp2 shard that only takes part in the gather). With fsdp2 every shard
        gathers the weights with shard 0 bucket by bucket (``weights.bucket_mb``), and
        shard 0 copies each bucket into its snapshot before the next is gathered: no
        rank holds a second whole copy of the model."""
        if adapters is not None:  # the adapters only (docs/lora.md)
            return self._connected().snapshot(version, adapters.items()) if adapters else 0
        if not self.sharded:
            return self._connected().snapshot(
                version, self._as_engine_loads(module, module.named_parameters()),
                self._shapes(module))
        buckets = gather_buckets(module, self.weights.bucket_mb << 20)
        if self.rank != 0:
            for _ in buckets:
                pass  # taking part in each gather
            return 0
        return self._connected().snapshot(version, self._as_engine_loads(
            module, (pair for bucket in buckets for pair in bucket)), self._shapes(module))

    def _shapes(self, module: torch.nn.Module) -> list[tuple[str, torch.Size, torch.dtype]]:
        if self.shapes is None:
            self.shapes = engine_shapes(module)
            self.converts = [(name, shape) for name, shape, _ in self.shapes] != [
                (name, p.shape) for name, p in module.named_parameters()]
        return self.shapes

    def _as_engine_loads(self, module: torch.nn.Module,
                         named: Iterable[tuple[str, torch.Tensor]]
                         ) -> Iterable[tuple[str, torch.Tensor]]:
        """``named`` as the engine loads them: converted parameter by parameter only for
        a model whose checkpoint differs from memory (a dense model's pass through)."""
        self._shapes(module)
        return engine_weights(module, named) if self.converts else named

    def send(self, version: int, ranks: Sequence[int], mode: UpdateMode | None = None
             ) -> Delivery:
        """Makes the snapshot of ``version`` the policy of rollout workers ``ranks``, in
        one broadcast."""
        return self._connected().send(version, ranks, mode)

    def release(self, version: int) -> None:
        """Frees the snapshot of ``version`` (every send of it is done)."""
        self._connected().release(version)

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.shutdown()
