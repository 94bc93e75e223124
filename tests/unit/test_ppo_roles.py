"""The PPO dataflow on one trainer shard, without Ray: the reference's logprobs and the KL
term (in the loss, and in the reward, of the trainer's policy), the critic's values,
GAE's advantages on the packed layout, the critic's update, lost groups, and the
critic's state through a checkpoint."""

from __future__ import annotations

import collections
from pathlib import Path

import msgspec
import pytest
import torch
from host_reads import HostReads

from async_rl.models.tiny_model import build_config
from buffers.common.records import NO_VERSION, Group, Prompt, Sample, make_group
from buffers.plan.batching import shard_batches
from workers.model_config import ModelConfig
from workers.rollout.config import Sampling
from workers.trainer.config import TrainerConfig
from workers.trainer.gae import moments, whiten
from workers.trainer.roles_config import CriticConfig
from workers.trainer.shard import TrainerShard
from workers.trainer.spec import TrainerSpec


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny Qwen2: a step takes milliseconds."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("roles-model")
    Qwen2ForCausalLM(build_config()).save_pretrained(out)
    return out


def group(lengths: list[int], rewards: list[float], name: str = "p",
          masks: list[tuple[int, ...]] | None = None) -> Group:
    samples = []
    for i, (n, r) in enumerate(zip(lengths, rewards, strict=True)):
        mask = masks[i] if masks else ()
        samples.append(Sample(
            token_ids=tuple(range(3 + i, 3 + i + n)), logprobs=(-0.5,) * n,
            versions=tuple(0 if not mask or m else NO_VERSION for m in (mask or (1,) * n)),
            finish_reason="stop", text="x", reward=r, loss_mask=mask))
    return make_group(Prompt(prompt_id=name, text="q", answer="0"), (1, 2), samples)


def shard(model_dir: Path, config: TrainerConfig, *, reference: bool,
          critic: CriticConfig | None) -> TrainerShard:
    out = TrainerShard(TrainerSpec(
        rank=0, world_size=1, model=ModelConfig(path=str(model_dir)), trainer=config, seed=0,
        sampling=Sampling(temperature=1.0), record_spans=False,
        reference_path=str(model_dir) if reference else "", critic=critic))
    out.setup()
    return out


GROUPS = [group([3, 5, 4, 2], [1.0, 0.0, 0.0, 1.0], "a"),
          group([6, 2, 3, 3], [0.0, 0.0, 1.0, 0.0], "b")]


def test_kl_is_zero_at_the_start_then_grows_and_the_term_changes_the_update(
        model_dir: Path) -> None:
    after = {}
    for coef in (0.0, 5.0):
        config = TrainerConfig(groups_per_step=2, kl_coef=coef, lr=1e-2)
        trainer = shard(model_dir, config, reference=True, critic=None)
        stages = trainer.stages()
        kls = []
        for step in (1, 2, 3):
            (batch,), _ = shard_batches(GROUPS, 1, config, step=step)
            assert not stages.prepare(batch, list(batch.groups))
            stages.reference_logprobs(step)
            assert stages.step is not None and len(stages.step.reference) == len(
                batch.micro_batches) > 0
            result = trainer.train_step(batch, None)
            assert stages.step is None  # no critic: the policy's update ends the step
            assert stages.critic_update(step, 0).tokens == 0  # and the critic's is empty
            assert result.loss.tokens == 28
            kls.append((result.kl_sum, result.kl_max))
        assert kls[0] == (0.0, 0.0)  # the reference is the initial policy, same layout
        assert kls[2][0] > 0 and kls[2][1] > 0
        after[coef] = (kls[2][0], trainer.module.state_dict())
    assert after[5.0][0] < after[0.0][0]  # the term pulls the policy back
    changed = [not torch.equal(after[0.0][1][k], after[5.0][1][k]) for k in after[0.0][1]]
    assert any(changed)


