"""What a run starts: the workers of its roster as Ray actors.

Owns: ``launch_workers``: the placement groups of the roster's bundles, one actor per
roster entry (``async_rl.roster``: rollout workers, trainer shards, the reference's and
the critic's workers of their own, the idle-CPU evaluator), each created in one loop
from its spec, with its process group's address filled in once the group's first
member is placed; starting them side by side; the weight-transfer group between trainer
shard 0 and each rollout worker; a resumed run's training state loaded into them; and
the registry of where each one runs. What the workers get of the task is built before
(``async_rl.tasks.table``). Part of the Ray shell: knows nothing about the run's loops,
which ``async_rl.control.orchestrator`` drives through the adapters of
``async_rl.shell.adapters``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import ray
from ray.util.placement_group import PlacementGroup

from async_rl.config import Config
from async_rl.knobs import inflight_ceiling
from async_rl.roster import Entry, Roster, WorkerSpec
from buffers.common.concurrent_calls import each
from workers.actors import CriticActor, ReferenceActor, RolloutActor, TrainerActor
from workers.common.ports import free_port
from workers.eval.evaluator import IdleCpuEvaluator
from workers.eval.spec import EvaluatorSpec
from workers.layout import WorkerIdentity
from workers.model_config import ModelConfig
from workers.placement import (
    bundle_node,
    check_gpus,
    check_lendable,
    gpus_per_worker,
    in_bundle,
    lendable_placement_group,
    own_roles_placement_group,
    role_placement_groups,
)
from workers.rollout.spec import RolloutSpec
from workers.rollout.task import WorkerTask
from workers.trainer.checkpoint_folder import WAIT_GROUP
from workers.trainer.spec import CriticSpec, ReferenceSpec, TrainerSpec
from workers.weights.broadcast import SEND_GROUP, WeightBroadcast
from workers.weights.config import check_transport

ROLLOUT = ray.remote(RolloutActor)
# A version's broadcast runs in a thread of its own, beside training calls
# (workers.weights.broadcast); versions are broadcast one at a time. Waiting for a
# background checkpoint write runs beside them too (WAIT_GROUP). Ray's typed overloads
# of remote() omit concurrency_groups, which it accepts.
TRAINER = ray.remote(  # type: ignore[call-overload]
    concurrency_groups={SEND_GROUP: 1, WAIT_GROUP: 1})(TrainerActor)
REFERENCE = ray.remote(ReferenceActor)
CRITIC = ray.remote(CriticActor)
EVALUATOR = ray.remote(IdleCpuEvaluator)


@dataclass
class StartedWorkers:
    """The created actors (Ray handles) and who runs where."""

    rollout: dict[int, Any] = field(default_factory=dict)
    trainers: list[Any] = field(default_factory=list)
    reference: Any = None
    """The reference's worker of its own (None: beside the trainer shards, or none)."""
    critics: list[Any] = field(default_factory=list)
    """The critic's workers of their own (none: beside the trainer shards, or none)."""
    evaluator: Any = None
    """The run.eval_on = "idle_cpu" evaluator (None: evaluations run on rollout workers)."""
    identities: list[WorkerIdentity] = field(default_factory=list)
    lendable: dict[int, WorkerIdentity] = field(default_factory=dict)
    """Where each engine ``[autopilot]`` may add goes, by rank (no pid: not started)."""
    placement_groups: list[PlacementGroup] = field(default_factory=list)
    new_rollout: Callable[[int, ModelConfig, int, str], Any] | None = None
    """Creates (does not start) rollout worker ``rank`` on its cores from a model at a
    version: how a lost worker is replaced."""
    broadcast: WeightBroadcast | None = None
    """Trainer shard 0's broadcasts of each version to the rollout workers."""

    def add(self, entry: Entry, handle: Any) -> None:
        """Files the actor created for ``entry``."""
        match entry.role:
            case "rollout":
                self.rollout[entry.rank] = handle
            case "trainer":
                self.trainers.append(handle)
            case "reference":
                self.reference = handle
            case "critic":
                self.critics.append(handle)
            case "evaluator":
                self.evaluator = handle

    @property
    def actors(self) -> list[Any]:
        """The workers that hold engines or process groups (shut down before killed)."""
        reference = [self.reference] if self.reference is not None else []
        return [*self.rollout.values(), *self.trainers, *reference, *self.critics]


