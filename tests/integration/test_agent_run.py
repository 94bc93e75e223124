"""Bring your own agent, in one real run: real Ray, the real vLLM CPU build, the tiny
calculator model, and tests/fixtures/faulty_agent.py talking to the rollout engine's
gateway with the real openai client (examples/agent_openai.toml's settings).

- Exact tokens: the probe's 3-turn conversation reaches the engine as the ids it
  generated, although its first turn (one byte of a UTF-8 character) decodes to text
  that tokenizes to other ids; its rewritten history starts a new segment, trained as
  a sample of its own.
- Faults: agents that hang (1 in 20), raise (1 in 10) or post malformed requests (1 in
  5) are counted; the run finishes every step, the engine serves on, and the ledger
  shows no prompt trained twice.
- examples/agent_langgraph.py's graph plays half the other trajectories through the same
  gateway: its model node's calls reach the tool node, whose results the next turn
  continues from (tests/unit/test_agent_langgraph.py checks its rewards).
- The sessions reach the run directory from the rollout actor (sessions.jsonl, on the
  driver's clock) with how each ended, and the trace draws them turn by turn.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_async_grpo import check_ledger

from async_rl.analysis.report import TRACE, build_report
from async_rl.config_io import load_config
from async_rl.run.run_dir import read_metrics, read_sessions
from async_rl.shell.ray_shell import run_training
from async_rl.tasks.calculator import CALL_CLOSE, RESULT_OPEN, CalculatorTask

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "agent_openai.toml"
AGENT = ROOT / "tests" / "fixtures" / "faulty_agent.py"
STEPS, GROUPS, SIZE = 3, 4, 4
CUT = 3 + 0xC3


def test_an_agent_trains_on_exact_tokens_through_faults(
    calculator_model_dir: Path, tmp_path: Path, ray_shutdown: None,
) -> None:
    from transformers import AutoTokenizer

    log = tmp_path / "probe.jsonl"
    rows = tmp_path / "rows.jsonl"
    task = CalculatorTask(seed=0)
    rows.write_text("".join(json.dumps({"prompt": p.text, "answer": p.answer,
                                        "probe_log": str(log)}) + "\n"
                            for p in (task.prompt_at(i) for i in range(64))))
    out = tmp_path / "run"
    config = load_config(EXAMPLE, {
        "model.path": str(calculator_model_dir), "run.output_dir": str(out),
        "run.num_steps": STEPS, "run.progress": False, "run.eval_every": 0,
        "task.eval_size": 0, "task.eval_path": "", "task.path": str(rows),
        "task.agent": f"{AGENT}:solve", "task.agent_timeout_s": 5.0,
        "trainer.groups_per_step": GROUPS, "rollout.group_size": SIZE,
        "rollout.max_inflight_prompts": 4})

    summary = run_training(config)

    assert summary.stopped == "" and summary.steps == summary.final_version == STEPS
    failures = summary.failures
    assert failures["env_timeouts"] > 0 and failures["excluded_agent_timeout"] > 0
    assert failures["env_errors"] > 0 and failures["excluded_agent_error"] > 0
    assert failures["gateway_refused"] >= 3  # one malformed agent's three requests
    check_ledger(out, STEPS * GROUPS)
    rows_seen = read_metrics(out)
    assert [r["step"] for r in rows_seen] == list(range(1, STEPS + 1))
    # Every trajectory is a sample, and the probe's rewritten history one more.
    assert sum(r["samples"] + r["samples_excluded"] for r in rows_seen) \
        == STEPS * GROUPS * SIZE + 1

    records = [json.loads(line) for line in log.read_text().splitlines()]
    graphs = [r for r in records if "langgraph" in r]
    assert len(graphs) >= STEPS * GROUPS * SIZE // 4, len(graphs)
    assert all(r["reward"] in (0.0, 1.0) for r in graphs)
    # The tool node ran: a call closed and its result written after it.
    assert any(f"{CALL_CLOSE}{RESULT_OPEN}" in r["langgraph"] for r in graphs)
    (record,) = [r for r in records if "turns" in r]
    first, second, third, rewrite = record["turns"]
    tokenizer = AutoTokenizer.from_pretrained(str(calculator_model_dir))
    assert first["token_ids"] == [CUT] and first["text"] == "\ufffd"
    # The engine got the ids it generated, not the history's text re-tokenized.
    continued = [*first["prompt_token_ids"], CUT,
                 *tokenizer.encode(" ok ", add_special_tokens=False)]
    assert second["prompt_token_ids"] == continued
    assert tokenizer.encode(second["prompt"]) != continued
    context = [*second["prompt_token_ids"], *second["token_ids"]]
    assert third["prompt_token_ids"][:len(context)] == context
    assert rewrite["prompt_token_ids"] == tokenizer.encode(rewrite["prompt"])
    assert CUT not in rewrite["prompt_token_ids"]

    # The sessions, from the actor to sessions.jsonl: each fault's ending is there, the
    # probe's rewrite went to a second segment, and the trace draws the turns.
    sessions = read_sessions(out)
    assert len(sessions) >= STEPS * GROUPS * SIZE // 2, len(sessions)
    assert {"done", "timeout", "error"} <= {s.outcome for s in sessions}
    assert sum(s.refused for s in sessions) >= 3
    assert any(t.segment == 1 for s in sessions for t in s.turns)
    for session in sessions:
        assert session.worker == "rollout-0" and session.opened <= session.closed
        assert all(session.opened <= t.arrived <= t.finished <= session.closed
                   for t in session.turns)
    build_report(out)
    events = json.loads((out / TRACE).read_text())["traceEvents"]
    turns = [e for e in events if e.get("ph") == "X" and e["name"].startswith("turn ")]
    # Those within the training window (sessions.jsonl keeps the ones around it too).
    assert 0 < len(turns) <= sum(len(s.turns) for s in sessions)
