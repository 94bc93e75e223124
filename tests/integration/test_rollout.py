"""RolloutWorker as a real Ray actor around the real vLLM CPU engine and the tiny model.

One engine serves the module (starting one takes ~25 s on this machine), its in-flight
updates recomputing the running requests' KV (weights.kv_policy "recompute"); one test
starts a second that keeps it ("keep"), to tell the two apart by their logprobs. Weights
reach it as they do in a run: a ``WeightSender`` actor (the trainer's end) sends them
through vLLM's weight-transfer API over the gloo backend. Tests read the current version
instead of assuming one, so they do not depend on their order.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np
import psutil
import pytest
import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_rl.analysis.idle import busy_fraction
from buffers.common.partials import PartialGroup
from buffers.common.records import Group, Prompt
from buffers.common.reports import BroadcastTiming
from workers import layout
from workers.model_config import ModelConfig
from workers.rollout.config import RolloutConfig
from workers.rollout.spec import RolloutSpec
from workers.rollout.task import WorkerTask
from workers.rollout.worker import RolloutWorker
from workers.weights.broadcast import Delivery
from workers.weights.config import WeightsConfig
from workers.weights.sender import WeightSender

pytestmark = pytest.mark.ray

# The reward function travels to the actor by value: this module is not importable there.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

GROUP_SIZE = 4
LONG = 64  # tokens per sample: long enough for a weight update to land mid-generation
PROMPT = Prompt(prompt_id="t-0", text="12+7=", answer="19")
EVAL = [Prompt(prompt_id=f"e-{a}", text=f"{a}+{a + 3}=", answer=str(2 * a + 3))
        for a in range(6)]
TIMEOUT = 120
WEIGHTS = WeightsConfig(update_mode="in_flight", transport="gloo", bucket_mb=1,
                        kv_policy="recompute")
"""1 MiB buckets: the tiny model's update takes several messages, its embedding a split.
The module's worker recomputes its running requests' KV at an update; ``keeping_worker``
keeps it."""


def starts_with_digit(prompt: Prompt, completion_text: str) -> float:
    """Test reward: 1 when the completion starts like a number; raises on request."""
    if prompt.answer == "raise":
        raise RuntimeError("reward function bug")
    return 1.0 if completion_text[:1].isdigit() else 0.0


class SampleView(NamedTuple):
    """One sample of a group, read back from its token arrays and metadata."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    reward: float
    finish_reason: str


def samples(group: Group) -> list[SampleView]:
    tokens = group.tokens
    views = []
    for k in range(group.num_samples):
        span = slice(int(tokens.offsets[k]), int(tokens.offsets[k + 1]))
        views.append(SampleView(tuple(tokens.completion_token_ids[span].tolist()),
                                tuple(tokens.logprobs[span].tolist()),
                                tuple(tokens.versions[span].tolist()),
                                group.rewards[k], group.finish_reasons[k]))
    return views


def perturbed_state(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """The model's weights with noise of their own size added, named as the trainer
    sends them (its parameters: the head is tied to the embedding, so it is absent)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.named_parameters():
        scale = tensor.float().std() if tensor.numel() > 1 else torch.tensor(1.0)
        noise = torch.randn(tensor.shape, generator=gen) * scale
        state[name] = (tensor.detach() + noise.to(tensor.dtype)).contiguous()
    assert "lm_head.weight" not in state
    return state


def reference_logprobs(
    model_dir: Path, state: dict[str, torch.Tensor] | None, group: Group
) -> list[list[float]]:
    """Each sample's token logprobs under transformers with ``state`` (base if None)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if state is not None:
        # lm_head is tied to the embedding, so it is absent from the state.
        model.load_state_dict(state, strict=False)
    prompt = group.tokens.prompt_token_ids.tolist()
    out = []
    with torch.no_grad():
        for sample in samples(group):
            ids = torch.tensor([prompt + list(sample.token_ids)])
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
            picked = logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None])
            out.append(picked[:, 0].tolist())
    return out


