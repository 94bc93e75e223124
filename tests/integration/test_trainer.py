"""Trainer shards as real Ray actors: DDP over gloo, global-token normalisation, NaN skip,
and groups fetched by reference from the object store (a lost one voids the step)."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import ray

from async_rl.shell.launch import free_port
from buffers.common.records import Group, Prompt, Sample, make_group
from buffers.common.train_records import ShardStepResult
from buffers.plan.batching import shard_batches
from workers.actors import TrainerActor
from workers.model_config import LoraConfig, ModelConfig
from workers.trainer.config import TrainerConfig
from workers.trainer.spec import TrainerSpec

pytestmark = pytest.mark.ray

# module_state runs in the actors by value: this module is not importable there.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def groups(n: int, seed: int = 0) -> list[Group]:
    """Groups with varied lengths and rewards; token ids inside the tiny vocabulary."""
    out = []
    for g in range(n):
        samples = []
        for k in range(4):
            length = 2 + (g * 3 + k) % 5
            tokens = tuple(5 + (g + k + j) % 20 for j in range(length))
            samples.append(Sample(token_ids=tokens, logprobs=tuple(-2.5 for _ in tokens),
                                  versions=(0,) * length, finish_reason="stop", text="",
                                  reward=float((g + k + seed) % 2)))
        out.append(make_group(Prompt(prompt_id=f"p{g}", text="", answer=""),
                              tuple(8 + (g + j) % 10 for j in range(6)), tuple(samples)))
    return out


def module_state(shard: TrainerActor) -> dict[str, Any]:
    return {name: t.detach().clone() for name, t in shard.module.state_dict().items()}


def weights_of(shard: Any) -> dict[str, Any]:
    """The shard's current weights (read inside the actor)."""
    return ray.get(shard.__ray_call__.remote(module_state))


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def start_shards(model_dir: Path, world: int, trainer: TrainerConfig,
                 lora: LoraConfig | None = None, **options: Any) -> list[Any]:
    cls = ray.remote(TrainerActor).options(num_cpus=0.5)
    port = free_port()
    model = ModelConfig(path=str(model_dir), lora=lora or LoraConfig())
    shards = [cls.remote(TrainerSpec(rank=r, world_size=world, model=model, trainer=trainer,
                                     seed=0, master_port=port, writes_checkpoints=True,
                                     **options))
              for r in range(world)]
    ray.get([s.setup.remote() for s in shards])
    return shards


def by_reference(data: list[Group]) -> list[Group]:
    """The groups as the orchestrator holds them: tokens in the object store."""
    return [msgspec.structs.replace(g, tokens=ray.put(g.tokens)) for g in data]


def step(shards: list[Any], data: list[Group], trainer: TrainerConfig
         ) -> list[ShardStepResult]:
    batches, _ = shard_batches(by_reference(data), len(shards), trainer, step=1)
    assert len({len(b.micro_batches) for b in batches}) == 1  # equal micro-batch counts
    assert all(isinstance(g, ray.ObjectRef) for b in batches for g in b.groups)
    return ray.get([s.train_step_by_ref.remote(b)
                    for s, b in zip(shards, batches, strict=True)])


@pytest.mark.parametrize("loss", [
    {},
    # Two updates per epoch, two epochs, a per-sequence normaliser: the per-update counts
    # of both shards travel in the step's one all-reduce.
    {"mini_batches": 2, "epochs": 2, "loss_agg": "seq_mean_token_sum_norm"},
    # Groups that do not divide over the shards: the plan splits sequences by cost.
    {"groups_per_step": 5},
])
def test_two_shards_match_one_shard_on_the_same_step(
    tiny_model_dir: Path, ray_cluster: None, loss: dict[str, Any]
) -> None:
    # Small cap: several micro-batches per shard, so no_sync accumulation is exercised.
    loss = {"groups_per_step": 8, **loss}
    trainer = TrainerConfig(num_shards=2, micro_batch_tokens=64, max_grad_norm=1e9, **loss)
    data = groups(trainer.groups_per_step)
    two = start_shards(tiny_model_dir, 2, trainer)
    results = step(two, data, trainer)
    # After the all-reduce both shards hold the same gradient and the same new weights.
    assert results[0].grad_norm == pytest.approx(results[1].grad_norm, rel=1e-6)
    assert same(*(weights_of(s) for s in two))
    assert sum(r.loss.tokens for r in results) == trainer.epochs * sum(
        sum(g.completion_lengths) for g in data)
    for shard in two:
        ray.get(shard.shutdown.remote())
        ray.kill(shard)

    single = TrainerConfig(num_shards=1, micro_batch_tokens=10_000, max_grad_norm=1e9,
                           **loss)
    one = start_shards(tiny_model_dir, 1, single)
    (alone,) = step(one, data, single)
    # Loss normalised by the global token count: sharding does not change the gradient.
    assert results[0].grad_norm == pytest.approx(alone.grad_norm, rel=1e-4)
    total = sum(r.loss.loss_sum for r in results)
    assert total == pytest.approx(alone.loss.loss_sum, rel=1e-4, abs=1e-6)
    ray.kill(one[0])


