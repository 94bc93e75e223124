"""What a run starts: its workers as Ray actors.

Owns: creating and starting the rollout and trainer actors on their cores or GPUs
(``launch_workers``), the weight-transfer groups between trainer shard 0 and each
rollout worker, the idle-CPU evaluator of run.eval_on, the reference's and critic's
workers of their own (``async_rl.shell.role_launch``), a resumed run's training state
loaded into them, and the registry table of where each worker runs
(``registry_table``). What the workers get of the task is built before
(``async_rl.tasks.table``). Part of the Ray shell: knows nothing about the run's
loops, which ``async_rl.control.orchestrator`` drives through the adapters of
``async_rl.shell.ray_shell``.
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
from async_rl.shell.role_launch import OwnRoleActors, create_own_roles, own_roles
from buffers.common.concurrent_calls import each
from workers.actors import RolloutActor, TrainerActor
from workers.common.ports import free_port
from workers.eval.evaluator import IdleCpuEvaluator
from workers.layout import Role, WorkerIdentity, assign_cpus
from workers.model_config import ModelConfig
from workers.placement import bundle_node, check_gpus, gpus_per_worker, in_bundle
from workers.placement import role_placement_groups as make_placement_groups
from workers.rollout.config import sampling
from workers.rollout.task import WorkerTask
from workers.trainer.checkpoint_folder import WAIT_GROUP
from workers.weights.broadcast import SEND_GROUP, WeightBroadcast
from workers.weights.config import check_transport


@dataclass
class StartedWorkers:
    """The started actors (Ray handles) and who runs where."""

    rollout: dict[int, Any] = field(default_factory=dict)
    trainers: list[Any] = field(default_factory=list)
    identities: list[WorkerIdentity] = field(default_factory=list)
    placement_groups: list[PlacementGroup] = field(default_factory=list)
    evaluator: Any = None
    """The run.eval_on = "idle_cpu" evaluator (None: evaluations run on rollout workers)."""
    new_rollout: Callable[[int, ModelConfig, int, str], Any] | None = None
    """Creates (does not start) rollout worker ``rank`` on its cores from a model at a
    version: how a lost worker is replaced."""
    broadcast: WeightBroadcast | None = None
    """Trainer shard 0's broadcasts of each version to the rollout workers."""
    own: OwnRoleActors = field(default_factory=OwnRoleActors)
    """The reference's and the critic's workers of their own (placement "own")."""