def assert_behaviour_logprobs(model_dir: Path, state: dict[str, torch.Tensor] | None,
                              group: Group) -> None:
    """vLLM's behaviour logprobs are the policy's own (what the trainer recomputes)."""
    for sample, ref in zip(samples(group), reference_logprobs(model_dir, state, group),
                           strict=True):
        assert sample.logprobs == pytest.approx(ref, abs=1e-4)


def versions_logprob_errors(model_dir: Path, states: dict[int, dict[str, torch.Tensor]],
                            group: Group) -> dict[int, float]:
    """Per version, the largest difference between the engine's logprobs of the tokens
    labelled with it and that version's weights' own over the whole context (``states``:
    the weights of each version)."""
    refs = {v: reference_logprobs(model_dir, state, group) for v, state in states.items()}
    worst = dict.fromkeys(states, 0.0)
    for k, sample in enumerate(samples(group)):
        for i, (logprob, version) in enumerate(zip(sample.logprobs, sample.versions,
                                                   strict=True)):
            worst[version] = max(worst[version], abs(logprob - refs[version][k][i]))
    return worst


def make_worker(model_dir: Path, weights: WeightsConfig = WEIGHTS,
                worker_cores: tuple[int, ...] = ()) -> Any:
    actor = ray.remote(RolloutWorker).options(num_cpus=1, max_concurrency=64).remote(
        RolloutSpec(
            rank=0,
            model=ModelConfig(path=str(model_dir)),
            rollout=RolloutConfig(group_size=GROUP_SIZE, max_new_tokens=LONG, temperature=1.0,
                                  prefix_caching=True, kv_cache_gib=1, ignore_eos=True,
                                  # wait_until_generating reads tokens_in_flight
                                  stream_tokens=True),
            weights=weights,
            seed=0,
            cpu_ids=layout.usable_cores()[:1],
            worker_cpu_ids=worker_cores,
        ),
        WorkerTask(reward_fn=starts_with_digit),
    )
    pid = ray.get(actor.start.remote(), timeout=300)
    assert isinstance(pid, int) and pid > 0
    return actor


@pytest.fixture(scope="module")
def worker(ray_cluster: None, tiny_model_dir: Path) -> Iterator[Any]:
    actor = make_worker(tiny_model_dir)
    try:
        yield actor
    finally:
        ray.get(actor.shutdown.remote(), timeout=TIMEOUT)


@contextmanager
def connected_sender(worker: Any, weights: WeightsConfig) -> Iterator[Any]:
    """The trainer's end (no trainer: the tests choose the weights), connected to the
    worker as ``launch_workers`` connects trainer shard 0."""
    actor = ray.remote(WeightSender).options(num_cpus=0).remote(
        weights, address="127.0.0.1", device=torch.device("cpu"))
    ray.get(actor.connect.remote(0, worker), timeout=TIMEOUT)
    try:
        yield actor
    finally:
        ray.get(actor.shutdown.remote(), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def sender(worker: Any) -> Iterator[Any]:
    with connected_sender(worker, WEIGHTS) as actor:
        yield actor


@pytest.fixture(scope="module")
def noisy_states(tiny_model_dir: Path) -> list[dict[str, torch.Tensor]]:
    """A few perturbed weight sets."""
    return [perturbed_state(tiny_model_dir, seed) for seed in range(3)]


def update(sender: Any, version: int, state: dict[str, torch.Tensor],
           mode: str | None = None) -> BroadcastTiming:
    """One broadcast to the worker, as ``WeightBroadcast`` runs it: snapshot, send, free."""
    ray.get(sender.snapshot.remote(version, list(state.items())), timeout=TIMEOUT)
    try:
        delivery: Delivery = ray.get(sender.send.remote(version, [0], mode), timeout=TIMEOUT)
    finally:
        ray.get(sender.release.remote(version), timeout=TIMEOUT)
    assert delivery.failed == [] and delivery.attempts == 1
    (timing,) = delivery.timings
    assert isinstance(timing, BroadcastTiming)
    return timing


def wait_until_generating(actor: Any, min_tokens: int) -> None:
    deadline = time.monotonic() + 60
    while ray.get(actor.statistics.remote(), timeout=TIMEOUT).tokens_in_flight < min_tokens:
        assert time.monotonic() < deadline, "generation never started"
        time.sleep(0.005)


def check_group(group: Group, prompt_ids: list[int]) -> None:
    assert len(samples(group)) == GROUP_SIZE
    assert group.tokens.prompt_token_ids.tolist() == prompt_ids
    for sample in samples(group):
        assert len(sample.token_ids) == len(sample.logprobs) == len(sample.versions) == LONG
        assert sample.finish_reason == "length"
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in sample.logprobs)
        assert list(sample.versions) == sorted(sample.versions)
    assert group.num_tokens == GROUP_SIZE * (len(prompt_ids) + LONG)


