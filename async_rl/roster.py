"""The run's roster: every worker a run has, and the frozen spec each one is built from.

Owns: ``roster(config, start)``, which turns a ``Config`` into a ``Roster``: per worker
its role, rank, cores, the CPUs it asks of Ray, its placement-group bundle and its spec
(``workers.rollout.spec``, ``workers.trainer.spec``, ``workers.eval.spec``). The rules
that turn the run's sections into specs are written here once: which roles run on
workers of their own, whether rollout and training share devices
(``RunConfig.shares_devices``), the role paths (a role without a path uses the policy's
initial weights: a resumed run's policy comes from its checkpoint, its reference and
critic weights never do), which trainer shards write checkpoints. And what is read off
the whole roster: the CPUs a local Ray needs (``Roster.cpus``) and the registry of who
runs where (``Roster.registry``, ``registry_table``; an engine the autopilot adds or
removes while the run trains, ``registry_line``), and the engines a resumed run starts
with when the autopilot had added some (``resumed_engines``).

Plain Python (no Ray): the Ray shell (``async_rl.shell.launch``) creates one actor per
entry and fills in what only placement knows (node, process group address, pid); the
simulator lays its cores out from it (``async_rl.sim.workers``). The cores themselves are
``workers.layout``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import msgspec

from async_rl.config import Config
from workers.eval.spec import EvaluatorSpec
from workers.layout import (
    Layout,
    Role,
    WorkerIdentity,
    assign_cpus,
    lendable_identities,
    own_role_identities,
)
from workers.model_config import ModelConfig
from workers.rollout.config import Sampling, sampling
from workers.rollout.spec import RolloutSpec
from workers.trainer.roles_config import CriticConfig
from workers.trainer.spec import CriticSpec, ReferenceSpec, TrainerSpec

Kind = Literal["rollout", "trainer", "reference", "critic", "evaluator"]
WorkerSpec = RolloutSpec | TrainerSpec | ReferenceSpec | CriticSpec | EvaluatorSpec


class Start(msgspec.Struct, frozen=True, kw_only=True):
    """Where the policy's weights come from: model.path at version 0 (a new run), or a
    resumed checkpoint's policy folder at its version."""

    policy_path: str = ""
    """A checkpoint's policy folder ("" = model.path)."""
    version: int = 0
    """The policy version of those weights: engines label their tokens with it."""

    @property
    def resumed(self) -> bool:
        """The trainer shards (and the critic's own workers) load the checkpoint's
        training state once started."""
        return bool(self.policy_path)


