"""The simulated weight path (``async_rl.control.protocols.WeightPath``) between trainer
shard 0 and the rollout engines.

Owns: ``SimWeights`` (a version's snapshot on shard 0, then one broadcast into every
engine, which pauses for it (but one already running it: started on lent devices
since); each engine's ``BroadcastTiming`` carries the version's bytes
as a real one does: the whole policy, or with LoRA its adapters alone) and the
published version it hands over (``SimPublished``). With run.colocate = "time" the
weights stay on the devices instead (``async_rl.sim.timeshare``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import anyio
import msgspec

from async_rl.control.protocols import PublishedWeights
from async_rl.sim.costs import Costs
from async_rl.sim.engine import SimEngine
from buffers.common.reports import BroadcastTiming


class SimPublished(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    publish_s: float


class SimWeights:
    """The weight path: snapshot, then one broadcast to every engine, which loads the
    version once it holds all of it. As the real collective, the broadcast begins once
    every engine has paused (an engine that paused early waits on the group: in drain
    mode, for the slowest drain); every engine stands paused for the whole wire
    (``Costs.transfer``), then for its load (``weight_load_s``)."""

    def __init__(self, engines: dict[int, SimEngine], costs: Costs,
                 bucket_bytes: float = 16 << 20) -> None:
        self.engines, self.costs, self.bucket_bytes = engines, costs, bucket_bytes

    async def publish(self, version: int) -> SimPublished:
        seconds = self.costs.publish()
        await anyio.sleep(seconds)
        return SimPublished(version=version, publish_s=seconds)

    async def deliver(self, published: PublishedWeights, ranks: Sequence[int]
                      ) -> tuple[list[BroadcastTiming], list[int]]:
        assert isinstance(published, SimPublished)
        # An engine started on lent devices since runs the version already.
        ranks = [r for r in ranks if self.engines[r].version < published.version]
        transfer = self.costs.transfer(len(ranks), self.bucket_bytes)
        load = self.costs.load()
        start: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        asked = {rank: self.engines[rank].load(published.version, transfer, load, start)
                 for rank in ranks}
        for loading in asked.values():
            await loading.paused
        start.set_result(None)  # every member paused: the collective's bytes flow
        timings = []
        for rank, loading in asked.items():
            await loading.done
            # As a real engine reports it: the wire, and the rest of the pause as load.
            timings.append(BroadcastTiming(
                version=published.version, rollout_rank=rank, publish_s=published.publish_s,
                transfer_s=transfer, pause_s=loading.waited,
                load_s=loading.done_at - loading.paused_at - transfer,
                bytes=round(self.costs.version_bytes)))
        return timings, []
