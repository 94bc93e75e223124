"""The reference and the critic on workers of their own (placement "own"): their actors.

Owns: which roles a run places on their own (``own_roles``), creating those actors in a
placement group of their own with trainer.cpus_per_shard cores each (on cores after the
trainer shards', ``workers.layout.own_role_identities``; one GPU each on a GPU cluster),
the critic workers' own process group address, and their identities for the registry
once started (``OwnRoleActors.started``). Part of the Ray shell:
``async_rl.shell.launch`` calls it beside the rollout and trainer actors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import ray
from ray.util.placement_group import PlacementGroup

from async_rl.config import Config
from workers.actors import CriticActor, ReferenceActor
from workers.common.ports import free_port
from workers.layout import Layout, Role, WorkerIdentity, own_role_identities
from workers.placement import bundle_node, in_bundle, own_roles_placement_group
from workers.rollout.config import Sampling


def own_roles(cfg: Config) -> list[tuple[Role, int]]:
    """The roles the run places on workers of their own, with their worker counts."""
    roles: list[tuple[Role, int]] = []
    if cfg.has_reference and cfg.reference.placement == "own":
        roles.append(("reference", 1))
    if cfg.has_critic and cfg.critic.placement == "own":
        roles.append(("critic", cfg.critic.num_shards))
    return roles


@dataclass
class OwnRoleActors:
    """The created (not yet started) actors of the roles on their own."""

    reference: Any = None
    critics: list[Any] = field(default_factory=list)
    identities: tuple[WorkerIdentity, ...] = ()
    """Planned, in the order of ``actors``."""
    group: PlacementGroup | None = None

    @property
    def actors(self) -> list[Any]:
        return [*([self.reference] if self.reference is not None else []), *self.critics]

    @property
    def setups(self) -> list[Callable[[], Any]]:
        """Each actor's ``setup`` call (returns its pid), in the order of ``actors``."""
        return [actor.setup.remote for actor in self.actors]

    def started(self, pids: Sequence[int]) -> list[WorkerIdentity]:
        """The identities with node and pid, once ``setups`` returned ``pids``."""
        assert self.group is not None or not pids
        out = []
        for index, (ident, pid) in enumerate(zip(self.identities, pids, strict=True)):
            assert self.group is not None
            node_id, ip = bundle_node(self.group, index)
            out.append(msgspec.structs.replace(ident, node=ip, node_id=node_id, pid=pid))
        return out


def create_own_roles(cfg: Config, roles: Sequence[tuple[Role, int]], layout: Layout,
                     sampling: Sampling, gpus: float) -> OwnRoleActors:
    """The actors of ``roles`` (``own_roles(cfg)``; none: an empty set); paths resolved
    as for the trainer shards ("" = the policy's initial weights). ``gpus``: per actor
    (0 on the CPU)."""
    if not roles:
        return OwnRoleActors()
    cpus = cfg.trainer.cpus_per_shard
    identities = own_role_identities(layout, roles, cpus)
    group = own_roles_placement_group(len(identities), cpus, gpus,
                                      timeout_s=cfg.run.call_timeout_s)
    own = OwnRoleActors(identities=identities, group=group)
    common = {"model": cfg.model, "trainer": cfg.trainer,
              "temperature": sampling.temperature, "record_spans": cfg.run.record_spans}
    critic_first = next((i for i, w in enumerate(identities) if w.role == "critic"), 0)
    master_addr, port = bundle_node(group, critic_first)[1], free_port()
    for index, ident in enumerate(identities):
        options = {"name": ident.name, "num_cpus": cpus, "num_gpus": gpus,
                   "scheduling_strategy": in_bundle(group, index)}
        if ident.role == "reference":
            own.reference = ray.remote(ReferenceActor).options(**options).remote(
                path=cfg.reference.path or cfg.model.path, rank=ident.rank,
                cpu_ids=ident.devices, **common)
        else:
            critic = msgspec.structs.replace(cfg.critic, path=cfg.critic.path or cfg.model.path)
            own.critics.append(ray.remote(CriticActor).options(**options).remote(
                critic=critic, rank=ident.rank, world_size=cfg.critic.num_shards,
                master_addr=master_addr, master_port=port, cpu_ids=ident.devices,
                **common))
    return own