def test_start_warms_up_outside_counters_and_spans(worker: Any) -> None:
    stats = ray.get(worker.statistics.remote(), timeout=TIMEOUT)
    assert 0 < stats.warmup_s < stats.engine_start_s
    assert stats.groups_generated == stats.samples_generated == stats.tokens_generated == 0
    spans = ray.get(worker.drain_spans.remote(), timeout=TIMEOUT)
    assert spans and all(s.cause != "generate" for s in spans)


def test_generate_group(worker: Any, tiny_model_dir: Path) -> None:
    stats = ray.get(worker.statistics.remote(), timeout=TIMEOUT)
    group: Group = ray.get(worker.generate_group.remote(PROMPT), timeout=TIMEOUT)
    # The ids vLLM used are the tokenizer's own (character-level, nothing added).
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    check_group(group, tokenizer.encode(PROMPT.text))
    if stats.version == 0:
        assert_behaviour_logprobs(tiny_model_dir, None, group)
    assert group.min_version == group.max_version == stats.version == stats.weight_updates
    for sample in samples(group):
        assert set(sample.versions) == {stats.version}
        text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        assert sample.reward == starts_with_digit(PROMPT, text)
    assert group.reward_failures == 0
    after = ray.get(worker.statistics.remote(), timeout=TIMEOUT)
    assert after.groups_generated == stats.groups_generated + 1
    assert after.tokens_generated == stats.tokens_generated + GROUP_SIZE * LONG
    assert after.requests_running == 0 and after.engine_start_s > 0


def test_a_hand_back_keeps_the_prefix_and_another_engine_continues_it(
    worker: Any, tiny_model_dir: Path
) -> None:
    """A second engine hands its group back mid-generation (as at a clean stop): each
    sample's tokens so far with their log-probs and versions, and it takes no more work.
    The module's engine continues it: the kept prefix bit for bit, then new tokens up to
    max_new_tokens, labelled with its version (docs/operations.md: exactness of a
    continued rollout); at version 0 every log-prob is the policy's own."""
    second = make_worker(tiny_model_dir)
    try:
        pending = second.generate_group.remote(PROMPT)
        wait_until_generating(second, min_tokens=GROUP_SIZE)
        assert ray.get(second.hand_back.remote(), timeout=TIMEOUT) == 1
        partial = ray.get(pending, timeout=TIMEOUT)
        refused = ray.get(second.generate_group.remote(PROMPT), timeout=TIMEOUT)
    finally:
        ray.get(second.shutdown.remote(), timeout=TIMEOUT)
    assert isinstance(partial, PartialGroup) and len(partial.samples) == GROUP_SIZE
    assert 0 < partial.kept_tokens < GROUP_SIZE * LONG, partial.kept_lengths
    for kept in partial.samples:
        assert len(kept.logprobs) == len(kept.versions) == len(kept.token_ids) < LONG
        assert set(kept.versions) <= {0} and not kept.finished
    assert isinstance(refused, PartialGroup) and refused.restarts == "not_started"

    version = ray.get(worker.version.remote(), timeout=TIMEOUT)
    group: Group = ray.get(worker.continue_group.remote(partial), timeout=TIMEOUT)
    assert isinstance(group, Group)
    check_group(group, list(partial.prompt_token_ids))
    for kept, sample in zip(partial.samples, samples(group), strict=True):
        n = len(kept.token_ids)
        assert sample.token_ids[:n] == kept.token_ids
        assert sample.logprobs[:n] == tuple(float(np.float32(x)) for x in kept.logprobs)
        assert sample.versions == kept.versions + (version,) * (LONG - n)
    if version == 0:
        assert_behaviour_logprobs(tiny_model_dir, None, group)


