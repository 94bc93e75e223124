"""One simulated run: the real ``Orchestrator`` with simulated workers on a virtual clock.

Owns: ``simulate`` (the hardware file, the model's size, the length law and the task's
prompts; the simulated engines, trainer shards and weight path handed to the real
orchestrator as its protocols, with the reference and the critic beside the shards when
the run has them; the run directory it writes, marked simulated in run.json) and
``simulation_costs``. Checkpoints are off (run.checkpoint_every = 0: the end of the run
still writes one, of no weights). Admission, the queue, the staleness rules, the
balancing plan, the ledger and the evaluation schedule are the real ones. Writes
sim.json besides (``SimStats``: the KV-cache bound and how often requests waited for it,
time-shared releases, what a stop at simulate.preemption_step costs:
``async_rl.sim.preemption``, the devices simulate.lend moved: ``async_rl.sim.lending``).
Knows nothing about how the costs are computed (``async_rl.sim.costs``) or what the
workers do inside.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import anyio
import msgspec

from async_rl.analysis.results import SIM_STATS, LendRecord, SimStats
from async_rl.config import Config
from async_rl.control.orchestrator import Orchestrator
from async_rl.control.protocols import RolloutClient, TrainerClient, Workers
from async_rl.knobs import check_live
from async_rl.run.run_dir import USAGE, RunWriter
from async_rl.run.summary import RunSummary
from async_rl.sim.clock import run_virtual
from async_rl.sim.costs import Costs, Plan, adapter_parameters, model_shape
from async_rl.sim.engine import SimEngine
from async_rl.sim.hardware_file import Hardware, load_hardware
from async_rl.sim.lending import SimLending, lend_plan
from async_rl.sim.lengths import length_law
from async_rl.sim.parallel import rollout_layout, trainer_layout
from async_rl.sim.preemption import Preemption, ProbedOrchestrator
from async_rl.sim.roles import SimRoles, SimRoleStages
from async_rl.sim.rollout import SimEvaluator, SimRollout
from async_rl.sim.timeshare import SimLocalWeights, check_time_shared, refit_record, time_shared
from async_rl.sim.version_stages import version_tensors
from async_rl.sim.weight_path import SimWeights
from async_rl.sim.workers import SimTrainer, SimTraining
from async_rl.tasks.sources import ArithmeticTask, PromptSource
from async_rl.tasks.table import build_task, reference_length
from buffers.common.config import ConfigError
from buffers.common.records import Prompt


def simulation_costs(config: Config) -> Costs:
    """The cost model of ``config``'s simulate.hardware (with its hardware_overrides)
    and model."""
    sim = config.simulate
    for section, role in (("reference", config.reference), ("critic", config.critic)):
        if role.placement == "own":  # the simulator models the roles on the shards' devices
            raise ConfigError(f'config error: {section}.placement = "own": the simulator '
                              f'models the roles beside the trainer shards only ("trainer")')
    shape = model_shape(config.model.path, config.model.dtype, parameters=sim.parameters,
                        kv_bytes_per_token=sim.kv_bytes_per_token,
                        attention_width=sim.attention_width,
                        active_parameters=sim.active_parameters,
                        state_bytes_per_sequence=sim.state_bytes_per_sequence)
    lora = config.model.lora
    if lora.enabled:  # a version, and the gradients, are the adapters'
        shape = msgspec.structs.replace(shape, adapter_parameters=adapter_parameters(
            config.model.path, lora, sim.lora_parameters_per_rank))
    if sim.active_parameters > shape.parameters:
        raise ConfigError(f"config error: simulate.active_parameters = "
                          f"{sim.active_parameters:g}: more than the model's "
                          f"{shape.parameters:g} parameters")
    arch = {key: value for key, value in (
        ("layers", sim.architecture.layers), ("hidden", sim.architecture.hidden_size),
        ("experts_per_token", sim.architecture.experts_per_token),
        ("moe_layers", sim.architecture.moe_layers or (
            sim.architecture.experts and (sim.architecture.layers or shape.layers))))
        if value}
    shape = msgspec.structs.replace(shape, **arch)
    a = sim.architecture
    if sim.version_tensors or (a.layers and a.experts):  # given, or the shape given
        shape = msgspec.structs.replace(shape, tensors=sim.version_tensors or version_tensors(
            layers=shape.layers, moe_layers=shape.moe_layers, experts=a.experts))
    overrides = {key: value for key, value in msgspec.structs.asdict(
        sim.hardware_overrides).items() if value is not None}
    hardware = msgspec.structs.replace(load_hardware(sim.hardware), **overrides)
    plan = simulation_plan(config, hardware)
    hardware = msgspec.structs.replace(hardware,
                                       devices_per_rollout_worker=plan.rollout.devices,
                                       devices_per_trainer_shard=plan.trainer.devices)
    return Costs(hardware, shape, plan)


def simulation_plan(config: Config, hardware: Hardware) -> Plan:
    """The layouts and the weight path of ``config``'s simulate section. A layout given
    sets its role's devices per worker; a hardware override that disagrees exits 2."""
    sim, shards = config.simulate, config.trainer.num_shards
    r, t = sim.rollout_layout, sim.trainer_layout
    rollout = rollout_layout(r.tp, r.pp, r.ep, hardware.devices_per_rollout_worker)
    trainer = trainer_layout(t.tp, t.pp, t.cp, t.ep, t.dp, hardware.devices_per_trainer_shard,
                             shards)
    for layout, key, given in (
            (rollout, "devices_per_rollout_worker",
             sim.hardware_overrides.devices_per_rollout_worker),
            (trainer, "devices_per_trainer_shard",
             sim.hardware_overrides.devices_per_trainer_shard)):
        if layout.given and given and given != layout.devices:
            raise ConfigError(f"config error: simulate.hardware_overrides.{key} = {given}: "
                              f"the layout given spans {layout.devices} devices")
    if hardware.nic_rails and sim.weights_rails > hardware.nic_rails:
        raise ConfigError(f"config error: simulate.weights_rails = {sim.weights_rails}: more "
                          f"than the hardware's nic_rails = {hardware.nic_rails}")
    return Plan(rollout=rollout, trainer=trainer, shards=shards,
                weights_path=sim.weights_path, weights_rails=sim.weights_rails,
                version_bytes_per_parameter=sim.version_bytes_per_parameter,
                version_fraction=sim.version_fraction, version_native=sim.version_native,
                recompute=sim.recompute == "full",
                refit_offload=sim.refit_offload,
                optimizer_bytes_per_parameter=sim.optimizer_bytes_per_parameter,
                sleep_level=sim.sleep_level)


