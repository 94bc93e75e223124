"""Multi-turn trajectories (``workers.rollout.turns``) against a fake engine and the test
environments of tests/fixtures/adder_env.py: the turn loop, loss masks and versions,
timeouts and errors that end one trajectory only, environments side by side and off the
caller's event loop. No Ray, no vLLM, no model."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

import async_rl
from buffers.common.records import NO_VERSION, Prompt, Sample, make_group
from tests.unit.turn_fakes import Params
from workers.rollout.environment import EnvironmentConfig
from workers.rollout.prompts import PromptFormat
from workers.rollout.turns import TurnRunner, environment_row

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PROMPT = Prompt(prompt_id="p0", text="2+2=", answer="4", columns={"level": 1})


class ByteTokenizer:
    """One token per character (its code point); EOS is 0."""

    eos_token_id = 0
    eos_token = "\x00"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if i or not skip_special_tokens)


class FakeEngine:
    """Answers every turn with ``reply`` (cut to max_tokens), labelled ``version``."""

    def __init__(self, reply: str = "7</call>") -> None:
        self.reply, self.version = reply, 0
        self.requests: list[tuple[list[int], Params]] = []

    async def stream(self, context: list[int], params: Any) -> Sample:
        self.requests.append((list(context), params))
        await asyncio.sleep(0)
        ids = tuple(ord(c) for c in self.reply)[: params.max_tokens]
        return Sample(token_ids=ids, logprobs=(-0.5,) * len(ids),
                      versions=(self.version,) * len(ids), finish_reason="stop",
                      text="".join(map(chr, ids)))


def runner(cls: str = "AdderEnv", **knobs: Any) -> TurnRunner:
    env = EnvironmentConfig(class_=f"{FIXTURES / 'adder_env.py'}:{cls}", stop=("</call>",),
                            **knobs)
    return TurnRunner(env, ByteTokenizer(), PromptFormat(), max_new_tokens=16)


def play(turns: TurnRunner, engine: FakeEngine, size: int = 2,
         seeds: tuple[int, ...] = ()) -> tuple[list[int], list[Sample]]:
    try:
        return asyncio.run(turns.group(PROMPT, size, engine.stream, Params(), seeds))
    finally:
        turns.close()


def test_turns_alternate_with_observations_that_are_masked_and_unversioned() -> None:
    engine = FakeEngine()
    prompt_ids, samples = play(runner(), engine, seeds=(10, 20))
    reply, obs = [ord(c) for c in "7</call>"], [ord(c) for c in "+1;"]
    assert prompt_ids == [ord(c) for c in "2+2="]
    assert len(samples) == 2
    for sample in samples:
        assert list(sample.token_ids) == reply + obs + reply  # two turns (AdderEnv.TURNS)
        assert sample.loss_mask == (1,) * 8 + (0,) * 3 + (1,) * 8
        assert sample.logprobs[8:11] == (0.0,) * 3
        assert sample.versions[8:11] == (NO_VERSION,) * 3
        assert sample.reward == 0.5 and sample.env_outcome == "done"
        assert sample.text == "7</call>+1;7</call>"
    # Each turn continues on the whole context, stops at the stop strings, kept.
    assert len(engine.requests) == 4
    context, params = engine.requests[-1]
    assert context in ([*prompt_ids, *reply, *obs],)
    assert params.stop == ["</call>"] and params.include_stop_str_in_output
    assert params.detokenize and params.max_tokens == 16
    assert sorted(p.seed for _, p in engine.requests) == [10, 11, 20, 21]


def test_the_row_holds_the_prompt_the_answer_and_the_columns() -> None:
    assert environment_row(PROMPT) == {"level": 1, "prompt": "2+2=", "answer": "4"}


def test_a_weight_update_between_turns_tags_each_token_with_its_own_version() -> None:
    engine = FakeEngine()
    stream = engine.stream

    async def update_after_first_turn(context: list[int], params: Any) -> Sample:
        out = await stream(context, params)
        engine.version = 3
        return out

    engine.stream = update_after_first_turn  # type: ignore[method-assign]
    _, [sample] = play(runner(), engine, size=1)
    assert sample.versions == (0,) * 8 + (NO_VERSION,) * 3 + (3,) * 8
    group = make_group(PROMPT, (1,), [sample])
    assert (group.min_version, group.max_version) == (0, 3)  # counted from its oldest


def test_max_turns_and_max_trajectory_tokens_end_a_trajectory() -> None:
    _, [one] = play(runner(max_turns=1), FakeEngine(), size=1)
    assert one.env_outcome == "max_turns" and len(one.token_ids) == 8
    assert one.loss_mask == (1,) * 8  # no observation after the last turn
    # 4 prompt + 8 + 3 + at most 5 more: the second turn gets the room that is left.
    _, [short] = play(runner(max_trajectory_tokens=20), FakeEngine(), size=1)
    assert len(short.token_ids) == 16 and short.token_ids[-5:] == tuple(map(ord, "7</ca"))
    _, [tight] = play(runner(max_trajectory_tokens=14), FakeEngine(), size=1)
    assert tight.env_outcome == "max_tokens" and len(tight.token_ids) == 8  # no room


def test_a_step_past_its_deadline_ends_that_trajectory_only_with_reward_0() -> None:
    turns = runner("HangingAdderEnv", turn_timeout_s=0.2)
    began = time.perf_counter()
    _, samples = play(turns, FakeEngine(), size=20)  # the 8th instance hangs
    assert time.perf_counter() - began < 5
    outcomes = [s.env_outcome for s in samples]
    assert outcomes.count("timeout") == 1 and outcomes.count("done") == 19
    hung = samples[outcomes.index("timeout")]
    assert hung.reward == 0.0 and len(hung.token_ids) == 8  # its first turn, then nothing
    group = make_group(PROMPT, (1,), samples)
    assert (group.env_timeouts, group.env_errors) == (1, 0)


class Failing:
    async def reset(self, row: dict[str, Any]) -> str:
        return str(row["prompt"])

    async def step(self, completion: str) -> Any:
        raise RuntimeError("sandbox crashed")


class Blocking(Failing):
    async def step(self, completion: str) -> Any:
        time.sleep(1.0)  # blocks its event loop: not the caller's


class WrongType(Failing):
    async def step(self, completion: str) -> Any:
        return (None, 1.0, True)


@pytest.mark.parametrize(("cls", "outcome"), [(Failing, "error"), (WrongType, "error"),
                                              (Blocking, "timeout")])
def test_an_environment_that_raises_or_blocks_is_counted_and_ends_its_trajectory(
        cls: type, outcome: str) -> None:
    turns = runner(turn_timeout_s=0.3)
    turns._cls = cls  # type: ignore[assignment]
    ticks = 0

    async def main() -> tuple[list[int], list[Sample]]:
        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        try:
            return await turns.group(PROMPT, 2, FakeEngine().stream, Params())
        finally:
            ticker.cancel()

    try:
        _, samples = asyncio.run(main())
    finally:
        turns.close()
    assert [s.env_outcome for s in samples] == [outcome] * 2
    assert all(s.reward == 0.0 and len(s.token_ids) == 8 for s in samples)
    if cls is Blocking:  # the caller's loop (the engine's) kept running meanwhile
        assert ticks >= 10
    group = make_group(PROMPT, (1,), samples)
    assert group.env_errors + group.env_timeouts == 2


def test_a_group_s_environments_run_side_by_side() -> None:
    class Slow(Failing):
        async def step(self, completion: str) -> Any:
            await asyncio.sleep(0.3)
            return async_rl.EnvStep(None, 1.0, True)

    turns = runner()
    turns._cls = Slow  # type: ignore[assignment]
    began = time.perf_counter()
    _, samples = play(turns, FakeEngine(), size=8)
    assert [s.reward for s in samples] == [1.0] * 8
    assert time.perf_counter() - began < 8 * 0.3 / 2


def test_with_the_chat_template_an_observation_is_a_tool_turn() -> None:
    from async_rl.models.tiny_model import build_tokenizer
    from workers.rollout.prompts import observation_ids

    tokenizer = build_tokenizer()
    chat = PromptFormat(chat_template=True)
    turn = tokenizer.decode(observation_ids(tokenizer, "<result>14</result>", chat))
    assert turn == "</s>\n<|tool|><result>14</result>\n<|assistant|>"
    after_eos = observation_ids(tokenizer, "<result>14</result>", chat, after_eos=True)
    assert tokenizer.decode(after_eos) == "\n<|tool|><result>14</result>\n<|assistant|>"
    assert tokenizer.decode(observation_ids(tokenizer, "+1;", PromptFormat())) == "+1;"


def test_the_task_s_own_rewards_add_to_the_environment_s() -> None:
    from workers.rewards.runner import UserRewards
    from workers.rollout.scoring import Scorer

    def digits(prompt: str, completion: str) -> float:
        return 1.0 if any(c.isdigit() for c in completion) else 0.0

    played = [Sample(token_ids=(1,), logprobs=(-0.1,), versions=(0,), finish_reason="stop",
                     text=text, reward=0.5, env_outcome="done") for text in ("7", "x")]
    alone = Scorer(lambda prompt, text: 9.0)  # the built-in reward does not apply
    assert [s.reward for s in asyncio.run(alone.score_trajectories(PROMPT, played)).samples
            ] == [0.5, 0.5]
    scorer = Scorer(lambda prompt, text: 9.0,
                    UserRewards(specs=(async_rl.Reward(fn=digits),), threads=True))
    scorer.start()
    try:
        scored = asyncio.run(scorer.score_trajectories(PROMPT, played))
    finally:
        scorer.close()
    assert [s.reward for s in scored.samples] == [1.5, 0.5]


def test_encode_plain_gives_the_tokenizer_s_own_ids() -> None:
    from async_rl.models.tiny_model import build_tokenizer
    from workers.rollout.prompts import encode_plain

    tokenizer = build_tokenizer()
    texts = ["", "x", "</call><result>3901</result>", "a</s>b", " ünï\ncode\t 😀 ", "<pad>"]
    assert len(texts) == 6
    for text in texts:
        for special in (False, True):
            assert (encode_plain(tokenizer, text, special)
                    == tokenizer.encode(text, add_special_tokens=special))
    tokenizer.backend_tokenizer.enable_truncation(max_length=2)  # what the fast path skips
    assert encode_plain(tokenizer, "abcdef") == tokenizer.encode("abcdef",
                                                                add_special_tokens=False)