def test_nonfinite_loss_skips_the_update_and_is_reported(
    tiny_model_dir: Path, ray_cluster: None
) -> None:
    trainer = TrainerConfig(num_shards=1, groups_per_step=2, micro_batch_tokens=512)
    (shard,) = start_shards(tiny_model_dir, 1, trainer)
    before = weights_of(shard)
    data = groups(2)
    tokens = data[0].tokens
    poisoned = msgspec.structs.replace(data[0], tokens=msgspec.structs.replace(
        tokens, logprobs=np.full_like(tokens.logprobs, math.nan)))
    (result,) = step([shard], [poisoned, data[1]], trainer)
    assert result.nonfinite
    assert same(weights_of(shard), before)
    (healthy,) = step([shard], data, trainer)  # and training goes on afterwards
    assert not healthy.nonfinite
    assert not same(weights_of(shard), before)
    ray.kill(shard)


@ray.remote(num_cpus=0)
class ShortLivedOwner:
    """Puts objects into the store as a rollout actor does, then can be killed."""

    def put(self, tokens: Any) -> list[Any]:
        return [ray.put(tokens)]  # in a list, so the caller borrows the reference


def test_a_lost_group_voids_the_step_on_every_shard(
    tiny_model_dir: Path, ray_cluster: None
) -> None:
    """One shard cannot fetch a group (its owner died); both shards skip the step
    together (no shard is left waiting in the gradient all-reduce) and say so."""
    trainer = TrainerConfig(num_shards=2, groups_per_step=4, micro_batch_tokens=64)
    shards = start_shards(tiny_model_dir, 2, trainer)
    before = [weights_of(s) for s in shards]
    data = by_reference(groups(4))
    owner = ShortLivedOwner.remote()
    (lost,) = ray.get(owner.put.remote(ray.get(data[0].tokens)))
    ray.kill(owner)
    deadline = time.monotonic() + 60
    with pytest.raises(ray.exceptions.OwnerDiedError):  # once Ray has noticed the death
        while time.monotonic() < deadline:
            ray.get(lost, timeout=10)
            time.sleep(0.2)
    data[0] = msgspec.structs.replace(data[0], tokens=lost)
    batches, _ = shard_batches(data, 2, trainer, step=1)
    results = ray.get([s.train_step_by_ref.remote(b) for s, b in
                       zip(shards, batches, strict=True)], timeout=120)
    assert len(results) == 2
    assert all(r.samples_lost and r.loss.tokens == 0 for r in results)
    after = [weights_of(s) for s in shards]
    assert all(same(a, b) for a, b in zip(after, before, strict=True))
    (healthy, _) = step(shards, groups(4), trainer)  # the shards go on training
    assert not healthy.samples_lost and healthy.loss.tokens > 0
    for shard in shards:
        ray.get(shard.shutdown.remote())
        ray.kill(shard)


def whole_policy(shards: list[Any]) -> dict[str, Any]:
    """The policy gathered whole (fsdp2: every shard takes part; shard 0 holds it)."""
    return ray.get([s.policy_state.remote() for s in shards])[0]


def largest_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys() and len(a) > 0
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize("lora", [None, LoraConfig(rank=8)], ids=["full", "lora"])
def test_fsdp2_trains_as_ddp_and_resumes_exactly_from_its_sharded_checkpoint(
    tiny_model_dir: Path, ray_cluster: None, tmp_path: Path, lora: LoraConfig | None
) -> None:
    # Two updates a step (a proximal pass) and several micro-batches per update.
    common: dict[str, Any] = {"num_shards": 2, "groups_per_step": 8, "micro_batch_tokens": 64,
                              "max_grad_norm": 1e9, "mini_batches": 2}
    ddp, fsdp = TrainerConfig(**common), TrainerConfig(backend="fsdp2", **common)
    data, later = groups(8), groups(8, seed=1)
    replicas = start_shards(tiny_model_dir, 2, ddp, lora)
    by_ddp = step(replicas, data, ddp)
    ddp_weights = whole_policy(replicas)
    for shard in replicas:
        ray.get(shard.shutdown.remote())
        ray.kill(shard)

    sharded = start_shards(tiny_model_dir, 2, fsdp, lora)
    by_fsdp = step(sharded, data, fsdp)
    assert len(by_fsdp) == len(by_ddp) == 2
    for a, b in zip(by_ddp, by_fsdp, strict=True):
        assert b.loss.tokens == a.loss.tokens > 0
        assert b.loss.loss_sum == pytest.approx(a.loss.loss_sum, abs=1e-5)
        assert b.grad_norm == pytest.approx(a.grad_norm, abs=1e-5)
    worst = largest_difference(ddp_weights, whole_policy(sharded))
    print(f"largest parameter difference, ddp vs fsdp2 after one step: {worst:.3g}")
    assert worst < 1e-5

    # Each shard writes its part in the background; a fresh pair resumes from it.
    checkpoint = tmp_path / "trainer"
    ray.get([s.save_checkpoint.remote(str(checkpoint)) for s in sharded])
    ray.get([s.checkpoint_written.remote() for s in sharded])
    assert (checkpoint / "sharded" / ".metadata").is_file()
    assert len(list((checkpoint / "sharded").glob("*.distcp"))) == 2  # one per shard
    assert (checkpoint / "model.safetensors").is_file()  # engines resume from it
    if lora is not None:  # with the adapter beside the base weights
        assert (checkpoint / "adapter" / "adapter_model.safetensors").is_file()
    straight = step(sharded, later, fsdp)
    straight_weights = whole_policy(sharded)
    for shard in sharded:
        ray.get(shard.shutdown.remote())
        ray.kill(shard)

    resumed = start_shards(checkpoint, 2, fsdp, lora)
    ray.get([s.load_training_state.remote(str(checkpoint)) for s in resumed])
    again = step(resumed, later, fsdp)
    assert [r.loss.loss_sum for r in again] == [r.loss.loss_sum for r in straight]
    assert largest_difference(straight_weights, whole_policy(resumed)) == 0.0
    for shard in resumed:
        ray.get(shard.shutdown.remote())
        ray.kill(shard)