def test_idle_worker_uses_little_cpu(worker: Any) -> None:
    # vLLM's queue reader spins for a second after every read; the worker tells it to
    # block once nothing is in flight. Spinning, this window measured about 0.33 of a core.
    ray.get(worker.generate_group.remote(PROMPT), timeout=TIMEOUT)
    first = ray.get(worker.usage.remote(), timeout=TIMEOUT)
    time.sleep(3.0)
    last = ray.get(worker.usage.remote(), timeout=TIMEOUT)
    assert busy_fraction(first, last, cores=1)["cpu_busy"] < 0.2


def test_raising_reward_scores_zero_and_counts(worker: Any) -> None:
    before = ray.get(worker.statistics.remote(), timeout=TIMEOUT).reward_failures
    bad = Prompt(prompt_id="t-raise", text="3+4=", answer="raise")
    group: Group = ray.get(worker.generate_group.remote(bad), timeout=TIMEOUT)
    assert all(s.reward == 0.0 for s in samples(group))
    assert group.reward_failures == GROUP_SIZE
    after = ray.get(worker.statistics.remote(), timeout=TIMEOUT).reward_failures
    assert after == before + GROUP_SIZE


def test_evaluate_is_greedy_accuracy(worker: Any) -> None:
    greedy = ray.get(worker.generate_greedy.remote(EVAL), timeout=TIMEOUT)
    again = ray.get(worker.generate_greedy.remote(EVAL), timeout=TIMEOUT)
    assert [s.token_ids for s in greedy] == [s.token_ids for s in again]
    version = ray.get(worker.version.remote(), timeout=TIMEOUT)
    ray.get(worker.drain_spans.remote(), timeout=TIMEOUT)
    before = ray.get(worker.statistics.remote(), timeout=TIMEOUT)
    result = ray.get(worker.evaluate.remote(EVAL), timeout=TIMEOUT)
    assert result.accuracy == pytest.approx(sum(s.reward for s in greedy) / len(EVAL))
    assert result.version_min == result.version_max == version
    assert result.num_prompts == len(EVAL) and result.rollout_rank == 0 and result.seconds > 0
    # Evaluation is busy time of its own, and is not counted as generated groups.
    causes = {span.cause for span in ray.get(worker.drain_spans.remote(), timeout=TIMEOUT)}
    assert "evaluate" in causes and "generate" not in causes
    after = ray.get(worker.statistics.remote(), timeout=TIMEOUT)
    assert (after.groups_generated, after.tokens_generated) == (before.groups_generated,
                                                                before.tokens_generated)