@dataclass(frozen=True)
class Placed:
    """Where each roster entry goes, by name, once its placement group is ready."""

    nodes: dict[str, tuple[str, str]]
    """(node id, IP address) of each placed worker's bundle (the evaluator has none)."""
    options: dict[str, dict[str, Any]]
    """The Ray options that put each actor in its bundle with its CPUs and GPUs."""
    task: WorkerTask
    max_inflight: int
    """The most prompts a rollout worker may be given at once in the run (the
    autopilot's ceiling when it may raise rollout.max_inflight_prompts): its actor takes
    that many concurrent calls, with room for the rest."""

    def create(self, entry: Entry, spec: WorkerSpec, version: int, name: str | None) -> Any:
        """Creates (does not start) ``entry``'s actor from ``spec`` in its bundle."""
        options = {"name": name, **self.options[entry.name]}
        match spec:
            case RolloutSpec():
                return ROLLOUT.options(max_concurrency=4 * self.max_inflight + 16,
                                       **options).remote(spec, self.task, version)
            case TrainerSpec():
                return TRAINER.options(**options).remote(spec)
            case ReferenceSpec():
                return REFERENCE.options(**options).remote(spec)
            case CriticSpec():
                return CRITIC.options(**options).remote(spec)
            case EvaluatorSpec():
                return EVALUATOR.options(**options).remote(spec, self.task)


async def launch_workers(config: Config, plan: Roster, task: WorkerTask,
                         started: StartedWorkers) -> None:
    """Creates every worker of ``plan`` into ``started`` (whatever was created is shut
    down when a later step fails), starts them, and says where they run. ``task``: what
    the workers get of the run's task (``async_rl.tasks.table.worker_task``). They start
    from ``plan.start``: its version labels the engines' tokens from the start, and a
    resumed run's shards (and critics of their own) load its training state."""
    placed = place(config, plan, task, started)
    specs = with_group_addresses(plan, placed)
    handles = []
    for entry in plan.started:  # a resumed run's engines the autopilot had added too
        handles.append(placed.create(entry, specs[entry.name], plan.start.version, entry.name))
        started.add(entry, handles[-1])
    started.new_rollout = rollout_replacement(plan, placed, specs)
    pids = await start_side_by_side(plan.started, handles)
    await connect_weight_groups(started)
    # Shard 0 sends each version to the rollout workers; with fsdp2 it gathers the whole
    # policy from every shard first (ddp's shards are replicas).
    started.broadcast = WeightBroadcast(
        started.trainers[0],
        gather_from=started.trainers[1:] if config.trainer.backend == "fsdp2" else ())
    await name_workers(plan, placed, handles, pids, gateways=task.agent is not None,
                       started=started)
    if plan.start.resumed:  # the shards' (and own critics') optimizer, RNG and critic state
        await each([functools.partial(t.load_training_state.remote, plan.start.policy_path)
                    for t in [*started.trainers, *started.critics]])


async def name_workers(plan: Roster, placed: Placed, handles: Sequence[Any],
                       pids: Sequence[int], *, gateways: bool,
                       started: StartedWorkers) -> None:
    """The registry of ``started``: every started worker where it runs (node, pid), each
    rollout engine's gateway address with ``gateways`` (an agent task), and the
    lendable ranks' identities."""
    started.identities = plan.registry({
        entry.name: entry.identity(node=placed.nodes[entry.name][1],
                                   node_id=placed.nodes[entry.name][0], pid=pid)
        for entry, pid in zip(plan.started, pids, strict=True) if entry.bundle is not None})
    started.lendable = {entry.rank: entry.identity(node=placed.nodes[entry.name][1],
                                                   node_id=placed.nodes[entry.name][0])
                        for entry in plan.lendable}
    if gateways:
        rollout = [(e, h) for e, h in zip(plan.started, handles, strict=True)
                   if e.role == "rollout"]
        addresses = await each([h.gateway_address.remote for _, h in rollout])
        names = {e.name: a for (e, _), a in zip(rollout, addresses, strict=True)}
        started.identities = [
            msgspec.structs.replace(w, address=names[w.name])
            if w.role == "rollout" and w.name in names else w for w in started.identities]


