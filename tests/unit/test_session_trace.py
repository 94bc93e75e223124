"""Agent sessions in the trace: each turn's record as the session table and the gateway
make it (``workers.rollout.sessions``, ``workers.rollout.gateway``), the sessions a
rollout engine keeps (``workers.common.spans.SessionRecorder``), their way to the run
directory (``WorkerReadings.sessions``, sessions.jsonl) and the tracks
``async_rl.analysis.trace`` draws of them. No Ray, no vLLM."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import msgspec
import pytest
from orchestrator_fakes import FakeRollout, FakeTrainer, config, run

from async_rl.analysis.report import TRACE, build_report
from async_rl.analysis.trace import chrome_trace
from async_rl.run.run_dir import SESSIONS, RunWriter, read_sessions
from buffers.common.records import NO_VERSION, Prompt
from tests.unit.test_agent_task import hangs, returns
from tests.unit.test_gateway import FakeEngine, Utf8Tokenizer, fake_gateway, text_ids
from tests.unit.test_report import s, write_run
from workers.common.spans import SessionRecorder, SessionSpan, TurnSpan
from workers.rollout.agents import DONE, TIMEOUT, AgentConfig, AgentRunner
from workers.rollout.sessions import Session, SessionTable, extend


class Clock:
    """A clock the test sets."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def turn(session: Session, clock: Clock, arrived: float, finished: float,
         prompt_ids: list[int], prompt_text: str, ids: list[int], versions: list[int]
         ) -> None:
    """One turn as the gateway records it: the request arrives (``Session.arrived``),
    its generation is recorded at ``finished``."""
    session.arrived, clock.now = arrived, finished
    session.record(prompt_ids, prompt_text, ids, [-0.5] * len(ids), versions,
                   "".join(chr(i) for i in ids), "stop")


def three_turns() -> SessionSpan:
    """Session 1 of rollout-1: opened at 100, turns at 101-102, 104-105.5 (the
    extension adds "+tool") and 106-106.5 (a rewritten history: a new segment), closed
    at 108."""
    clock = Clock(100.0)
    table = SessionTable(clock=clock)
    table.open(max_turns=8)  # session 0: another trajectory of the group
    session = table.open(max_turns=8)
    turn(session, clock, 101.0, 102.0, encode("Q:"), "Q:", [120, 121], [3, 3])
    extended = extend(session.last, "Q:xy+tool", encode)
    assert extended is not None
    turn(session, clock, 104.0, 105.5, extended, "Q:xy+tool", [122, 123], [3, 4])
    turn(session, clock, 106.0, 106.5, encode("rewritten"), "rewritten", [97, 98, 99],
         [4, 4, 4])
    clock.now = 108.0
    table.close(session.token)
    return session.span("rollout-1", "p-7", 2, DONE)


def one_turn(worker: str = "rollout-0", outcome: str = TIMEOUT) -> SessionSpan:
    """Session 0: opened at 100, one turn asked at once (100-100.25, no tokens), closed
    at 101 (the agent's timeout, say)."""
    clock = Clock(100.0)
    table = SessionTable(clock=clock)
    session = table.open(max_turns=8)
    turn(session, clock, 100.0, 100.25, encode("Q:"), "Q:", [], [])
    clock.now = 101.0
    table.close(session.token)
    return session.span(worker, "p-3", 0, outcome)


# ---- the records -------------------------------------------------------------------


def test_three_turns_and_a_rewrite_are_recorded_with_their_tokens_times_and_versions() -> None:
    span = three_turns()
    assert (span.worker, span.session, span.prompt_id, span.member) == ("rollout-1", 1, "p-7", 2)
    assert (span.opened, span.closed, span.outcome, span.refused) == (100.0, 108.0, DONE, 0)
    assert len(span.turns) == 3
    assert [t.turn for t in span.turns] == [0, 1, 2]
    assert [t.segment for t in span.turns] == [0, 0, 1]  # the rewrite starts segment 1
    assert [(t.arrived, t.finished) for t in span.turns] == [(101.0, 102.0), (104.0, 105.5),
                                                            (106.0, 106.5)]
    # "Q:" (2), then "Q:" + the two generated ids + "+tool" (5), then "rewritten" (9).
    assert [t.prompt_tokens for t in span.turns] == [2, 9, 9]
    assert [t.new_prompt_tokens for t in span.turns] == [2, 5, 9]
    assert [t.completion_tokens for t in span.turns] == [2, 2, 3]
    assert [(t.min_version, t.max_version) for t in span.turns] == [(3, 3), (3, 4), (4, 4)]
    # Turn, agent, turn, agent...: the agent's stretches fill the rest of the session.
    stretches = span.stretches()
    assert len(stretches) == 7
    assert [(a, b) for a, b, _ in stretches] == [
        (100.0, 101.0), (101.0, 102.0), (102.0, 104.0), (104.0, 105.5), (105.5, 106.0),
        (106.0, 106.5), (106.5, 108.0)]
    assert [t.turn if t else None for _, _, t in stretches] == [None, 0, None, 1, None, 2,
                                                               None]


