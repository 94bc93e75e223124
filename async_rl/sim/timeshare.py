"""Time-shared devices in the simulator (run.colocate = "time").

Owns: what changes when rollout engines and trainer shards take turns on the same
devices, as verl's hybrid engine does (and a one-GPU user must): ``check_time_shared``
(the two roles must span the same devices), ``SimLocalWeights``, the weight path of
such a run: no snapshot to send, no bytes over the interconnect, each engine only told
its new version, and ``refit_record``: a turn's costs as sim.json keeps them. The
hand-over itself is ``SimTraining``'s (before a step every engine releases its devices,
after it each takes them back and reloads: ``SimEngine.release``). Knows nothing about
the orchestrator's rules.
"""

from __future__ import annotations

from collections.abc import Sequence

from async_rl.config import Config
from async_rl.control.protocols import PublishedWeights
from async_rl.sim.costs import Costs
from async_rl.sim.engine import SimEngine
from async_rl.sim.weight_path import SimPublished
from buffers.common.config import ConfigError
from buffers.common.reports import BroadcastTiming


def time_shared(config: Config) -> bool:
    return config.run.colocate == "time"


def check_time_shared(config: Config, costs: Costs) -> None:
    """Engines and shards of a time-shared run must cover the same devices."""
    h = costs.hardware
    engines = config.rollout.num_workers * h.devices_per_rollout_worker
    shards = config.trainer.num_shards * h.devices_per_trainer_shard
    if engines != shards:
        raise ConfigError(
            f'config error: run.colocate = "time": the rollout engines span {engines} '
            f"devices (rollout.num_workers x devices_per_rollout_worker) and the trainer "
            f"shards {shards} (trainer.num_shards x devices_per_trainer_shard): "
            "time-shared roles take turns on the same devices")


def refit_record(costs: Costs) -> dict[str, float]:
    """One turn's seconds for sim.json: ``release`` and ``reload`` in all, and the parts
    of each that was derived (``async_rl.sim.refit``; a side the hardware gives has
    none)."""
    r = costs.refit
    parts: dict[str, float] = {"release": r.release_s, "reload": r.reload_s}
    if r.release_given is None:
        parts |= {"engine_offload": r.engine_offload, "trainer_onload": r.trainer_onload}
    if r.reload_given is None:
        parts |= {"trainer_offload": r.trainer_offload, "reshard": r.reshard,
                  "engine_onload": r.engine_onload}
    return parts | {"copy": r.copy}


class SimLocalWeights:
    """The weight path of time-shared devices: the engines copied the new weights in
    device memory when they took their devices back (``Costs.reload``); a version only
    tells each engine its number."""

    def __init__(self, engines: dict[int, SimEngine]) -> None:
        self.engines = engines

    async def publish(self, version: int) -> SimPublished:
        return SimPublished(version=version, publish_s=0.0)

    async def deliver(self, published: PublishedWeights, ranks: Sequence[int]
                      ) -> tuple[list[BroadcastTiming], list[int]]:
        assert isinstance(published, SimPublished)
        asked = {rank: self.engines[rank].load(published.version, 0.0, 0.0)
                 for rank in ranks}
        timings = []
        for rank, loading in asked.items():
            await loading.done
            timings.append(BroadcastTiming(
                version=published.version, rollout_rank=rank, publish_s=0.0,
                transfer_s=0.0, pause_s=loading.waited, load_s=0.0))
        return timings, []
