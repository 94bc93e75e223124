"""The run's roster (``async_rl.roster``), without Ray: every worker a config gives, its
cores, bundle and spec; role paths resolved once (a resumed policy, an initial
reference); which shards write checkpoints; the CPUs a local Ray needs; the registry."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from async_rl.config import Config
from async_rl.roster import Bundle, Roster, Start, registry_table, roster
from workers import layout
from workers.eval.spec import EvaluatorSpec
from workers.layout import WorkerIdentity
from workers.rollout.spec import RolloutSpec
from workers.trainer.spec import CriticSpec, ReferenceSpec, TrainerSpec

CORES = tuple(range(16))
POLICY = "runs/policy"


def config(**sections: dict[str, Any]) -> Config:
    return msgspec.convert({"model": {"path": POLICY}, **sections}, Config)


def plan(cfg: Config, start: Start | None = None) -> Roster:
    return roster(cfg, start, available=CORES)


def names(of: Roster) -> list[str]:
    return [entry.name for entry in of.entries]


def trainer_specs(of: Roster) -> list[TrainerSpec]:
    specs = [entry.spec for entry in of.of("trainer")]
    assert all(isinstance(spec, TrainerSpec) for spec in specs)
    return specs  # type: ignore[return-value]


PPO_BESIDE: dict[str, Any] = {
    "algorithm": {"advantage": "gae"}, "trainer": {"kl_coef": 0.1, "num_shards": 2},
    "critic": {"num_shards": 2}}
PPO_OWN: dict[str, Any] = {
    "algorithm": {"advantage": "gae"}, "trainer": {"kl_coef": 0.1, "num_shards": 2},
    "reference": {"placement": "own"}, "critic": {"placement": "own"}}


def test_the_default_grpo_run_is_one_rollout_worker_and_one_trainer_shard() -> None:
    cfg = config()
    got = plan(cfg)
    assert names(got) == ["rollout-0", "trainer-0"]
    rollout, trainer = got.entries
    assert isinstance(rollout.spec, RolloutSpec) and isinstance(trainer.spec, TrainerSpec)
    assert rollout.bundle == Bundle(group="rollout", index=0)
    assert trainer.bundle == Bundle(group="trainer", index=0)
    assert rollout.devices == (0,) and trainer.devices == (1,)  # cores of their own
    assert rollout.spec.cpu_ids == rollout.devices and trainer.spec.cpu_ids == trainer.devices
    # Nothing beside the policy; the shards' process group is addressed once placed.
    spec = trainer.spec
    assert (spec.reference_path, spec.critic, spec.own_roles) == ("", None, ())
    assert (spec.master_addr, spec.master_port) == ("", 0)
    assert spec.sampling.temperature == cfg.rollout.temperature
    assert spec.sampling.max_new_tokens == cfg.rollout.max_new_tokens
    assert got.own == [] and not got.critic_beside_trainer
    assert got.cpus == cfg.rollout.cpus_per_worker + cfg.trainer.cpus_per_shard


def test_each_rollout_worker_has_its_own_seed_rank_and_cores() -> None:
    got = plan(config(run={"seed": 7}, rollout={"num_workers": 3, "cpus_per_worker": 2},
                      trainer={"num_shards": 2, "cpus_per_shard": 3}))
    assert names(got) == ["rollout-0", "rollout-1", "rollout-2", "trainer-0", "trainer-1"]
    rollout = [entry.spec for entry in got.of("rollout")]
    assert len(rollout) == 3
    assert [(s.rank, s.seed) for s in rollout] == [(0, 7), (1, 8), (2, 9)]  # type: ignore[union-attr]
    assert [e.devices for e in got.entries] == [(0, 1), (2, 3), (4, 5), (6, 7, 8), (9, 10, 11)]
    assert [s.seed for s in trainer_specs(got)] == [7, 7]  # replicas start alike
    assert [s.world_size for s in trainer_specs(got)] == [2, 2]
    assert got.cpus == 3 * 2 + 2 * 3


def test_ppo_beside_the_trainer_shards_adds_no_worker_and_resolves_the_role_paths() -> None:
    got = plan(config(**PPO_BESIDE))
    assert names(got) == ["rollout-0", "trainer-0", "trainer-1"]
    specs = trainer_specs(got)
    assert len(specs) == 2
    for spec in specs:
        assert spec.reference_path == POLICY  # "": the policy's initial weights
        assert spec.critic is not None and spec.critic.path == POLICY
        assert spec.own_roles == ()
    assert got.critic_beside_trainer


def test_ppo_on_workers_of_their_own_adds_the_reference_and_critic_workers() -> None:
    cfg = config(**PPO_OWN)
    got = plan(cfg)
    assert names(got) == ["rollout-0", "trainer-0", "trainer-1", "reference-0", "critic-0"]
    own = got.own
    assert [e.bundle for e in own] == [Bundle(group="own", index=0), Bundle(group="own", index=1)]
    assert [e.devices for e in own] == [(3,), (4,)]  # after the trainer shards' cores
    reference, critic = (e.spec for e in own)
    assert isinstance(reference, ReferenceSpec) and reference.path == POLICY
    assert isinstance(critic, CriticSpec) and critic.critic.path == POLICY
    assert (critic.world_size, critic.master_addr, critic.master_port) == (1, "", 0)
    assert reference.temperature == critic.temperature == cfg.rollout.temperature
    for spec in trainer_specs(got):  # the shards take the roles' outputs, build neither
        assert (spec.reference_path, spec.critic) == ("", None)
        assert spec.own_roles == ("reference", "critic")
    assert not got.critic_beside_trainer
    assert got.cpus == 1 + 2 + 2  # the roles' workers have trainer.cpus_per_shard each


def test_two_critic_workers_of_their_own_form_one_group() -> None:
    got = plan(config(algorithm={"advantage": "gae"}, trainer={"num_shards": 4},
                      critic={"placement": "own", "num_shards": 2}))
    critics = [e.spec for e in got.of("critic")]
    assert [(c.rank, c.world_size) for c in critics] == [(0, 2), (1, 2)]  # type: ignore[union-attr]
    assert got.of("reference") == []  # no KL term: no reference at all


def test_colocated_pairs_share_their_cores_and_their_bundle() -> None:
    got = plan(config(run={"colocate": True}, rollout={"num_workers": 2},
                      trainer={"num_shards": 2}))
    assert got.layout.colocated
    rollout, trainer = got.of("rollout"), got.of("trainer")
    assert [e.devices for e in rollout] == [e.devices for e in trainer] == [(0,), (1,)]
    assert all(e.bundle is not None and e.bundle.shared for e in [*rollout, *trainer])
    assert [e.bundle.index for e in trainer] == [0, 1]  # type: ignore[union-attr]
    assert got.cpus == 4  # each pair's bundle holds both workers' CPUs


def test_rollout_workers_move_their_own_process_to_the_trainers_cores_when_asked() -> None:
    """rollout.worker_cores: "engine" (the default) keeps a worker's process beside its
    engine; "trainer" moves it to every trainer shard's cores, engines added by the
    autopilot included; with co-located roles there is nowhere else to go."""
    sections: dict[str, Any] = {"rollout": {"num_workers": 2},
                                "trainer": {"num_shards": 2, "cpus_per_shard": 2}}
    default = plan(config(**sections))
    assert [e.spec.worker_cpu_ids for e in default.of("rollout")] == [(), ()]  # type: ignore[union-attr]
    moved = plan(config(rollout={"num_workers": 2, "worker_cores": "trainer"},
                        trainer=sections["trainer"],
                        autopilot={"enabled": True, "max_rollout_workers": 3}))
    rollout = moved.of("rollout")
    assert [e.devices for e in rollout] == [(0,), (1,)]
    assert [e.spec.cpu_ids for e in rollout] == [(0,), (1,)]  # type: ignore[union-attr]
    assert [e.spec.worker_cpu_ids for e in rollout] == [(2, 3, 4, 5)] * 2  # type: ignore[union-attr]
    assert len(moved.lendable) == 1
    assert moved.lendable[0].spec.worker_cpu_ids == (2, 3, 4, 5)  # type: ignore[union-attr]
    colocated = plan(config(run={"colocate": True}, rollout={"worker_cores": "trainer"}))
    assert [e.spec.worker_cpu_ids for e in colocated.of("rollout")] == [()]  # type: ignore[union-attr]


def test_time_shared_devices_lay_out_as_colocated_for_the_simulator() -> None:
    assert plan(config(run={"colocate": "time"})).layout.colocated
    assert not plan(config()).layout.colocated


def test_the_idle_cpu_evaluator_has_no_cores_bundle_or_registry_line() -> None:
    got = plan(config(run={"eval_on": "idle_cpu"}))
    assert names(got) == ["rollout-0", "trainer-0", "evaluator"]
    (evaluator,) = got.of("evaluator")
    assert (evaluator.cpus, evaluator.bundle, evaluator.devices) == (0, None, ())
    assert evaluator.spec == EvaluatorSpec(model=config().model,
                                           max_new_tokens=config().rollout.max_new_tokens)
    assert got.cpus == 2
    with pytest.raises(ValueError, match="not in the registry"):
        evaluator.identity()
    placed = {e.name: e.identity(pid=10 + i) for i, e in enumerate(got.entries[:2])}
    assert [w.name for w in got.registry(placed)] == ["rollout-0", "trainer-0"]


def test_a_resumed_policy_starts_from_its_checkpoint_and_the_roles_from_the_initial_one(
) -> None:
    checkpoint = "runs/x/checkpoints/step-000004/trainer"
    got = plan(config(run={"eval_on": "idle_cpu"}, **PPO_OWN),
               Start(policy_path=checkpoint, version=4))
    assert got.start.resumed and got.start.version == 4
    policies = [e.spec.model.path for e in got.entries]
    assert len(policies) == 6
    assert policies == [checkpoint] * 6  # every worker's model section: the checkpoint's
    reference, critic = (e.spec for e in got.own)
    assert isinstance(reference, ReferenceSpec) and reference.path == POLICY
    assert isinstance(critic, CriticSpec) and critic.critic.path == POLICY
    beside = plan(config(**PPO_BESIDE), Start(policy_path=checkpoint, version=4))
    for spec in trainer_specs(beside):
        assert spec.model.path == checkpoint
        assert spec.reference_path == POLICY and spec.critic is not None
        assert spec.critic.path == POLICY
    assert not plan(config()).start.resumed


def test_a_role_path_that_is_set_stays_as_it_is() -> None:
    got = plan(config(trainer={"kl_coef": 0.0}, reference={"path": "elsewhere"}))
    (spec,) = trainer_specs(got)
    assert spec.reference_path == "elsewhere"  # measures the KL without penalising it
    assert trainer_specs(plan(config()))[0].reference_path == ""  # no reference built


@pytest.mark.parametrize(("backend", "every", "writes"), [
    ("ddp", 20, [True, False, False]),  # replicas: shard 0's copy is the checkpoint
    ("fsdp2", 20, [True, True, True]),  # each shard writes its own part
    ("ddp", 0, [False, False, False]),  # only the end of the run: no buffers ahead
    ("fsdp2", 0, [False, False, False]),
])
def test_which_shards_write_checkpoints(backend: str, every: int, writes: list[bool]) -> None:
    got = plan(config(trainer={"backend": backend, "num_shards": 3},
                      run={"checkpoint_every": every}))
    assert [spec.writes_checkpoints for spec in trainer_specs(got)] == writes


def test_run_settings_reach_every_spec() -> None:
    got = plan(config(run={"record_spans": False, "save_merged": True},
                      model={"path": POLICY, "lora": {"rank": 4}}, weights={"transport": "gloo"}))
    assert all(not e.spec.record_spans for e in got.entries
               if not isinstance(e.spec, EvaluatorSpec))
    (spec,) = trainer_specs(got)
    assert spec.save_merged and spec.weights.transport == "gloo"


def test_the_registry_lists_the_critic_beside_the_shards_as_their_processes() -> None:
    got = plan(config(**PPO_BESIDE))
    placed = {e.name: e.identity(node="10.0.0.1", node_id="n", pid=100 + i)
              for i, e in enumerate(got.entries)}
    registry = got.registry(placed)
    assert [w.name for w in registry] == ["rollout-0", "trainer-0", "trainer-1", "critic-0",
                                          "critic-1"]
    assert [w.pid for w in registry] == [100, 101, 102, 101, 102]
    own = plan(config(**PPO_OWN))
    placed = {e.name: e.identity(pid=i + 1) for i, e in enumerate(own.entries)}
    assert [w.name for w in own.registry(placed)] == [
        "rollout-0", "trainer-0", "trainer-1", "reference-0", "critic-0"]
    table = registry_table(registry).splitlines()
    assert len(table) == 6 and table[0].split() == ["worker", "node", "devices", "pid"]
    assert table[4].split() == ["critic-0", "10.0.0.1", "cpu:1", "101"]


def test_the_fewest_workers_and_the_fewest_cores() -> None:
    got = roster(config(rollout={"cpus_per_worker": 2}, trainer={"cpus_per_shard": 2}),
                 available=(0,))
    assert names(got) == ["rollout-0", "trainer-0"]
    # One core: both share it (contention, never a failure); Ray still needs 4 CPUs.
    assert [e.devices for e in got.entries] == [(0, 0), (0, 0)]
    assert got.cpus == 4


@settings(max_examples=60, deadline=None)
@given(workers=st.integers(1, 4), shards=st.integers(1, 4), cpus_rollout=st.integers(1, 3),
       cpus_trainer=st.integers(1, 3), colocate=st.booleans(), own=st.booleans())
def test_every_config_gives_each_role_its_count_of_uniquely_named_workers(
        workers: int, shards: int, cpus_rollout: int, cpus_trainer: int, colocate: bool,
        own: bool) -> None:
    sections: dict[str, Any] = {
        "rollout": {"num_workers": workers, "cpus_per_worker": cpus_rollout},
        "trainer": {"num_shards": shards, "cpus_per_shard": cpus_trainer, "kl_coef": 0.1},
        "run": {"colocate": colocate}}
    if own:
        sections["reference"] = {"placement": "own"}
    got = plan(config(**sections))
    assert len(got.of("rollout")) == workers and len(got.of("trainer")) == shards
    assert len(got.own) == int(own)
    assert len(set(names(got))) == len(got.entries)
    for role in ("rollout", "trainer"):
        assert [e.rank for e in got.of(role)] == list(range(len(got.of(role))))
    assert got.cpus == (workers * cpus_rollout + (shards + int(own)) * cpus_trainer)
    assert all(len(e.devices) == e.cpus for e in got.entries)
    assert all(e.bundle is not None and e.bundle.shared == colocate
               for e in [*got.of("rollout"), *got.of("trainer")])
    placed = {e.name: e.identity() for e in got.entries}
    registry = got.registry(placed)
    assert len(registry) == workers + shards + int(own)
    assert all(isinstance(w, WorkerIdentity) for w in registry)


def test_without_cores_given_the_run_lays_out_on_usable_cores_in_their_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert layout.usable_cores() == tuple(sorted(layout.usable_cores()))  # lowest first
    monkeypatch.setattr(layout, "usable_cores", lambda: (5, 2, 7, 3))
    got = roster(config(**PPO_OWN))
    assert [e.devices for e in got.entries] == [(5,), (2,), (7,), (3,), (5,)]