def test_a_one_turn_session_asked_at_once_has_no_agent_stretch_before_its_turn() -> None:
    span = one_turn()
    assert len(span.turns) == 1
    only = span.turns[0]
    assert (only.prompt_tokens, only.new_prompt_tokens, only.completion_tokens) == (2, 2, 0)
    assert (only.min_version, only.max_version) == (NO_VERSION, NO_VERSION)
    assert span.stretches() == [(100.0, 100.25, only), (100.25, 101.0, None)]


def test_a_request_that_waited_for_the_one_before_starts_where_it_ended() -> None:
    first = TurnSpan(turn=0, segment=0, arrived=1.0, finished=3.0, prompt_tokens=2,
                     new_prompt_tokens=2, completion_tokens=1, min_version=0,
                     max_version=0, finish_reason="stop")
    second = msgspec.structs.replace(first, turn=1, arrived=2.0, finished=4.0)
    span = SessionSpan(worker="rollout-0", session=0, prompt_id="p", member=0,
                       greedy=False, opened=0.5, closed=4.0, outcome=DONE, refused=0,
                       turns=(first, second))
    assert span.stretches() == [(0.5, 1.0, None), (1.0, 3.0, first), (3.0, 4.0, second)]


def test_a_shifted_session_moves_every_time() -> None:
    span = three_turns().shifted(-100.0)
    assert (span.opened, span.closed) == (0.0, 8.0)
    assert [(t.arrived, t.finished) for t in span.turns] == [(1.0, 2.0), (4.0, 5.5),
                                                            (6.0, 6.5)]


def test_the_recorder_keeps_an_evenly_spaced_bounded_share() -> None:
    template = one_turn()
    recorder = SessionRecorder(worker="rollout-0", limit=4)
    for number in range(10):
        recorder.keep(msgspec.structs.replace(template, session=number))
    # 0-3 kept; the 5th halves them to the even ones; the 9th to multiples of 4.
    assert recorder.stride == 4
    assert [k.session for k in recorder.drain()] == [0, 4, 8]
    assert recorder.drain() == []
    off = SessionRecorder(worker="rollout-0", enabled=False)  # run.record_spans = false
    off.keep(template)
    assert off.drain() == []


# ---- through the gateway -----------------------------------------------------------


def test_a_group_through_the_gateway_records_each_turn_and_how_each_session_ended() -> None:
    """Two trajectories: one returns after two turns (one segment: its second prompt
    adds ";"), one hangs after its first turn until agent_timeout_s."""
    engine = FakeEngine([text_ids("ab")])
    recorder = SessionRecorder(worker="rollout-3")
    prompt = Prompt(prompt_id="p-9", text="7*6=", answer="42", columns={"prompt": "7*6="})

    async def main() -> None:
        gateway = fake_gateway(engine, max_new_tokens=8, context=64, concurrency=8)
        await gateway.start()
        solves = iter([returns, hangs])

        async def solve(client: Any, row: dict[str, Any]) -> float:
            return float(await next(solves)(client, row))

        runner = AgentRunner(AgentConfig(agent="unused", agent_timeout_s=0.3, max_turns=4),
                             gateway, Utf8Tokenizer(), solve=solve, sessions=recorder)
        try:
            await runner.group(prompt, 2)
        finally:
            await runner.close()

    asyncio.run(main())
    kept = sorted(recorder.drain(), key=lambda k: k.member)
    assert len(kept) == 2
    done, timed_out = kept
    assert [k.outcome for k in kept] == [DONE, TIMEOUT]
    assert {k.worker for k in kept} == {"rollout-3"} and {k.prompt_id for k in kept} == {"p-9"}
    assert sorted(k.session for k in kept) == [0, 1]
    assert len(done.turns) == 2 and len(timed_out.turns) == 1
    assert [t.segment for t in done.turns] == [0, 0]
    prompt_length = len(text_ids("7*6="))
    assert [t.prompt_tokens for t in done.turns] == [prompt_length, prompt_length + 2 + 1]
    assert [t.new_prompt_tokens for t in done.turns] == [prompt_length, 1]  # ";"
    assert [t.completion_tokens for t in done.turns] == [2, 2]
    assert {(t.min_version, t.max_version) for k in kept for t in k.turns} == {(5, 5)}
    for k in kept:  # the gateway timed each turn from its request's arrival
        times = [k.opened, *(x for t in k.turns for x in (t.arrived, t.finished)), k.closed]
        assert times == sorted(times) and k.opened > 0
    # The timed-out session's last stretch is the agent's, up to its timeout.
    last = timed_out.stretches()[-1]
    assert last[2] is None and last[1] == timed_out.closed
    assert last[1] - last[0] >= 0.2


# ---- to the run directory ----------------------------------------------------------


class AgentRollout(FakeRollout):
    """A fake engine whose agents each ran one session (one a group)."""

    async def sessions(self) -> list[SessionSpan]:
        return [msgspec.structs.replace(one_turn(self.name), session=k)
                for k in range(self.generated)]