async def launch_workers(cfg: Config, task: WorkerTask, version: int = 0, *,
                         resuming: bool = False) -> StartedWorkers:
    """Creates every rollout worker and trainer shard, starts them, and says where.

    ``task``: what the workers get of the run's task
    (``async_rl.tasks.table.worker_task``). ``version``: the policy version of
    the weights at ``cfg.model.path`` (a checkpoint's, when resuming): rollout engines
    label their tokens with it from the start. ``resuming``: ``cfg.model.path`` is a
    checkpoint's policy folder, whose training state every trainer shard (and critic of
    its own) loads once started.
    """
    own_counts = own_roles(cfg)  # the roles on workers of their own, with their counts
    roles = role_models(cfg, own_counts)  # what each trainer shard builds beside the policy
    layout = assign_cpus(
        cfg.rollout.num_workers, cfg.rollout.cpus_per_worker,
        cfg.trainer.num_shards, cfg.trainer.cpus_per_shard, colocated=cfg.run.colocate is True,
    )
    cluster_gpus = ray.cluster_resources().get("GPU", 0)
    check_transport(cfg.weights, cuda=bool(cluster_gpus))
    rollout_sampling = sampling(cfg.rollout, cfg.model)  # what the trainer shards must know
    gpus = gpus_per_worker(cluster_gpus, cfg.run.colocate is True)
    check_gpus(layout, cluster_gpus, own_roles=sum(count for _, count in own_counts))
    groups = make_placement_groups(
        layout, cfg.rollout.cpus_per_worker, cfg.trainer.cpus_per_shard, gpus=gpus,
        timeout_s=cfg.run.call_timeout_s)
    # (node id, IP) of each worker's bundle: the groups are ready, the registry needs them.
    nodes = {ident.name: bundle_node(groups[ident.role], ident.rank)
             for ident in [*layout.rollout, *layout.trainer]}
    started = StartedWorkers(placement_groups=list({id(g): g for g in groups.values()}.values()))
    rollout_cls = ray.remote(RolloutActor)

    def new_rollout(rank: int, model: ModelConfig, version: int, name: str = "") -> Any:
        ident = layout.rollout[rank]
        return rollout_cls.options(
            name=name or None,
            num_cpus=cfg.rollout.cpus_per_worker, num_gpus=gpus,
            max_concurrency=4 * cfg.rollout.max_inflight_prompts + 16,
            scheduling_strategy=in_bundle(groups["rollout"], ident.rank),
        ).remote(ident.rank, model, cfg.rollout, cfg.weights, task,
                 seed=cfg.run.seed + ident.rank, cpu_ids=ident.devices,
                 record_spans=cfg.run.record_spans, version=version)

    started.new_rollout = new_rollout
    for ident in layout.rollout:
        started.rollout[ident.rank] = new_rollout(ident.rank, cfg.model, version, ident.name)
    # A version's broadcast runs in a thread of its own, beside training calls
    # (workers.weights.broadcast); versions are broadcast one at a time.
    # Ray's typed overloads of remote() omit concurrency_groups, which it accepts.
    # Waiting for a background checkpoint write runs beside them too (WAIT_GROUP).
    trainer_cls = ray.remote(  # type: ignore[call-overload]
        concurrency_groups={SEND_GROUP: 1, WAIT_GROUP: 1})(TrainerActor)
    # The shards' rendezvous is on shard 0's node, which may not be the driver's.
    master_addr, port = nodes[layout.trainer[0].name][1], free_port()
    started.trainers = [
        trainer_cls.options(
            name=ident.name,
            num_cpus=cfg.trainer.cpus_per_shard, num_gpus=gpus,
            scheduling_strategy=in_bundle(groups["trainer"], ident.rank),
        ).remote(
            rank=ident.rank, world_size=cfg.trainer.num_shards, model=cfg.model,
            trainer=cfg.trainer, seed=cfg.run.seed, weights=cfg.weights,
            sampling=rollout_sampling,
            cpu_ids=ident.devices,
            master_addr=master_addr, master_port=port, record_spans=cfg.run.record_spans,
            # ddp's shards are replicas: shard 0's copy is the checkpoint.
            writes_checkpoints=cfg.run.checkpoint_every > 0
            and (cfg.trainer.backend == "fsdp2" or ident.rank == 0),
            **roles,
            save_merged=cfg.run.save_merged,
        )
        for ident in layout.trainer
    ]
    # Shard 0 sends each version to the rollout workers; with fsdp2 it gathers the whole
    # policy from every shard first (ddp's shards are replicas).
    started.broadcast = WeightBroadcast(
        started.trainers[0],
        gather_from=started.trainers[1:] if cfg.trainer.backend == "fsdp2" else ())
    # One GPU each (on a GPU cluster) or cores of their own, apart from both roles'.
    own = started.own = create_own_roles(cfg, own_counts, layout, rollout_sampling,
                                         gpus_per_worker(cluster_gpus, colocated=False))
    started.placement_groups += [own.group] if own.group is not None else []
    evaluator_setup = []
    if cfg.run.eval_on == "idle_cpu":
        # No cores of its own (num_cpus=0): it runs at idle priority on whichever core
        # its workers leave idle.
        started.evaluator = ray.remote(IdleCpuEvaluator).options(
            name="evaluator", num_cpus=0).remote(
            model=cfg.model, task=task, max_new_tokens=cfg.rollout.max_new_tokens)
        evaluator_setup.append(started.evaluator.setup.remote)
    # Shards, engines and the evaluator start side by side: each on cores of its own,
    # none waits for another, and each takes seconds to tens of seconds on a CPU.
    pids: list[int] = await each([*(t.setup.remote for t in started.trainers),
                                  *(w.start.remote for w in started.rollout.values()),
                                  *own.setups, *evaluator_setup])
    trainer_pids = pids[:len(started.trainers)]
    rollout_pids = pids[len(started.trainers):len(started.trainers) + len(started.rollout)]
    # Every rollout worker becomes a member of shard 0's weight-broadcast group (built
    # at the first broadcast, and again whenever its members change).
    for rank, worker in started.rollout.items():
        await started.trainers[0].connect_rollout.remote(rank, worker)
    started.identities = []
    for ident, pid in zip([*layout.rollout, *layout.trainer], [*rollout_pids, *trainer_pids],
                          strict=True):
        node_id, ip = nodes[ident.name]
        started.identities.append(
            msgspec.structs.replace(ident, node=ip, node_id=node_id, pid=pid))
    if cfg.has_critic and cfg.critic.placement == "trainer":  # shard i's process, devices
        started.identities += [msgspec.structs.replace(ident, role="critic")
                               for ident in started.identities if ident.role == "trainer"]
    first_own = len(started.trainers) + len(started.rollout)
    started.identities += own.started(pids[first_own:first_own + len(own.actors)])
    if resuming:  # the shards' (and own critics') optimizer, RNG and critic state
        await each([functools.partial(t.load_training_state.remote, cfg.model.path)
                    for t in [*started.trainers, *own.critics]])
    return started


def role_models(cfg: Config, own_counts: Sequence[tuple[Role, int]]) -> dict[str, Any]:
    """What each trainer shard builds beside the policy: the reference's weights and
    the critic's section, their paths resolved ("" = the policy's initial weights),
    where they are placed "trainer"; and which roles run on workers of their own
    (``own_counts``: ``role_launch.own_roles``)."""
    own = tuple(role for role, _ in own_counts)
    return {"reference_path": (cfg.reference.path or cfg.model.path)
            if cfg.has_reference and "reference" not in own else "",
            "critic": msgspec.structs.replace(cfg.critic,
                                              path=cfg.critic.path or cfg.model.path)
            if cfg.has_critic and "critic" not in own else None,
            "own_roles": own}


def registry_table(identities: list[WorkerIdentity]) -> str:
    """The registry as a small fixed-width table, for the shell to print."""
    rows = [("worker", "node", "devices", "pid")]
    rows += [(w.name, w.node or "-", w.device_label, str(w.pid or "-")) for w in identities]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