def test_hybrid_sharding_trains_as_ddp(tiny_model_dir: Path, ray_cluster: None) -> None:
    """trainer.shard_group = 1 on two shards: a (2, 1) mesh, each group holding the whole
    model and the groups replicating each other (HSDP's degenerate case here)."""
    common: dict[str, Any] = {"num_shards": 2, "groups_per_step": 8, "micro_batch_tokens": 64,
                              "max_grad_norm": 1e9}
    ddp = TrainerConfig(**common)
    hybrid = TrainerConfig(backend="fsdp2", shard_group=1, **common)
    data = groups(8)
    weights = []
    for trainer in (ddp, hybrid):
        shards = start_shards(tiny_model_dir, 2, trainer)
        results = step(shards, data, trainer)
        assert len(results) == 2 and all(r.loss.tokens > 0 for r in results)
        weights.append((results, whole_policy(shards)))
        for shard in shards:
            ray.get(shard.shutdown.remote())
            ray.kill(shard)
    (by_ddp, ddp_weights), (by_hybrid, hybrid_weights) = weights
    for a, b in zip(by_ddp, by_hybrid, strict=True):
        assert b.loss.loss_sum == pytest.approx(a.loss.loss_sum, abs=1e-5)
        assert b.grad_norm == pytest.approx(a.grad_norm, abs=1e-5)
    assert largest_difference(ddp_weights, hybrid_weights) < 1e-5


def trainer_logprobs(shard: TrainerActor, batch: Any) -> tuple[list[Any], list[Any]]:
    """The trainer's own log-probs of a batch (its packed forward, no gradient), and the
    batch's (prompt, completion) token ids in the same order."""
    sequences = batch.sequences(ray.get(list(batch.groups)))
    logprobs = shard.losses.proximal(shard.losses.prepare(sequences))
    return ([lp.detach().cpu() for lp in logprobs if lp is not None],
            [(s.prompt_token_ids, s.completion_token_ids) for mb in sequences for s in mb])


def test_lora_trains_adapters_only_and_peft_loads_what_the_trainer_computes(
    tiny_model_dir: Path, ray_cluster: None, tmp_path: Path
) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = TrainerConfig(groups_per_step=4, micro_batch_tokens=512, lr=1e-2)
    (shard,) = start_shards(tiny_model_dir, 1, trainer, LoraConfig(rank=8, alpha=16),
                            save_merged=True)
    before = weights_of(shard)
    (result,) = step([shard], groups(4), trainer)
    assert result.loss.tokens > 0 and math.isfinite(result.grad_norm)
    after = weights_of(shard)
    moved = sorted(k for k in before if not before[k].equal(after[k]))
    assert moved and all(".lora_" in k for k in moved)  # the base is frozen
    assert any(".lora_B." in k for k in moved)  # B leaves zero: the policy changed
    final = tmp_path / "final_model"
    assert ray.get(shard.save.remote(str(final)))
    batches, _ = shard_batches(by_reference(groups(4, seed=2)), 1, trainer, step=2)
    logprobs, sequences = ray.get(shard.__ray_call__.remote(trainer_logprobs, batches[0]))
    ray.get(shard.shutdown.remote())
    ray.kill(shard)

    expected = torch.cat(logprobs)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    loaded = {"peft": PeftModel.from_pretrained(base, final).eval(),
              "merged": AutoModelForCausalLM.from_pretrained(final / "merged").eval()}
    assert len(sequences) == 16 and expected.numel() == sum(len(c) for _, c in sequences)
    for how, model in loaded.items():
        got = []
        with torch.no_grad():
            for prompt, completion in sequences:
                ids = torch.tensor([list(prompt) + list(completion)])
                logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
                got.append(torch.log_softmax(logits, -1).gather(
                    -1, torch.tensor(completion)[:, None])[:, 0])
        worst = float((torch.cat(got) - expected).abs().max())
        print(f"largest log-prob difference, trainer vs {how}: {worst:.3g}")
        assert worst < 1e-5, how