def place(config: Config, plan: Roster, task: WorkerTask, started: StartedWorkers) -> Placed:
    """The placement groups of ``plan``'s bundles, ready (added to ``started`` as they
    are made), and where each worker goes in them; refuses, in one line, what the
    cluster cannot hold."""
    cluster_gpus = ray.cluster_resources().get("GPU", 0)
    check_transport(config.weights, cuda=bool(cluster_gpus))
    check_gpus(plan.layout, cluster_gpus, own_roles=len(plan.own))
    by_role = role_placement_groups(
        plan.layout, config.rollout.cpus_per_worker, config.trainer.cpus_per_shard,
        gpus=gpus_per_worker(cluster_gpus, plan.layout.colocated),
        timeout_s=config.run.call_timeout_s)
    groups: dict[str, PlacementGroup] = {role: group for role, group in by_role.items()}
    started.placement_groups += list({id(g): g for g in groups.values()}.values())
    if plan.own:  # one GPU each (on a GPU cluster) or cores of their own
        groups["own"] = own_roles_placement_group(
            len(plan.own), config.trainer.cpus_per_shard,
            gpus_per_worker(cluster_gpus, colocated=False), timeout_s=config.run.call_timeout_s)
        started.placement_groups.append(groups["own"])
    if plan.lendable:  # the engines [autopilot] may add: held for them from the start
        gpus = gpus_per_worker(cluster_gpus, colocated=False)
        check_lendable(config.autopilot.max_rollout_workers, len(plan.lendable),
                       plan.lendable_room, cluster_gpus,
                       needed=len(plan.layout.rollout) + len(plan.layout.trainer)
                       + len(plan.own))
        groups["lendable"] = lendable_placement_group(
            config.autopilot.max_rollout_workers, len(plan.lendable),
            config.rollout.cpus_per_worker, gpus, timeout_s=config.run.call_timeout_s)
        started.placement_groups.append(groups["lendable"])
    placed = Placed(nodes={}, options={}, task=task, max_inflight=inflight_ceiling(config))
    for entry in (*plan.entries, *plan.lendable):
        placed.options[entry.name] = {"num_cpus": entry.cpus}
        if entry.bundle is not None:  # the evaluator: in no group, on cores left idle
            group, index = groups[entry.bundle.group], entry.bundle.index
            placed.nodes[entry.name] = bundle_node(group, index)
            placed.options[entry.name] |= {
                "num_gpus": gpus_per_worker(cluster_gpus, entry.bundle.shared),
                "scheduling_strategy": in_bundle(group, index)}
    return placed


def with_group_addresses(plan: Roster, placed: Placed) -> dict[str, WorkerSpec]:
    """Each entry's spec by name, with the address of its process group filled in
    (the roster leaves it empty): the trainer shards' on shard 0's node, the critic's
    own workers' on the first one's, each on a free port; the engines the autopilot may
    add as they are."""
    addresses: dict[str, tuple[str, int]] = {}
    specs: dict[str, WorkerSpec] = {}
    for entry in plan.entries:
        spec = entry.spec
        if isinstance(spec, TrainerSpec | CriticSpec):
            if entry.role not in addresses:
                addresses[entry.role] = (placed.nodes[entry.name][1], free_port())
            host, port = addresses[entry.role]
            spec = msgspec.structs.replace(spec, master_addr=host, master_port=port)
        specs[entry.name] = spec
    return specs | {entry.name: entry.spec for entry in plan.lendable}


def rollout_replacement(plan: Roster, placed: Placed, specs: dict[str, WorkerSpec]
                        ) -> Callable[[int, ModelConfig, int, str], Any]:
    """Creates (does not start) rollout worker ``rank`` again in its bundle (or one the
    autopilot adds, in its own), from a model at a version, named ``name`` ("": none,
    the old name may linger)."""
    entries = [*plan.of("rollout"), *plan.lendable]

    def create(rank: int, model: ModelConfig, version: int, name: str) -> Any:
        spec = specs[entries[rank].name]
        assert isinstance(spec, RolloutSpec)
        return placed.create(entries[rank], msgspec.structs.replace(spec, model=model),
                             version, name or None)

    return create


async def start_side_by_side(entries: Sequence[Entry], handles: Sequence[Any]) -> list[int]:
    """Starts every worker at once (engines, shards, roles and evaluator each take
    seconds to tens of seconds on a CPU, each on cores of its own, none waits for
    another); their pids, in ``entries``' order."""
    return await each([handle.start.remote if entry.role == "rollout" else handle.setup.remote
                       for entry, handle in zip(entries, handles, strict=True)])


async def connect_weight_groups(started: StartedWorkers) -> None:
    """Makes every rollout worker a member of shard 0's weight-broadcast group (built at
    the first broadcast, and again whenever its members change)."""
    for rank, worker in started.rollout.items():
        await started.trainers[0].connect_rollout.remote(rank, worker)