def test_update_weights_changes_policy(
    worker: Any, sender: Any, noisy_states: list[dict[str, torch.Tensor]],
    tiny_model_dir: Path
) -> None:
    version = ray.get(worker.version.remote(), timeout=TIMEOUT)
    before = ray.get(worker.generate_greedy.remote(EVAL), timeout=TIMEOUT)
    began = time.perf_counter()
    timing = update(sender, version + 1, noisy_states[0])
    assert timing.version == version + 1 and timing.rollout_rank == 0
    assert timing.publish_s == 0.0
    assert min(timing.transfer_s, timing.pause_s, timing.load_s) >= 0.0
    assert timing.transfer_s + timing.pause_s + timing.load_s <= time.perf_counter() - began
    assert ray.get(worker.version.remote(), timeout=TIMEOUT) == version + 1

    group: Group = ray.get(worker.generate_group.remote(PROMPT), timeout=TIMEOUT)
    assert group.min_version == group.max_version == version + 1
    # Every layer took the new weights, the tied output head included.
    assert_behaviour_logprobs(tiny_model_dir, noisy_states[0], group)
    after = ray.get(worker.generate_greedy.remote(EVAL), timeout=TIMEOUT)
    assert [s.token_ids for s in after] != [s.token_ids for s in before]
    # A stale version is refused before the engine pauses, and the loaded one stays:
    # the worker is skipped, not lost.
    ray.get(sender.snapshot.remote(version, list(noisy_states[1].items())), timeout=TIMEOUT)
    stale: Delivery = ray.get(sender.send.remote(version, [0]), timeout=TIMEOUT)
    ray.get(sender.release.remote(version), timeout=TIMEOUT)
    assert (stale.timings, stale.failed) == ([], [])
    assert ray.get(worker.version.remote(), timeout=TIMEOUT) == version + 1
    kept = ray.get(worker.generate_greedy.remote(EVAL), timeout=TIMEOUT)
    assert [s.token_ids for s in kept] == [s.token_ids for s in after]


def mixed_group(worker: Any, sender: Any, state: dict[str, torch.Tensor]) -> Group:
    """A group whose requests were running when ``state`` arrived as the next version
    (in flight): each sample's first tokens of the version before, the rest of it."""
    version = ray.get(worker.version.remote(), timeout=TIMEOUT)
    pending = worker.generate_group.remote(PROMPT)
    wait_until_generating(worker, min_tokens=GROUP_SIZE)
    update(sender, version + 1, state)
    group: Group = ray.get(pending, timeout=TIMEOUT)
    assert group.min_version == version and group.max_version == version + 1
    for sample in samples(group):
        assert set(sample.versions) <= {version, version + 1}
        assert list(sample.versions) == sorted(sample.versions)
        assert len(sample.versions) == LONG and sample.finish_reason == "length"
    assert any(len(set(s.versions)) == 2 for s in samples(group))
    return group


def test_in_flight_update_mixes_versions_within_a_sample(
    worker: Any, sender: Any, noisy_states: list[dict[str, torch.Tensor]],
    tiny_model_dir: Path
) -> None:
    """weights.kv_policy "recompute": every token's logprob is its version's weights'
    own over the whole context (the running requests rebuilt their KV at the update)."""
    version = ray.get(worker.version.remote(), timeout=TIMEOUT) + 1
    update(sender, version, noisy_states[0])  # known weights for the tokens before
    ray.get(worker.drain_spans.remote(), timeout=TIMEOUT)
    group = mixed_group(worker, sender, noisy_states[1])
    errors = versions_logprob_errors(
        tiny_model_dir, {version: noisy_states[0], version + 1: noisy_states[1]}, group)
    print(f"recompute: largest logprob error per version {errors}")
    assert max(errors.values()) < 1e-4, errors

    causes = {span.cause for span in ray.get(worker.drain_spans.remote(), timeout=TIMEOUT)}
    # The pause, split by phase: bytes arriving, then the load.
    assert {"generate", "weight_wire", "weight_load"} <= causes <= {
        "generate", "weight_sync", "weight_wire", "weight_load", "idle"}


KEEP = msgspec.structs.replace(WEIGHTS, kv_policy="keep")


@pytest.fixture(scope="module")
def keeping_worker(ray_cluster: None, tiny_model_dir: Path) -> Iterator[Any]:
    # Its own process on the next core once its engine is built (rollout.worker_cores).
    actor = make_worker(tiny_model_dir, KEEP, worker_cores=layout.usable_cores()[1:2])
    try:
        yield actor
    finally:
        ray.get(actor.shutdown.remote(), timeout=TIMEOUT)


