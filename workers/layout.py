"""The layout: which worker is which, and on CPU which cores each one owns.

Owns: the explicit identity of every worker (``WorkerIdentity``: role, rank, node,
devices), the planned identities of a run's workers before any actor exists (``Layout``),
the cores a run lays out (``usable_cores``) and ``assign_cpus``, which hands each worker
its own cores so that rollout and training behave like separate accelerators
(``own_role_identities`` for the reference and the critic on cores of their own;
``lendable_identities`` for the rollout engines ``[autopilot]`` may add). Plain
Python: the simulator lays a CPU machine out as a real run would. Knows nothing about Ray
or what workers do.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

import msgspec

Role = Literal["rollout", "trainer", "critic", "reference"]


class WorkerIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """Where one worker runs and which devices it owns."""

    role: Role
    rank: int
    node: str = ""
    """Node IP address (filled once the actor runs)."""
    node_id: str = ""
    """Ray node id: tells apart nodes that share an address (several on one machine)."""
    device_kind: Literal["cpu", "cuda"] = "cpu"
    devices: tuple[int, ...] = ()
    """CPU core ids (device_kind cpu) or GPU ordinals (cuda) this worker owns."""
    pid: int = 0
    address: str = ""
    """A rollout worker's gateway (an agent task's OpenAI-compatible endpoint); "" for
    none."""
    added_after_step: int = -1
    """A rollout engine ``[autopilot]`` added: the step after which it joined (the
    policy version it started from); a resumed run's engines the autopilot had added,
    the step it resumed after. -1: a worker of the run's own."""
    removed_after_step: int = -1
    """The step after which ``[autopilot]`` removed it (-1: it ran to the run's end)."""

    @property
    def name(self) -> str:
        return f"{self.role}-{self.rank}"

    @property
    def device_label(self) -> str:
        ids = ",".join(str(d) for d in self.devices) or "-"
        return f"{self.device_kind}:{ids}"


class Layout(msgspec.Struct, frozen=True, kw_only=True):
    """The planned identities of every worker, before any actor exists."""

    rollout: tuple[WorkerIdentity, ...]
    trainer: tuple[WorkerIdentity, ...]
    colocated: bool


def usable_cores() -> tuple[int, ...]:
    """The cores a run lays its workers out on, in the order the roles take them (rollout
    first): this process's, lowest first."""
    return tuple(sorted(os.sched_getaffinity(0)))


def assign_cpus(
    num_rollout: int, cpus_per_rollout: int, num_trainer: int, cpus_per_trainer: int,
    *, available: tuple[int, ...] | None = None, colocated: bool = False,
) -> Layout:
    """Splits this node's cores between the roles, rollout first.

    Disaggregated: each worker gets its own cores while there are enough; beyond that,
    cores are reused round-robin within the role (contention then shows up as slower
    compute, never as a failure). Co-located: both roles get the same cores.
    """
    cores = tuple(sorted(available)) if available is not None else usable_cores()

    def take(start: int, count: int, width: int) -> list[tuple[int, ...]]:
        return [
            tuple(cores[(start + i * width + j) % len(cores)] for j in range(width))
            for i in range(count)
        ]

    rollout_cores = take(0, num_rollout, cpus_per_rollout)
    trainer_start = 0 if colocated else num_rollout * cpus_per_rollout
    if not colocated and trainer_start >= len(cores):
        trainer_start = len(cores) - 1  # too few cores: trainers share the last one(s)
    trainer_cores = take(trainer_start, num_trainer, cpus_per_trainer)
    return Layout(
        rollout=tuple(
            WorkerIdentity(role="rollout", rank=r, devices=c) for r, c in enumerate(rollout_cores)
        ),
        trainer=tuple(
            WorkerIdentity(role="trainer", rank=r, devices=c) for r, c in enumerate(trainer_cores)
        ),
        colocated=colocated,
    )


def own_role_identities(layout: Layout, roles: Sequence[tuple[Role, int]], cpus_each: int,
                        *, available: tuple[int, ...] | None = None
                        ) -> tuple[WorkerIdentity, ...]:
    """The workers of the roles placed on devices of their own (``roles``: each role and
    its count), ``cpus_each`` cores each, on the cores after the trainer shards' and
    round-robin over the node's cores when there are too few (as ``assign_cpus``)."""
    cores = tuple(sorted(available)) if available is not None else usable_cores()
    taken = [c for w in (*layout.rollout, *layout.trainer) for c in w.devices]
    start = cores.index(taken[-1]) + 1 if taken and taken[-1] in cores else 0
    out: list[WorkerIdentity] = []
    for role, count in roles:
        for rank in range(count):
            out.append(WorkerIdentity(role=role, rank=rank, devices=tuple(
                cores[(start + j) % len(cores)] for j in range(cpus_each))))
            start += cpus_each
    return tuple(out)


def lendable_identities(layout: Layout, own: Sequence[WorkerIdentity], first_rank: int,
                        count: int, cpus_each: int, *, available: tuple[int, ...] | None = None
                        ) -> tuple[tuple[WorkerIdentity, ...], int]:
    """The rollout engines ``[autopilot]`` may add (ranks from ``first_rank`` up),
    ``cpus_each`` cores each, and how many of them fit on cores no other added engine
    has. Their cores: the node's spare ones (no worker's) first, then the trainer
    shards' (an engine is added when the trainer waits for data: its cores idle then),
    round-robin over those when there are too few. On a node without spare cores an
    added engine shares a trainer shard's."""
    cores = tuple(sorted(available)) if available is not None else usable_cores()
    taken = {c for w in (*layout.rollout, *layout.trainer, *own) for c in w.devices}
    trainer = [c for w in layout.trainer for c in w.devices]
    pool = [c for c in cores if c not in taken] + list(dict.fromkeys(trainer))
    pool = pool or list(cores)
    engines = tuple(
        WorkerIdentity(role="rollout", rank=first_rank + i, devices=tuple(
            pool[(i * cpus_each + j) % len(pool)] for j in range(cpus_each)))
        for i in range(count))
    return engines, len(pool) // cpus_each
