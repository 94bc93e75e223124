"""DAPO's dynamic sampling (rollout.filter_groups) and over-long handling (trainer.overlong):
the filter decision, the soft penalty at its boundaries, the samples a mask leaves out,
the config rules, and an orchestrator run on in-process fakes (no Ray) whose ledger,
metrics and summary account every filtered group.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from orchestrator_fakes import (
    FakeRollout,
    FakeTrainer,
    config,
    ledger,
    run,
    trained_once_or_unfinished,
)

from async_rl.config import Config
from async_rl.config_io import decode_config
from async_rl.control.failures import RunFailed
from async_rl.control.step_metrics import StepTotals
from async_rl.models.tiny_model import build_config
from async_rl.run.run_dir import read_metrics, read_summary
from buffers.common.config import ConfigError
from buffers.common.records import Group, Prompt, Sample, make_group
from buffers.plan.advantages import group_advantages, has_signal, overlong_penalty
from buffers.plan.batching import shard_batches, trained_sample, training_rewards
from workers.model_config import ModelConfig
from workers.rollout.config import Sampling
from workers.trainer.config import TrainerConfig
from workers.trainer.shard import TrainerShard
from workers.trainer.spec import TrainerSpec

# -- the filter decision ----------------------------------------------------------------


@given(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=1, max_size=8))
def test_a_group_has_signal_exactly_when_its_advantages_are_not_all_zero(
    rewards: list[float],
) -> None:
    assert has_signal(rewards) == any(a != 0.0 for a in group_advantages(rewards))
    assert has_signal(rewards) == (len(set(rewards)) > 1)


def test_equal_rewards_and_a_group_of_one_have_no_signal() -> None:
    assert not has_signal([1.0, 1.0, 1.0, 1.0])
    assert not has_signal([0.0] * 8)
    assert not has_signal([0.3])
    assert not has_signal([])
    assert has_signal([1.0, 1.0, 1.0, 0.0])


# -- the soft over-long penalty -----------------------------------------------------------


@pytest.mark.parametrize(("length", "expected"), [
    (0, 0.0), (60, 0.0),      # up to L_max - L_cache: free
    (61, -0.05), (70, -0.5),  # linear over the buffer
    (79, -0.95), (80, -1.0),  # -1 at L_max
    (81, -1.0), (500, -1.0),  # and beyond
])
def test_overlong_penalty_at_its_boundaries(length: int, expected: float) -> None:
    assert overlong_penalty(length, max_tokens=80, buffer=20) == pytest.approx(expected)


@pytest.mark.parametrize("buffer", [0, 80, 81, -1])
def test_overlong_penalty_needs_a_buffer_inside_the_cap(buffer: int) -> None:
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(10, max_tokens=80, buffer=buffer)


def group(lengths: list[int], rewards: list[float], finishes: list[str] | None = None,
          name: str = "p") -> Group:
    finishes = finishes or ["stop"] * len(lengths)
    samples = [Sample(token_ids=tuple(range(3, 3 + n)), logprobs=(-0.5,) * n,
                      versions=(0,) * n, finish_reason=f, text="x", reward=r)
               for n, r, f in zip(lengths, rewards, finishes, strict=True)]
    return make_group(Prompt(prompt_id=name, text="q", answer="0"), (1, 2), samples)


def test_the_penalty_shapes_the_rewards_advantages_and_the_filter_see() -> None:
    long_one = group([5, 10, 60, 80], [1.0, 1.0, 1.0, 1.0], ["stop", "stop", "stop", "length"])
    keep = TrainerConfig()
    penalty = TrainerConfig(overlong="penalty", overlong_buffer=40)
    assert training_rewards(long_one, keep) == [1.0] * 4
    assert training_rewards(long_one, penalty, max_new_tokens=80) == pytest.approx(
        [1.0, 1.0, 0.5, 0.0])
    # All correct: no signal as sampled, but the penalty gives the long ones less.
    assert not has_signal(training_rewards(long_one, keep))
    assert has_signal(training_rewards(long_one, penalty, 80))
    (batch,), _ = shard_batches([long_one], 1, penalty, step=1, max_new_tokens=80)
    advantages = [slot.advantage for mb in batch.micro_batches for slot in mb]
    assert sorted(advantages) == pytest.approx(sorted(group_advantages([1.0, 1.0, 0.5, 0.0])))
    with pytest.raises(ValueError, match="max_new_tokens"):
        training_rewards(long_one, penalty)


# -- the over-long mask -----------------------------------------------------------------


def test_a_mask_leaves_truncated_samples_out_and_keeps_their_rewards_in_the_advantages(
) -> None:
    cut = group([3, 8, 8, 2], [1.0, 0.0, 0.0, 1.0], ["stop", "length", "length", "stop"])
    whole = group([4, 4], [0.0, 1.0], name="q")
    mask = TrainerConfig(overlong="mask", groups_per_step=2)
    assert [trained_sample(cut, k, mask) for k in range(4)] == [True, False, False, True]
    assert all(trained_sample(cut, k, TrainerConfig()) for k in range(4))
    (batch,), plan = shard_batches([cut, whole], 1, mask, step=1)
    slots = [(batch.groups[s.group], s.sample, s.advantage)
             for mb in batch.micro_batches for s in mb]
    assert len(slots) == 4 == sum(len(mb) for mb in plan.shards[0].micro_batches)
    trained = {(id(tokens), k): a for tokens, k, a in slots}
    expected = group_advantages(cut.rewards)  # over all four, the truncated ones included
    assert trained == {(id(cut.tokens), 0): expected[0], (id(cut.tokens), 3): expected[3],
                       (id(whole.tokens), 0): pytest.approx(-0.7071, abs=1e-3),
                       (id(whole.tokens), 1): pytest.approx(0.7071, abs=1e-3)}


def test_a_step_of_truncated_samples_only_plans_nothing_to_train() -> None:
    cut = group([8, 8], [0.0, 1.0], ["length", "length"])
    (batch,), plan = shard_batches([cut], 1, TrainerConfig(overlong="mask",
                                                           groups_per_step=1), step=1)
    assert batch.micro_batches == () and batch.groups == () and batch.updates == (0,)
    assert plan.num_micro_batches == 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny Qwen2 (0.5M parameters): a step takes milliseconds."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("overlong-model")
    Qwen2ForCausalLM(build_config()).save_pretrained(out)
    return out


def masked_step(model_dir: Path, groups: list[Group]) -> tuple[int, dict[str, torch.Tensor]]:
    """One trainer step with trainer.overlong = "mask": (loss tokens, weights after)."""
    config = TrainerConfig(overlong="mask", groups_per_step=len(groups), max_grad_norm=1e9)
    shard = TrainerShard(TrainerSpec(
        rank=0, world_size=1, model=ModelConfig(path=str(model_dir)), trainer=config, seed=0,
        sampling=Sampling(temperature=1.0), record_spans=False))
    shard.setup()
    (batch,), _ = shard_batches(groups, 1, config, step=1)
    result = shard.train_step(batch, list(batch.groups))
    assert not result.nonfinite
    return result.loss.tokens, shard.module.state_dict()


def test_a_masked_step_has_no_loss_on_truncated_completions(model_dir: Path) -> None:
    finishes = ["stop", "length", "stop", "length"]
    cut = group([3, 8, 5, 8], [1.0, 0.0, 0.0, 1.0], finishes)
    # The same group with other tokens in its truncated completions.
    samples = [Sample(token_ids=tuple(range(40, 40 + n)) if f == "length" else
                      tuple(range(3, 3 + n)), logprobs=(-0.5,) * n, versions=(0,) * n,
                      finish_reason=f, text="x", reward=r)
               for n, r, f in zip(cut.completion_lengths, cut.rewards, finishes, strict=True)]
    other = make_group(cut.prompt, (1, 2), samples)
    tokens, after = masked_step(model_dir, [cut])
    other_tokens, other_after = masked_step(model_dir, [other])
    assert tokens == other_tokens == 3 + 5  # the kept completions' tokens only
    for name, value in after.items():
        torch.testing.assert_close(value, other_after[name])
    # Nothing to train: a step of truncated completions only leaves the weights be.
    none, unchanged = masked_step(model_dir, [group([8, 8], [0.0, 1.0], ["length"] * 2)])
    start = TrainerShard(TrainerSpec(
        rank=0, world_size=1, model=ModelConfig(path=str(model_dir)), trainer=TrainerConfig(),
        seed=0, sampling=Sampling(temperature=1.0), record_spans=False))
    start.setup()
    assert none == 0
    initial = start.module.state_dict()
    assert all(torch.equal(value, unchanged[name]) for name, value in initial.items())
    # The step with kept completions did train.
    assert any(not torch.equal(value, after[name]) for name, value in initial.items())


# -- config rules -------------------------------------------------------------------------


def decode(**sections: dict[str, object]) -> Config:
    return decode_config({"model": {"path": "m"}, "rollout": {"max_new_tokens": 64},
                          **sections})


@pytest.mark.parametrize(("trainer", "allowed"), [
    ({"overlong_buffer": 64}, "must be below rollout.max_new_tokens (64)"),
    ({"overlong": "penalty", "overlong_buffer": 100}, "must be below"),
    ({"overlong": "penalty"}, 'required with trainer.overlong = "penalty": 1 to 63'),
])
def test_a_bad_overlong_buffer_is_one_line_naming_the_key(
    trainer: dict[str, object], allowed: str
) -> None:
    with pytest.raises(ConfigError) as info:
        decode(trainer=trainer)
    message = str(info.value)
    assert "\n" not in message and "trainer.overlong_buffer" in message and allowed in message


def test_good_dynamic_sampling_configs_decode() -> None:
    cfg = decode(trainer={"overlong": "penalty", "overlong_buffer": 16},
                 rollout={"max_new_tokens": 64, "filter_groups": "zero_variance"})
    assert cfg.trainer.overlong_buffer == 16 and cfg.rollout.filter_groups == "zero_variance"
    assert decode().rollout.filter_groups == "none" and decode().trainer.overlong == "keep"
    with pytest.raises(ConfigError, match=r"rollout\.filter_groups"):
        decode(rollout={"filter_groups": "sometimes"})


# -- the per-step fraction and the totals ---------------------------------------------------


def test_filtered_fraction_is_per_row_and_the_totals_survive_a_checkpoint() -> None:
    totals = StepTotals()
    for k in range(4):
        totals.generated(group([2, 2], [float(k), 0.0]))
    totals.filtered_groups += 1
    assert totals.filtered_since_row() == 0.25
    assert totals.filtered_since_row() == 0.0  # nothing generated since
    totals.generated(group([2, 2], [0.0, 0.0]))
    totals.filtered_groups += 1
    restored = StepTotals()
    restored.restore(msgspec.json.decode(msgspec.json.encode(totals.counters()),
                                         type=type(totals.counters())))
    assert (restored.groups_generated, restored.filtered_groups) == (5, 2)
    assert restored.filtered_since_row() == 0.0  # a resumed run's first row starts afresh
    assert totals.filtered_since_row() == 1.0


# -- a run on fakes -----------------------------------------------------------------------


class DullRollout(FakeRollout):
    """Like ``FakeRollout``, but the prompts ``dull`` says so get all-equal rewards."""

    def __init__(self, rank: int, dull: Callable[[Prompt], bool]) -> None:
        super().__init__(rank)
        self.dull = dull

    async def generate(self, prompt: Prompt) -> Group:
        made = await super().generate(prompt)
        if not self.dull(prompt):
            return made
        return msgspec.structs.replace(made, rewards=(1.0,) * made.num_samples)


def filtering(tmp_path: Path, cap: int = 512, steps: int = 6) -> Config:
    cfg = config(tmp_path, steps=steps, max_staleness=1)
    return msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(
        cfg.rollout, filter_groups="zero_variance", max_filtered_in_a_row=cap))


def test_filtered_groups_are_dropped_for_good_and_fresh_prompts_fill_every_step(
    tmp_path: Path,
) -> None:
    cfg = filtering(tmp_path)
    def every_third(prompt: Prompt) -> bool:
        return int(prompt.prompt_id.rsplit("-", 1)[-1]) % 3 == 0

    summary = run(cfg, {0: DullRollout(0, every_third)}, [FakeTrainer(0)])
    assert summary.steps == 6
    assert summary.groups_trained == 6 * cfg.trainer.groups_per_step
    assert summary.filtered_groups >= 6  # a third of the 24+ prompts admitted
    assert summary.groups_generated >= summary.groups_trained + summary.filtered_groups
    events = ledger(tmp_path)
    counts = trained_once_or_unfinished(events)
    trained = [e for h in events.values() for e in h if e["event"] == "trained"]
    filtered = [e for h in events.values() for e in h
                if (e["event"], e["reason"]) == ("dropped", "filtered")]
    assert len(trained) == counts["trained"] == summary.groups_trained
    assert len(filtered) == summary.filtered_groups
    assert all(statistics.pvariance(e["rewards"]) > 0 for e in trained)
    assert all(len(e["rewards"]) == 4 and statistics.pvariance(e["rewards"]) == 0
               for e in filtered)
    # A filtered prompt is done: its drop is its last event, and it never ran again.
    for entry in filtered:
        history = events[str(entry["prompt_id"])]
        assert history[-1] == entry and [e["event"] for e in history].count("admitted") == 1
    rows = read_metrics(tmp_path)
    assert len(rows) == 6
    assert all(0.0 <= r["filtered_fraction"] <= 1.0 for r in rows)
    assert any(r["filtered_fraction"] > 0 for r in rows)
    assert all(r["truncated_fraction"] == 0.0 for r in rows)  # the fakes all stop
    assert read_summary(tmp_path).filtered_groups == summary.filtered_groups


def test_without_the_filter_dull_groups_are_trained(tmp_path: Path) -> None:
    cfg = config(tmp_path, steps=3, max_staleness=1)
    summary = run(cfg, {0: DullRollout(0, lambda p: True)}, [FakeTrainer(0)])
    assert summary.groups_trained == 3 * cfg.trainer.groups_per_step
    assert summary.filtered_groups == 0
    assert all(r["filtered_fraction"] == 0.0 for r in read_metrics(tmp_path))


def test_a_policy_that_scores_everything_alike_stops_the_run_instead_of_spinning(
    tmp_path: Path,
) -> None:
    cfg = filtering(tmp_path, cap=20)
    with pytest.raises(RunFailed, match="20 groups in a row had rewards all equal"):
        run(cfg, {0: DullRollout(0, lambda p: True)}, [FakeTrainer(0)])
    summary = read_summary(tmp_path)
    # Groups already back when the run stopped were judged too: 20 or a few more.
    assert summary.filtered_groups >= 20 and summary.groups_trained == 0
    assert "rollout.max_filtered_in_a_row" in summary.stopped
    events = ledger(tmp_path)
    drops = [e for h in events.values() for e in h if e["reason"] == "filtered"]
    assert len(drops) == summary.filtered_groups
    assert not any(e["event"] == "trained" for h in events.values() for e in h)