def test_gae_advantages_from_a_fresh_critic_are_the_whitened_rewards(model_dir: Path) -> None:
    config = TrainerConfig(groups_per_step=2)
    critic_config = CriticConfig(path=str(model_dir), lr=1e-3)
    trainer = shard(model_dir, config, reference=False, critic=critic_config)
    stages = trainer.stages()
    (batch,), _ = shard_batches(GROUPS, 1, config, step=1)
    stages.prepare(batch, list(batch.groups))
    stages.reference_logprobs(1)  # no reference: nothing to do
    stages.critic_values(1)
    assert stages.step is not None
    values = [v for v in stages.step.values if v is not None]
    assert len(values) == len(batch.micro_batches) and all(bool((v == 0).all()) for v in values)
    stages.advantages(1)
    # gamma = lam = 1 and V = 0: every token's advantage is its sequence's reward.
    per_token = torch.cat([torch.tensor([s.reward] * s.trained_tokens, dtype=torch.float64)
                           for mb in stages.step.sequences for s in mb])
    expected = whiten(per_token, moments(per_token)).float()
    got = torch.cat([mb.packed.advantages for mb in stages.step.prepared
                     if mb.packed is not None])
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    returns = torch.cat([r for r in stages.step.returns if r is not None])
    torch.testing.assert_close(returns, per_token.float())
    result = trainer.train_step(batch, None)
    assert not result.nonfinite and result.loss.tokens == 28
    critic = stages.critic_update(1, 0)
    assert stages.step is None
    assert critic.tokens == 28 and critic.value_loss_sum > 0 and critic.grad_norm > 0
    stages.prepare(batch, list(batch.groups))
    stages.critic_values(1)
    moved = [v for v in stages.step.values if v is not None]  # type: ignore[union-attr]
    assert any(bool((v != 0).any()) for v in moved)  # the critic learned


def test_the_kl_in_the_reward_is_zero_while_the_policy_is_its_reference(
        model_dir: Path) -> None:
    """The groups' behaviour logprobs (-0.5 a token) are not the policy's: the engine's
    numerics. The KL in the reward is the trainer's policy's, which is its reference:
    exactly 0 a token, so the advantages and returns are those without the term."""
    critic = CriticConfig(path=str(model_dir), lr=1e-3)
    out, kept = {}, {}
    for in_reward in (True, False):
        config = TrainerConfig(groups_per_step=2, kl_coef=5.0, kl_in_reward=in_reward,
                               kl_estimator="k3")
        stages = shard(model_dir, config, reference=True, critic=critic).stages()
        (batch,), _ = shard_batches(GROUPS, 1, config, step=1)
        assert not stages.prepare(batch, list(batch.groups))
        stages.reference_logprobs(1)
        stages.critic_values(1)
        stages.advantages(1)
        assert stages.step is not None
        out[in_reward] = ([mb.packed.advantages for mb in stages.step.prepared if mb.packed],
                          [r for r in stages.step.returns if r is not None])
        kept[in_reward] = stages
    for got, want in zip(out[True], out[False], strict=True):
        assert len(got) == len(want) > 0
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    # What the term compared: the policy's logprobs, the reference's equal to them.
    with_term = kept[True]
    assert with_term.step is not None
    policy = [p for p in with_term.step.policy if p is not None]
    reference = [r for r in with_term.step.reference if r is not None]
    assert len(policy) == len(batch.micro_batches) > 0
    assert all(torch.equal(p, r) for p, r in zip(policy, reference, strict=True))


def test_multi_turn_observation_tokens_get_no_advantage_or_value(model_dir: Path) -> None:
    masked = group([5, 4], [1.0, 0.0], "m", masks=[(1, 0, 0, 1, 1), (1, 1, 0, 1)])
    plain = group([3, 3], [1.0, 0.0], "n")
    config = TrainerConfig(groups_per_step=2)
    trainer = shard(model_dir, config, reference=True,
                    critic=CriticConfig(path=str(model_dir), gamma=0.9, lam=0.8))
    stages = trainer.stages()
    (batch,), _ = shard_batches([masked, plain], 1, config, step=1)
    stages.prepare(batch, list(batch.groups))
    stages.reference_logprobs(1)
    stages.critic_values(1)
    stages.advantages(1)
    assert stages.step is not None
    trained = sum(s.trained_tokens for mb in stages.step.sequences for s in mb)
    assert trained == 3 + 3 + 3 + 3
    for mb, values, returns in zip(stages.step.prepared, stages.step.values,
                                   stages.step.returns, strict=True):
        assert mb.packed is not None and values is not None and returns is not None
        assert mb.packed.advantages.shape == values.shape == returns.shape == (
            sum(mb.lengths),)
    result = trainer.train_step(batch, None)
    assert result.loss.tokens == trained
    assert stages.critic_update(1, 0).tokens == trained