class Bundle(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's place in the run's placement groups."""

    group: Literal["rollout", "trainer", "own", "lendable"]
    """Co-located, "rollout" and "trainer" name one shared group."""
    index: int
    shared: bool = False
    """The bundle holds rollout worker i and trainer shard i (co-located): each asks
    for half of its GPU."""


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One worker of the run."""

    role: Kind
    rank: int
    cpus: int
    """CPUs it asks of Ray (0: the evaluator runs on cores its workers leave idle)."""
    devices: tuple[int, ...] = ()
    """The cores it owns (``workers.layout``)."""
    bundle: Bundle | None
    """None: in no placement group (the evaluator)."""
    spec: WorkerSpec

    @property
    def name(self) -> str:
        """Its Ray actor's name and its name in the registry."""
        return "evaluator" if self.role == "evaluator" else f"{self.role}-{self.rank}"

    def identity(self, *, node: str = "", node_id: str = "", pid: int = 0) -> WorkerIdentity:
        """Its registry line (a placed worker only: the evaluator has none)."""
        if self.role == "evaluator":
            raise ValueError("the evaluator is in no placement group and not in the registry")
        return WorkerIdentity(role=self.role, rank=self.rank, devices=self.devices,
                              node=node, node_id=node_id, pid=pid)


class Roster(msgspec.Struct, frozen=True, kw_only=True):
    """Every worker of a run, in the order they are created: rollout workers, trainer
    shards, the reference's and the critic's workers of their own, the evaluator."""

    entries: tuple[Entry, ...]
    layout: Layout
    """The rollout workers' and trainer shards' cores (their placement groups)."""
    start: Start
    critic_beside_trainer: bool
    """Critic shard i lives in trainer shard i's process (critic.placement "trainer"):
    the registry lists that process again as critic-i."""
    lendable: tuple[Entry, ...] = ()
    """The rollout engines ``[autopilot]`` may add (ranks from rollout.num_workers up to
    autopilot.max_rollout_workers): placed with the others, started only when added."""
    lendable_room: int = 0
    """How many added engines have cores no other added engine has (on CPU)."""
    resumed: int = 0
    """Of ``lendable``, the first this many start with the run: a resumed run's engines
    that ``[autopilot]`` had added (``resumed_engines``)."""

    def of(self, role: Kind) -> list[Entry]:
        return [entry for entry in self.entries if entry.role == role]

    @property
    def own(self) -> list[Entry]:
        """The reference's and the critic's workers of their own (placement "own")."""
        return [e for e in self.entries if e.bundle is not None and e.bundle.group == "own"]

    @property
    def started(self) -> tuple[Entry, ...]:
        """The workers started with the run, in order: its entries, then the resumed
        engines the autopilot had added."""
        return (*self.entries, *self.lendable[:self.resumed])

    @property
    def cpus(self) -> int:
        """CPUs the workers ask for in all (the engines the autopilot may add included):
        what a local Ray must have at least."""
        return sum(entry.cpus for entry in (*self.entries, *self.lendable))

    def registry(self, placed: Mapping[str, WorkerIdentity]) -> list[WorkerIdentity]:
        """Who runs where: each placed worker's identity from ``placed`` (by name, with
        its node and pid once it runs), the critic beside the trainer shards as their
        processes again, the resumed engines the autopilot had added marked added after
        the step the run resumed after."""
        trainers = [placed[e.name] for e in self.of("trainer")]
        beside = ([msgspec.structs.replace(w, role="critic") for w in trainers]
                  if self.critic_beside_trainer else [])
        resumed = [msgspec.structs.replace(placed[e.name], added_after_step=self.start.version)
                   for e in self.lendable[:self.resumed]]
        return [*(placed[e.name] for e in self.of("rollout")), *resumed, *trainers, *beside,
                *(placed[e.name] for e in self.own)]


def roster(config: Config, start: Start | None = None, *,
           available: tuple[int, ...] | None = None, engines: int = 0) -> Roster:
    """Every worker of the run ``config`` describes, starting the policy from ``start``
    (None: a new run). ``available``: the cores to lay out (None: this process's).
    ``engines``: the rollout engines to start with, the autopilot's added ones included
    (a resumed run's: ``resumed_engines``; 0: rollout.num_workers)."""
    start = start or Start()
    rollout, trainer = config.rollout, config.trainer
    own_roles = _own_roles(config)
    layout = assign_cpus(rollout.num_workers, rollout.cpus_per_worker, trainer.num_shards,
                         trainer.cpus_per_shard, available=available,
                         colocated=config.run.shares_devices)
    own = own_role_identities(layout, own_roles, trainer.cpus_per_shard, available=available)
    policy = (msgspec.structs.replace(config.model, path=start.policy_path)
              if start.resumed else config.model)
    workers = _Workers(config, policy, tuple(role for role, _ in own_roles),
                       sampling(config.rollout, config.model))
    shared = layout.colocated
    entries = [Entry(role="rollout", rank=w.rank, cpus=rollout.cpus_per_worker,
                     devices=w.devices, bundle=Bundle(group="rollout", index=w.rank,
                                                      shared=shared),
                     spec=workers.rollout(w.rank, w.devices, layout)) for w in layout.rollout]
    entries += [Entry(role="trainer", rank=w.rank, cpus=trainer.cpus_per_shard,
                      devices=w.devices, bundle=Bundle(group="trainer", index=w.rank,
                                                       shared=shared),
                      spec=workers.trainer(w.rank, w.devices)) for w in layout.trainer]
    entries += [Entry(role=w.role, rank=w.rank, cpus=trainer.cpus_per_shard,
                      devices=w.devices, bundle=Bundle(group="own", index=index),
                      spec=workers.own(w.role, w.rank, w.devices))
                for index, w in enumerate(own)]
    extra, room = lendable_identities(layout, own, rollout.num_workers,
                                      config.lendable_engines, rollout.cpus_per_worker,
                                      available=available)
    lendable = tuple(Entry(role="rollout", rank=w.rank, cpus=rollout.cpus_per_worker,
                           devices=w.devices, bundle=Bundle(group="lendable", index=index),
                           spec=workers.rollout(w.rank, w.devices, layout))
                     for index, w in enumerate(extra))
    if config.run.eval_on == "idle_cpu":
        # No cores of its own: it runs at idle priority on whichever core is idle.
        entries.append(Entry(role="evaluator", rank=0, cpus=0, bundle=None,
                             spec=EvaluatorSpec(model=policy,
                                                max_new_tokens=rollout.max_new_tokens)))
    return Roster(entries=tuple(entries), layout=layout, start=start,
                  critic_beside_trainer=config.has_critic and "critic" not in workers.own_roles,
                  lendable=lendable, lendable_room=room,
                  resumed=min(max(engines - rollout.num_workers, 0), len(lendable)))


def resumed_engines(config: Config, saved: int) -> tuple[int, str]:
    """The rollout engines a resumed run starts with, from ``saved``, the engine count
    ``[autopilot]`` had reached when the checkpoint was taken (0: none recorded), and a
    line saying why when that is not ``saved``: within rollout.num_workers ..
    autopilot.max_rollout_workers of the resumed config (clamped, not refused: the
    count is a throughput setting, not the algorithm's; whether the cluster can hold
    that many is checked as for a new run, when the run is placed)."""
    first = config.rollout.num_workers
    most = first + config.lendable_engines
    if saved <= first:
        return first, ""
    if saved <= most:
        return saved, ""
    why = ("without autopilot.enabled" if not config.autopilot.enabled else
           f"autopilot.max_rollout_workers = {config.autopilot.max_rollout_workers}")
    return most, (f"the checkpoint ran {saved} rollout engines (the autopilot's); {why}: "
                  f"the run resumes with {most}")


def _own_roles(config: Config) -> list[tuple[Role, int]]:
    """The roles the run places on workers of their own, with their worker counts."""
    roles: list[tuple[Role, int]] = []
    if config.has_reference and config.reference.placement == "own":
        roles.append(("reference", 1))
    if config.has_critic and config.critic.placement == "own":
        roles.append(("critic", config.critic.num_shards))
    return roles


class _Workers:
    """The specs of one run's workers: its sections, read once."""

    def __init__(self, config: Config, policy: ModelConfig, own_roles: tuple[str, ...],
                 rollout_sampling: Sampling) -> None:
        self.config, self.policy, self.own_roles = config, policy, own_roles
        self.sampling = rollout_sampling
        # A role without a path starts from the policy's initial weights, never from a
        # resumed checkpoint's policy (a resumed critic loads its own weights after).
        self.reference_path = config.reference.path or config.model.path
        self.critic: CriticConfig = msgspec.structs.replace(
            config.critic, path=config.critic.path or config.model.path)

    def rollout(self, rank: int, cores: tuple[int, ...], layout: Layout) -> RolloutSpec:
        run = self.config.run
        return RolloutSpec(rank=rank, model=self.policy, rollout=self.config.rollout,
                           weights=self.config.weights, seed=run.seed + rank,
                           cpu_ids=cores, worker_cpu_ids=self.worker_cores(layout),
                           record_spans=run.record_spans)

    def worker_cores(self, layout: Layout) -> tuple[int, ...]:
        """Where a rollout worker's own process moves once its engine is built
        (rollout.worker_cores): the trainer shards' cores, or nowhere (empty)."""
        if self.config.rollout.worker_cores != "trainer" or layout.colocated:
            return ()
        return tuple(sorted({core for w in layout.trainer for core in w.devices}))

    def trainer(self, rank: int, cores: tuple[int, ...]) -> TrainerSpec:
        config, run = self.config, self.config.run
        # ddp's shards are replicas: shard 0's copy is the checkpoint.
        writes = run.checkpoint_every > 0 and (config.trainer.backend == "fsdp2" or rank == 0)
        reference = config.has_reference and "reference" not in self.own_roles
        critic = config.has_critic and "critic" not in self.own_roles
        return TrainerSpec(
            rank=rank, world_size=config.trainer.num_shards, model=self.policy,
            trainer=config.trainer, seed=run.seed, weights=config.weights,
            sampling=self.sampling, cpu_ids=cores,
            master_addr="", master_port=0,  # shard 0's node: known once placed
            record_spans=run.record_spans, writes_checkpoints=writes,
            reference_path=self.reference_path if reference else "",
            critic=self.critic if critic else None,
            own_roles=self.own_roles, save_merged=run.save_merged)

    def own(self, role: Role, rank: int, cores: tuple[int, ...]) -> ReferenceSpec | CriticSpec:
        config = self.config
        if role == "reference":
            return ReferenceSpec(rank=rank, model=self.policy, trainer=config.trainer,
                                 temperature=self.sampling.temperature, cpu_ids=cores,
                                 record_spans=config.run.record_spans,
                                 path=self.reference_path)
        return CriticSpec(rank=rank, model=self.policy, trainer=config.trainer,
                          temperature=self.sampling.temperature, cpu_ids=cores,
                          record_spans=config.run.record_spans, critic=self.critic,
                          world_size=config.critic.num_shards,
                          master_addr="", master_port=0)  # the first one's node, once placed


def registry_table(identities: list[WorkerIdentity]) -> str:
    """The registry as a small fixed-width table, for the shell to print."""
    gateway = any(w.address for w in identities)  # an agent task's: one column more
    added = any(w.added_after_step >= 0 for w in identities)  # the autopilot's engines
    rows = [("worker", "node", "devices", "pid", *(("gateway",) if gateway else ()),
             *(("autopilot",) if added else ()))]
    rows += [(w.name, w.node or "-", w.device_label, str(w.pid or "-"),
              *((w.address,) if gateway else ()), *((lent(w) or "-",) if added else ()))
             for w in identities]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def lent(identity: WorkerIdentity) -> str:
    """When ``[autopilot]`` added (and removed) an engine, in words ("": a worker of the
    run's own)."""
    if identity.added_after_step < 0:
        return ""
    removed = (f", removed after step {identity.removed_after_step}"
               if identity.removed_after_step >= 0 else "")
    return f"added after step {identity.added_after_step}{removed}"


def registry_line(identity: WorkerIdentity) -> str:
    """One worker's registry row as a console line (an engine the autopilot added or
    removed while the run trains)."""
    return (f"{identity.name}: node {identity.node or '-'}, {identity.device_label}, "
            f"pid {identity.pid or '-'}; {lent(identity) or 'a worker of the run'}")