def test_kv_policy_keep_goes_on_over_the_cache_the_old_weights_computed(
    keeping_worker: Any, noisy_states: list[dict[str, torch.Tensor]], tiny_model_dir: Path
) -> None:
    """weights.kv_policy "keep" (with prefix caching: requests salted by version): the
    old version's tokens are its weights' own; the new version's were sampled from the
    new weights over keys and values the old ones computed, so they are not the new
    weights' own over the whole context, and the logprobs recorded are what sampled
    them (the behaviour policy the importance weights divide by)."""
    with connected_sender(keeping_worker, KEEP) as sender:
        version = ray.get(keeping_worker.version.remote(), timeout=TIMEOUT) + 1
        update(sender, version, noisy_states[0])
        group = mixed_group(keeping_worker, sender, noisy_states[1])
        after: Group = ray.get(keeping_worker.generate_group.remote(PROMPT),
                               timeout=TIMEOUT)
    errors = versions_logprob_errors(
        tiny_model_dir, {version: noisy_states[0], version + 1: noisy_states[1]}, group)
    print(f"keep: largest logprob error per version {errors}")
    assert errors[version] < 1e-4 and errors[version + 1] > 1e-2, errors
    # A request started after the update computes its own cache: the new weights' own.
    assert after.min_version == after.max_version == version + 1
    assert_behaviour_logprobs(tiny_model_dir, noisy_states[1], after)


def test_drain_update_finishes_running_samples_first(
    worker: Any, sender: Any, noisy_states: list[dict[str, torch.Tensor]],
    tiny_model_dir: Path
) -> None:
    version = ray.get(worker.version.remote(), timeout=TIMEOUT)
    pending = worker.generate_group.remote(PROMPT)
    wait_until_generating(worker, min_tokens=GROUP_SIZE)
    timing = update(sender, version + 1, noisy_states[2], mode="drain")
    group: Group = ray.get(pending, timeout=TIMEOUT)
    # Every token of the running group came from the old weights: the load waited.
    assert group.min_version == group.max_version == version
    assert timing.pause_s > 0.0
    fresh: Group = ray.get(worker.generate_group.remote(PROMPT), timeout=TIMEOUT)
    assert fresh.min_version == fresh.max_version == version + 1
    assert_behaviour_logprobs(tiny_model_dir, noisy_states[2], fresh)


def test_worker_cores_move_the_workers_own_threads_and_leave_its_engine(
    keeping_worker: Any,
) -> None:
    cores = layout.usable_cores()
    # The fixture's worker cores: the next core; on a one-core machine none (it stays).
    moved_to = set(cores[1:2] or cores[:1])
    process = psutil.Process(ray.get(keeping_worker.start.remote(), timeout=TIMEOUT))
    threads = [t.id for t in process.threads()]
    assert len(threads) >= 2
    assert {tid: os.sched_getaffinity(tid) for tid in threads} == {
        tid: moved_to for tid in threads}
    engines, seen = engine_processes(process)
    assert len(engines) == 1, seen
    assert engines[0].cpu_affinity() == [cores[0]]


def engine_processes(worker: psutil.Process) -> tuple[list[psutil.Process], list[str]]:
    """The worker's vLLM engine-core processes, and what its children looked like. The
    engine titles itself "VLLM::EngineCore" (the kernel's 15-character name cuts it to
    "VLLM::EngineCor"), but where setproctitle cannot rewrite the command line (seen on
    CI's interpreter, the engine serving) it keeps multiprocessing's spawn command line:
    the worker's only spawned child is its engine (the other is the resource tracker).
    Read again for a few seconds: a child just forked may not show its command line."""
    seen: list[str] = []
    for _ in range(20):
        seen, engines = [], []
        for child in worker.children():
            try:
                title = f"{child.name()} {' '.join(child.cmdline())}"
            except psutil.Error as error:
                title = repr(error)
            seen.append(f"{child.pid}: {title}")
            if "EngineCor" in title or "multiprocessing.spawn" in title:
                engines.append(child)
        if engines:
            return engines, seen
        time.sleep(0.5)
    return [], seen