def test_gae_and_the_critic_update_wait_for_the_device_as_designed(model_dir: Path) -> None:
    """Counted as CUDA syncs on the CPU (tests/unit/host_reads.py: C++-side reads such
    as boolean-mask indexing included): a step's GAE reads the device once (every
    micro-batch's moments at once); the critic's update once per optimizer update (its
    gradient norm, for the non-finite skip) and once for its statistics."""
    # Two optimizer updates of two micro-batches or more each.
    config = TrainerConfig(groups_per_step=2, mini_batches=2, micro_batch_tokens=16,
                           kl_coef=0.1, kl_in_reward=True)
    trainer = shard(model_dir, config, reference=True,
                    critic=CriticConfig(path=str(model_dir), gamma=0.9, lam=0.8))
    stages = trainer.stages()
    (batch,), _ = shard_batches(GROUPS, 1, config, step=1)
    updates = batch.per_update(batch.micro_batches)
    assert len(updates) == 2 and all(len(update) > 1 for update in updates)
    stages.prepare(batch, list(batch.groups))
    stages.reference_logprobs(1)
    stages.critic_values(1)
    assert stages.step is not None
    with HostReads() as gae_reads:
        stages.advantages(1)
    assert gae_reads.seen == collections.Counter({"cpu": 1})
    assert all(mb.packed is None or bool(mb.packed.advantages.abs().sum() > 0)
               for mb in stages.step.prepared)
    with HostReads() as update_reads:
        result = stages.critic_update(1, 0)
    assert update_reads.seen == collections.Counter({"__float__": 2, "tolist": 1})
    assert result.tokens == 28 and result.value_loss_sum > 0


def test_lost_groups_train_nothing_anywhere(model_dir: Path) -> None:
    config = TrainerConfig(groups_per_step=2)
    trainer = shard(model_dir, config, reference=True,
                    critic=CriticConfig(path=str(model_dir)))
    before = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    stages = trainer.stages()
    (batch,), _ = shard_batches(GROUPS, 1, config, step=1)
    assert stages.prepare(batch, None)
    stages.reference_logprobs(1)
    stages.critic_values(1)
    stages.advantages(1)
    assert trainer.train_step(batch, None).samples_lost
    assert stages.critic_update(1, 0).samples_lost
    for name, value in trainer.module.state_dict().items():
        assert torch.equal(value, before[name])


def test_a_step_with_nothing_to_train_makes_no_critic_update(model_dir: Path) -> None:
    config = TrainerConfig(groups_per_step=1, overlong="mask")
    trainer = shard(model_dir, config, reference=False,
                    critic=CriticConfig(path=str(model_dir)))
    cut = msgspec.structs.replace(group([3, 3], [0.0, 1.0]),
                                  finish_reasons=("length", "length"))
    (batch,), _ = shard_batches([cut], 1, config, step=1)
    assert batch.micro_batches == ()
    stages = trainer.stages()
    stages.prepare(batch, list(batch.groups))
    stages.critic_values(1)
    stages.advantages(1)
    trainer.train_step(batch, None)
    result = stages.critic_update(1, 0)
    assert result.tokens == 0 and not result.samples_lost


def test_the_critic_state_round_trips_through_a_checkpoint(model_dir: Path,
                                                           tmp_path: Path) -> None:
    config = TrainerConfig(groups_per_step=2)
    critic_config = CriticConfig(path=str(model_dir), lr=1e-3)
    trainer = shard(model_dir, config, reference=False, critic=critic_config)
    stages = trainer.stages()
    (batch,), _ = shard_batches(GROUPS, 1, config, step=1)
    for _ in range(2):
        stages.prepare(batch, list(batch.groups))
        stages.critic_values(1)
        stages.advantages(1)
        trainer.train_step(batch, None)
        stages.critic_update(1, 0)
    assert stages.critic is not None
    stages.critic.save(str(tmp_path))
    other = shard(model_dir, config, reference=False, critic=critic_config)
    assert other.roles is not None and other.roles.critic is not None
    other.roles.critic.load(str(tmp_path))
    for (name, a), (_, b) in zip(stages.critic.module.state_dict().items(),
                                 other.roles.critic.module.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    ours = stages.critic.optimizer.state_dict()["state"]
    theirs = other.roles.critic.optimizer.state_dict()["state"]
    assert len(ours) == len(theirs) > 0
    for key, state in ours.items():
        assert torch.equal(state["exp_avg"], theirs[key]["exp_avg"])