def test_the_rollout_workers_sessions_reach_sessions_jsonl(tmp_path: Path) -> None:
    agents = AgentRollout(0)
    run(config(tmp_path / "agents", steps=1), {0: agents, 1: FakeRollout(1)},
        [FakeTrainer(0)], virtual=True)
    kept = read_sessions(tmp_path / "agents")
    assert len(kept) == agents.generated > 0
    assert {k.worker for k in kept} == {"rollout-0"}  # the other keeps none
    plain = tmp_path / "plain"
    RunWriter(plain, config(plain)).sessions([])  # a run without agents: no file
    assert not (plain / SESSIONS).exists() and read_sessions(plain) == []


# ---- the trace -----------------------------------------------------------------------


def as_json(trace: dict[str, Any]) -> dict[str, Any]:
    """The trace as the viewer reads it (its slices are structs until encoded)."""
    decoded: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(trace))
    return decoded


def slices(trace: dict[str, Any], pid: int) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]


def names(trace: dict[str, Any], kind: str) -> dict[tuple[int, int], str]:
    """Each process's (kind "process_name": keyed (pid, 0)) or track's name."""
    return {(e["pid"], e.get("tid", 0)): e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == kind}


SPANS = [s("rollout-0", "rollout", "generate", 99.0, 109.0),
         s("rollout-1", "rollout", "generate", 99.0, 109.0),
         s("trainer-0", "trainer", "forward", 99.0, 109.0)]


def test_the_trace_draws_each_session_under_its_engine_with_its_turns_and_agent() -> None:
    origin = 99.0
    trace = as_json(chrome_trace(SPANS, sessions=[three_turns(), one_turn()]))
    processes = names(trace, "process_name")
    assert processes == {(1, 0): "async-rl run", (2, 0): "rollout-0: agent sessions",
                         (3, 0): "rollout-1: agent sessions"}
    tracks = names(trace, "thread_name")
    assert len(tracks) == 5
    assert tracks[(2, 4)] == "session 0 (timeout)" and tracks[(3, 5)] == "session 1"
    assert len({tid for _, tid in tracks}) == 5  # no track id shared across processes

    three = [e for e in slices(trace, 3) if e["tid"] == 5]
    assert len(three) == 8
    assert [e["name"] for e in three] == ["session done", "agent", "turn 0", "agent",
                                          "turn 1", "agent", "turn 2", "agent"]
    assert [e["cat"] for e in three[:3]] == ["session", "agent", "turn"]
    assert three[0]["args"] == {"prompt_id": "p-7", "member": 2, "turns": 3, "refused": 0}
    assert (three[0]["ts"], three[0]["dur"]) == ((100.0 - origin) * 1e6, 8e6)
    turn_1 = three[4]
    assert (turn_1["ts"], turn_1["dur"]) == ((104.0 - origin) * 1e6, 1.5e6)
    assert turn_1["args"] == {"segment": 0, "prompt_tokens": 9, "new_prompt_tokens": 5,
                              "completion_tokens": 2, "min_version": 3, "max_version": 4,
                              "finish_reason": "stop"}
    assert three[6]["args"]["segment"] == 1 and three[1]["args"] == {}
    session = three[0]
    for event in three[1:]:  # each inside the session's slice, one after another
        assert session["ts"] <= event["ts"]
        assert event["ts"] + event["dur"] <= session["ts"] + session["dur"]
    for before, after in itertools.pairwise(three[1:]):
        assert before["ts"] + before["dur"] == after["ts"]

    one = slices(trace, 2)
    assert len(one) == 3
    assert [e["name"] for e in one] == ["session timeout", "turn 0", "agent"]
    assert [e["dur"] for e in one] == [1e6, 0.25e6, 0.75e6]


def test_a_run_without_agent_sessions_has_no_session_tracks() -> None:
    trace = as_json(chrome_trace(SPANS))
    assert len(slices(trace, 1)) == 3
    assert {e["pid"] for e in trace["traceEvents"]} == {1}
    assert set(names(trace, "thread_name").values()) == {
        "rollout-0 (cpu:0)", "rollout-1 (cpu:0)", "trainer-0 (cpu:0)"}


def test_the_report_draws_the_sessions_within_the_training_window(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, trainer_wait=4)  # the controller's window: 0 to 10
    inside = one_turn().shifted(-99.0)  # 1 to 2
    before = one_turn().shifted(-101.0)  # opened at -1: the evaluation before training
    (run_dir / SESSIONS).write_bytes(b"".join(msgspec.json.encode(x) + b"\n"
                                              for x in (inside, before)))
    assert read_sessions(run_dir) == [inside, before]
    build_report(run_dir)
    trace = msgspec.json.decode((run_dir / TRACE).read_bytes())
    drawn = slices(trace, 2)
    assert len(drawn) == 3
    assert drawn[0]["name"] == "session timeout"
    assert drawn[0]["ts"] == pytest.approx(1e6)