def _task(config: Config) -> tuple[PromptSource, Sequence[Prompt]]:
    task = config.task
    if reference_length(task) is not None:  # a built-in task with reference completions
        source, _, eval_prompts = build_task(config)
        return source, eval_prompts
    # Other tasks' prompts matter only through their lengths: arithmetic's ids and texts.
    if not config.simulate.prompt_tokens:
        raise ConfigError(f'config error: simulate.prompt_tokens = 0: task.kind = '
                          f'"{task.kind}" is simulated with prompts of a given length: set it')
    arithmetic = ArithmeticTask(seed=task.seed)
    return arithmetic, arithmetic.eval_prompts(task.eval_size)


def simulate(config: Config, costs: Costs | None = None) -> RunSummary:
    """Simulates ``config`` into its run.output_dir (which must be ready to write);
    ``costs``: instead of simulate.hardware's (a calibration tries its own)."""
    check_live(config)  # autopilot.keys, before the run directory is written
    costs = costs or simulation_costs(config)
    lengths = length_law(config)
    config = msgspec.structs.replace(
        config, run=msgspec.structs.replace(config.run, checkpoint_every=0))
    source, eval_prompts = _task(config)
    if time_shared(config):
        check_time_shared(config, costs)
    lend_plan(config, costs)  # exits 2 naming the key where lending cannot run
    kv_limit = costs.kv_tokens(config.rollout.memory_fraction)
    at_step = config.simulate.preemption_step
    if at_step > config.run.num_steps:
        raise ConfigError(f"config error: simulate.preemption_step = {at_step}: after the "
                          f"run's last step (run.num_steps = {config.run.num_steps})")
    probe: list[Preemption] = []
    engines: dict[int, SimEngine] = {}
    lent: list[LendRecord] = []
    out = RunWriter(config.run.output_dir, config, simulated=costs.hardware.name,
                    line_flushed=False)

    async def main() -> RunSummary:
        # The loop's own time() (what virtual_now reads), without looking the loop up.
        clock = asyncio.get_running_loop().time
        # A clean stop hands single-turn rollouts back; multi-turn ones restart.
        multi_turn = config.task.environment.enabled or config.task.kind == "agent"
        preemption = Preemption(at_step, clock, hands_back=not multi_turn) if at_step else None
        probe.extend([preemption] if preemption else [])
        engines.update({rank: SimEngine(rank, costs, clock,
                                        drain=config.weights.update_mode == "drain",
                                        record_spans=config.run.record_spans,
                                        kv_limit=kv_limit)
                        for rank in range(config.rollout.num_workers)})
        rollout: dict[int, RolloutClient] = {
            rank: SimRollout(rank, engine, config, lengths, clock, preemption)
            for rank, engine in engines.items()}
        lending = (SimLending(config, costs, clock, engines, kv_limit,
                              lambda rank, engine, fallback: SimRollout(
                                  rank, engine, config, lengths, clock, fallback=fallback))
                   if config.simulate.lend != "off" else None)
        training = SimTraining(config, costs, clock, engines, lending)
        trainers: list[TrainerClient] = [SimTrainer(rank, training)
                                         for rank in range(config.trainer.num_shards)]
        evaluator = (SimEvaluator(config.simulate.reward_p)
                     if config.run.eval_on == "idle_cpu" else None)
        # Time-shared devices: the weights never leave them (no branch into SimWeights).
        weights = (SimLocalWeights(engines) if time_shared(config)
                   else SimWeights(engines, costs, config.weights.bucket_mb << 20))
        # The reference and the critic beside every shard (PPO's dataflow), as real runs.
        roles = (SimRoles(config, training)
                 if config.has_reference or config.has_critic else None)
        workers = Workers(rollout=rollout, trainers=trainers, weights=weights,
                          evaluator=evaluator,
                          stages=[SimRoleStages(rank, roles)
                                  for rank in range(config.trainer.num_shards)] if roles else [],
                          lending=lending if config.simulate.lend == "autopilot" else None)
        orchestrator = (
            Orchestrator(config, out, source, eval_prompts, workers, clock=clock)
            if preemption is None else ProbedOrchestrator(
                preemption, config, out, source, eval_prompts, workers, clock=clock))
        async with anyio.create_task_group() as running:
            for engine in engines.values():
                running.start_soon(engine.run)
            if lending is not None:
                lending.start((orchestrator.pool, lambda: orchestrator.version,
                               lambda: len(orchestrator.queue)), running)
            summary = await orchestrator.run()
            lent.extend([lending.record()] if lending is not None else [])
            running.cancel_scope.cancel()
        return summary

    summary = run_virtual(main)
    # No OS measured a simulated worker: no CPU-time cross-check for the report to show.
    (out.path / USAGE).unlink(missing_ok=True)
    (out.path / SIM_STATS).write_bytes(msgspec.json.format(msgspec.json.encode(SimStats(
        hardware=costs.hardware.name, kv_limit_tokens=kv_limit,
        requests=sum(e.requests for e in engines.values()),
        kv_queued=sum(e.kv_queued for e in engines.values()),
        kv_wait_s=sum(e.kv_wait_s for e in engines.values()),
        peak_kv_tokens=max((e.kv_peak for e in engines.values()), default=0.0),
        time_shared=time_shared(config), weights_path=config.simulate.weights_path,
        version_stages=msgspec.structs.asdict(costs.version_stages(
            config.rollout.num_workers, config.weights.bucket_mb << 20)),
        releases=sum(e.releases for e in engines.values()),
        refit=refit_record(costs) if time_shared(config) else {},
        recompute_s=sum(e.recompute_s for e in engines.values()),
        stop=probe[0].cost if probe else None,
        lend=lent[0] if lent else None))))
    return summary
