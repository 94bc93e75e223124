"""The reference and the critic on workers of their own (placement "own"), without Ray:
the same numbers as beside the trainer shard (reference logprobs, GAE advantages, the
policy's and the critic's updates), on ordinary, zero-variance and one-member groups
and multi-turn masks; a lost step trains nothing; one critic shard fitting several
trainer shards' batches cuts them into the policy's updates, and two critic shards in
a DDP group of their own fit what one fits alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_ppo_roles import GROUPS, group, model_dir, shard  # noqa: F401 (a fixture)

from buffers.common.records import Group
from buffers.common.reports import CriticStepResult
from buffers.plan.batching import shard_batches
from workers.model_config import ModelConfig
from workers.rollout.config import Sampling
from workers.trainer.config import TrainerConfig
from workers.trainer.ppo_stages import merged_updates
from workers.trainer.role_workers import CriticWorker, ReferenceWorker
from workers.trainer.roles_config import CriticConfig
from workers.trainer.shard import TrainerShard
from workers.trainer.spec import CriticSpec, ReferenceSpec, TrainerSpec

CASES = {
    # An ordinary group, a one-member group and a multi-turn trajectory's masks.
    "mixed": [group([3, 5, 4, 2], [1.0, 0.0, 0.0, 1.0], "a"), group([4], [1.0], "b"),
              group([5, 4], [1.0, 0.0], "m", masks=[(1, 0, 0, 1, 1), (1, 1, 0, 1)])],
    "zero-variance rewards": [group([3, 5, 4, 2], [1.0] * 4, "a"),
                              group([6, 2, 3, 3], [1.0] * 4, "b")],
}


def own_workers(model_path: Path, config: TrainerConfig, critic: CriticConfig
                ) -> tuple[TrainerShard, ReferenceWorker, CriticWorker]:
    policy = TrainerShard(TrainerSpec(
        rank=0, world_size=1, model=ModelConfig(path=str(model_path)), trainer=config, seed=0,
        sampling=Sampling(temperature=1.0), record_spans=False, own_roles=("reference", "critic")))
    policy.setup()
    model = ModelConfig(path=str(model_path))
    reference = ReferenceWorker(ReferenceSpec(
        path=str(model_path), rank=0, model=model, trainer=config, temperature=1.0,
        record_spans=False))
    critic_worker = CriticWorker(CriticSpec(
        critic=critic, rank=0, model=model, trainer=config, temperature=1.0,
        record_spans=False))
    reference.setup()
    critic_worker.setup()
    return policy, reference, critic_worker


@pytest.mark.parametrize("case", list(CASES))
def test_own_roles_compute_what_the_roles_beside_the_shard_compute(
        model_dir: Path, case: str) -> None:  # noqa: F811
    groups: list[Group] = CASES[case]
    config = TrainerConfig(groups_per_step=len(groups), kl_coef=0.05, kl_in_reward=True,
                           lr=1e-2)
    critic = CriticConfig(path=str(model_dir), lr=1e-3, gamma=0.9, lam=0.8)
    beside = shard(model_dir, config, reference=True, critic=critic)
    policy, reference, critic_worker = own_workers(model_dir, config, critic)
    for step in (1, 2):  # the second step's values come from an updated critic
        (batch,), _ = shard_batches(groups, 1, config, step=step)
        tokens = list(batch.groups)
        stages = beside.stages()
        assert not stages.prepare(batch, tokens)
        stages.reference_logprobs(step)
        stages.critic_values(step)
        stages.advantages(step)
        assert stages.step is not None
        expected = [mb.packed.advantages for mb in stages.step.prepared if mb.packed]
        references = [r for r in stages.step.reference if r is not None]
        ours = policy.stages()
        assert not ours.prepare(batch, tokens)
        assert not reference.prepare([batch], [tokens])
        assert not critic_worker.prepare([batch], [tokens])
        (logprobs,) = reference.logprobs(step)
        assert len(logprobs) == len(batch.micro_batches) > 0
        torch.testing.assert_close([r for r in logprobs if r is not None], references)
        ours.take_reference(step, logprobs)
        critic_worker.values(step)
        (advantages,) = critic_worker.advantages(step, [logprobs],
                                                 [ours.policy_logprobs(step)])
        ours.take_advantages(step, advantages)
        assert ours.step is not None
        got = [mb.packed.advantages for mb in ours.step.prepared if mb.packed]
        assert len(got) == len(expected) > 0
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
        a, b = beside.train_step(batch, None), policy.train_step(batch, None)
        assert a.loss.tokens == b.loss.tokens > 0
        assert b.loss.loss_sum == pytest.approx(a.loss.loss_sum, abs=1e-5)
        assert b.kl_sum == pytest.approx(a.kl_sum, abs=1e-6)
        c, d = stages.critic_update(step, 0), critic_worker.update(step)
        assert d.tokens == c.tokens == a.loss.tokens
        assert d.value_loss_sum == pytest.approx(c.value_loss_sum, rel=1e-5, abs=1e-7)
        assert d.grad_norm == pytest.approx(c.grad_norm, rel=1e-4, abs=1e-7)
    assert beside.roles is not None and beside.roles.critic is not None
    for (name, x), (_, y) in zip(beside.roles.critic.module.state_dict().items(),
                                 critic_worker.critic.module.state_dict().items(), strict=True):
        torch.testing.assert_close(y, x, atol=1e-6, rtol=1e-5, msg=name)


def test_the_own_critics_kl_in_the_reward_is_zero_while_the_policy_is_its_reference(
        model_dir: Path) -> None:  # noqa: F811
    """As beside the shard: the behaviour logprobs (-0.5) are the engine's, the KL in
    the reward the trainer's policy's (sent by the shard), so its advantages are those
    without the term."""
    critic = CriticConfig(path=str(model_dir), lr=1e-3)
    out = {}
    for coef in (5.0, 0.0):
        config = TrainerConfig(groups_per_step=2, kl_coef=coef, kl_in_reward=True)
        policy, reference, critic_worker = own_workers(model_dir, config, critic)
        (batch,), _ = shard_batches(GROUPS, 1, config, step=1)
        tokens = list(batch.groups)
        assert not policy.stages().prepare(batch, tokens)
        assert not reference.prepare([batch], [tokens])
        assert not critic_worker.prepare([batch], [tokens])
        critic_worker.values(1)
        (advantages,) = critic_worker.advantages(1, reference.logprobs(1),
                                                 [policy.stages().policy_logprobs(1)])
        out[coef] = [a for a in advantages if a is not None]
    assert len(out[5.0]) == len(out[0.0]) > 0
    assert all(torch.equal(a, b) for a, b in zip(out[5.0], out[0.0], strict=True))


def test_a_step_an_own_role_lost_trains_nothing(model_dir: Path) -> None:  # noqa: F811
    config = TrainerConfig(groups_per_step=2, kl_coef=0.05)
    critic = CriticConfig(path=str(model_dir))
    policy, reference, critic_worker = own_workers(model_dir, config, critic)
    before = {k: v.clone() for k, v in policy.module.state_dict().items()}
    (batch,), _ = shard_batches(GROUPS, 1, config, step=1)
    assert not policy.stages().prepare(batch, list(batch.groups))
    assert reference.prepare([batch], None)  # its groups' rollout worker died
    policy.stages().step_lost(1)
    assert policy.train_step(batch, None).samples_lost
    assert critic_worker.prepare([batch], None)
    assert critic_worker.update(1).samples_lost
    for name, value in policy.module.state_dict().items():
        assert torch.equal(value, before[name])


def test_one_critic_shard_cuts_several_batches_into_the_policys_updates() -> None:
    config = TrainerConfig(groups_per_step=4, mini_batches=2, micro_batch_tokens=16)
    groups = [group([3, 5, 4, 2], [1.0, 0.0, 0.0, 1.0], name) for name in "abcd"]
    batches, _ = shard_batches(groups, 2, config, step=1)
    assert len(batches) == 2 and batches[0].updates == batches[1].updates
    assert len(batches[0].updates) == 2
    items = [[(shard, index) for index in range(len(b.micro_batches))]
             for shard, b in enumerate(batches)]
    merged = merged_updates(batches, items)
    assert len(merged) == 2
    for update, cut in enumerate(merged):
        # Update u holds shard 0's micro-batches of u, then shard 1's.
        assert cut == batches[0].per_update(items[0])[update] + batches[1].per_update(
            items[1])[update]
    assert sorted(i for cut in merged for i in cut) == sorted(i for b in items for i in b)


FOUR_GROUPS = [group([3, 5, 4, 2], [1.0, 0.0, 0.0, 1.0], "a"),
               group([6, 2, 3, 3], [0.0, 0.0, 1.0, 0.0], "b"),
               group([2, 4, 4, 5], [1.0, 1.0, 0.0, 0.0], "c"),
               group([5, 3, 2, 6], [0.0, 1.0, 0.0, 0.0], "d")]
TWO_SHARDS = TrainerConfig(groups_per_step=4, num_shards=2, mini_batches=2)


def _critic_steps(model_path: str, rank: int, world_size: int, port: int
                  ) -> tuple[list[list[torch.Tensor | None]], list[CriticStepResult],
                             torch.Tensor]:
    """Critic shard ``rank`` of ``world_size`` on its share of a 2-shard plan, two steps:
    (each step's advantages, its update results, its head's weights)."""
    critic = CriticConfig(path=model_path, lr=1e-2, gamma=0.9, lam=0.8)
    worker = CriticWorker(CriticSpec(
        critic=critic, rank=rank, world_size=world_size, model=ModelConfig(path=model_path),
        trainer=TWO_SHARDS, temperature=1.0, master_port=port, record_spans=False))
    worker.setup()
    advantages, results = [], []
    try:
        for step in (1, 2):
            batches, _ = shard_batches(FOUR_GROUPS, 2, TWO_SHARDS, step=step)
            mine = batches[rank::world_size]
            assert not worker.prepare(mine, [list(b.groups) for b in mine])
            worker.values(step)
            advantages += worker.advantages(step)
            results.append(worker.update(step))
    finally:
        worker.shutdown()
    return advantages, results, worker.critic.module.head.weight.detach().clone()


def _critic_shard(rank: int, model_path: str, port: int, results: Any) -> None:
    """A spawned critic shard; its tensors go back as numpy arrays (torch's shared
    memory would not outlive the process)."""
    advantages, updates, head = _critic_steps(model_path, rank, 2, port)
    results.put((rank, ([[None if a is None else a.numpy() for a in step]
                         for step in advantages], updates, head.numpy())))


def test_two_own_critic_shards_in_ddp_fit_what_one_fits_alone(
        model_dir: Path) -> None:  # noqa: F811
    """Critic shards 0 and 1 (DDP, each with one trainer shard's batch) against one
    critic worker holding both batches: the same whitened advantages, value losses and
    weights."""
    import multiprocessing as mp

    from workers.common.ports import free_port

    alone, alone_results, alone_head = _critic_steps(str(model_dir), 0, 1, free_port())
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = free_port()
    workers = [context.Process(target=_critic_shard, args=(rank, str(model_dir), port, results))
               for rank in (0, 1)]
    for process in workers:
        process.start()
    got = dict(results.get() for _ in workers)
    for process in workers:
        process.join(timeout=60)
    assert sorted(got) == [0, 1]
    # Per step, shard r's advantages are the single worker's batch r's.
    for step in range(2):
        for rank in (0, 1):
            ours = [torch.from_numpy(a) for a in got[rank][0][step] if a is not None]
            theirs = [a for a in alone[2 * step + rank] if a is not None]
            assert len(ours) == len(theirs) > 0
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        losses = sum(got[r][1][step].value_loss_sum for r in (0, 1))
        assert losses == pytest.approx(alone_results[step].value_loss_sum, rel=1e-4)
    heads = [torch.from_numpy(got[rank][2]) for rank in (0, 1)]
    torch.testing.assert_close(heads[0], alone_head, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(heads[1], heads[0])  # replicas
