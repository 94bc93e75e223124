"""The started actors as the orchestrator's ``Workers``, and a lost rollout worker replaced.

Owns: ``adapt`` (every started actor wrapped in its adapter of
``async_rl.shell.adapters``, trainer shard 0 told its peers, the roles' own workers
handed to the shards, a restart function for lost rollout workers) and
``restart_rollout`` (a new actor on the same cores, started from the run's policy and
joined to the weight group in the old one's place). Knows nothing about the run's logic.
"""

from __future__ import annotations

import dataclasses

import msgspec
import ray

from async_rl.config import Config
from async_rl.control.protocols import OwnRoles, Workers
from async_rl.shell.adapters import RayEvaluator, RayRollout, RayTrainer, RayWeights
from async_rl.shell.launch import StartedWorkers
from async_rl.shell.object_store import RayTokens
from workers.model_config import ModelConfig


async def restart_rollout(started: StartedWorkers, source: RayTrainer, rank: int,
                          model: ModelConfig, version: int, config: Config) -> RayRollout:
    """Replaces rollout worker ``rank`` (dead or broken) by a new one on the same cores,
    started from ``model`` labelled ``version`` and made a member of the weight group of
    ``source`` (trainer shard 0) in its place (it joins at the next version). Both calls
    have their deadlines (``RayRollout.start``, ``RayTrainer.connect_rollout``); a
    replacement that fails to start is killed, freeing its cores."""
    assert started.new_rollout is not None
    old = started.rollout.pop(rank, None)
    if old is not None:
        ray.kill(old)  # a broken worker may still hold its engine and cores
    handle = started.new_rollout(rank, model, version, "")  # the old name may linger
    worker = RayRollout(f"rollout-{rank}", handle, config)
    try:
        worker.pid = await worker.start()
    except BaseException:  # failed, timed out or cancelled
        ray.kill(handle)
        raise
    await source.connect_rollout(rank, handle)
    started.rollout[rank] = handle
    return worker


def adapt(started: StartedWorkers, config: Config, own: OwnRoles | None = None) -> Workers:
    """The started actors as the orchestrator's protocols; ``own``: the roles' workers
    of their own, already adapted (``async_rl.shell.role_adapters``)."""

    trainers = [RayTrainer(rank, handle, config)
                for rank, handle in enumerate(started.trainers)]

    async def restart(rank: int, model_dir: str, version: int) -> RayRollout:
        model = msgspec.structs.replace(config.model, path=model_dir)
        return await restart_rollout(started, trainers[0], rank, model, version, config)
    # fsdp2: shard 0's client gathers the whole policy from every shard, as its
    # broadcasts do; ddp: replicas.
    assert started.broadcast is not None
    trainers[0].peers = trainers[1:] if started.broadcast.gather_from else []
    own = own or OwnRoles()
    if own.workers:  # every shard takes its share of the roles' outputs
        own = dataclasses.replace(own, shards=[*trainers])
    for trainer in trainers:
        trainer.critics = own.critics
    return Workers(
        rollout={rank: RayRollout(f"rollout-{rank}", handle, config)
                 for rank, handle in started.rollout.items()},
        trainers=[*trainers],
        weights=RayWeights(started.broadcast),
        evaluator=(RayEvaluator("evaluator", started.evaluator, config)
                   if started.evaluator is not None else None),
        restart_rollout=restart,
        stages=[*trainers] if config.has_reference or config.has_critic else [],
        own=own,
        tokens=RayTokens(config.run.call_timeout_s),
    )
