"""The reference and the critic on workers of their own (placement "own"), without Ray:
the same numbers as beside the trainer shard (reference logprobs, GAE advantages, the
policy's and the critic's updates), on ordinary, zero-variance and one-member groups
and multi-turn masks; a lost step trains nothing; one critic shard fitting several
trainer shards' batches cuts them into the policy's updates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_ppo_roles import GROUPS, group, model_dir, shard  # noqa: F401 (a fixture)

from async_rl.control.batching import shard_batches
from buffers.records import Group
from workers.model_config import ModelConfig
from workers.rollout.config import Sampling
from workers.trainer.config import TrainerConfig
from workers.trainer.own_roles import CriticWorker, ReferenceWorker
from workers.trainer.ppo_stages import merged_updates
from workers.trainer.roles_config import CriticConfig
from workers.trainer.shard import TrainerShard

CASES = {
    "ordinary": GROUPS,
    "zero-variance rewards": [group([3, 5, 4, 2], [1.0] * 4, "a"),
                              group([6, 2, 3, 3], [1.0] * 4, "b")],
    "one-member group": [group([4], [1.0], "a"), group([6, 2, 3, 3], [0.0, 0.0, 1.0, 0.0], "b")],
    "multi-turn masks": [group([5, 4], [1.0, 0.0], "m", masks=[(1, 0, 0, 1, 1), (1, 1, 0, 1)]),
                         group([3, 3], [1.0, 0.0], "n")],
}


def own_workers(model_dir: Path, config: TrainerConfig, critic: CriticConfig
                ) -> tuple[TrainerShard, ReferenceWorker, CriticWorker]:
    policy = TrainerShard(rank=0, world_size=1, model=ModelConfig(path=str(model_dir)),
                          trainer=config, seed=0, sampling=Sampling(temperature=1.0),
                          record_spans=False, own_roles=("reference", "critic"))
    policy.setup()
    common = {"rank": 0, "model": ModelConfig(path=str(model_dir)), "trainer": config,
              "temperature": 1.0, "record_spans": False}
    reference = ReferenceWorker(path=str(model_dir), **common)  # type: ignore[arg-type]
    critic_worker = CriticWorker(critic=critic, **common)  # type: ignore[arg-type]
    reference.setup()
    critic_worker.setup()
    return policy, reference, critic_worker


@pytest.mark.parametrize("case", list(CASES))
def test_own_roles_compute_what_the_roles_beside_the_shard_compute(
        model_dir: Path, case: str) -> None:  # noqa: F811
    groups: list[Group] = CASES[case]
    config = TrainerConfig(groups_per_step=2, kl_coef=0.05, kl_in_reward=True, lr=1e-2)
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
        (advantages,) = critic_worker.advantages(step, [logprobs])
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
