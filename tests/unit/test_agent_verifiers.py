"""examples/agent_verifiers.py without Ray or vLLM: a group played by the real verifiers
environment (examples/verifiers_calculator.py, in the verifiers virtualenv) through the
real gateway and ``AgentRunner``, in front of a fake engine that has learnt the task
(the rewards come back, each trajectory is one segment trained only on the model's
tokens, and the model sees the task's raw text through examples/calculator_chat.jinja);
the environment's taskset loaded through verifiers' own loader; and the process's
faults, which need no verifiers: no reward printed, a failed process, a trajectory cut
at its timeout (its process and what it started killed), no virtualenv.

The two tests that run verifiers are skipped when its virtualenv is absent
(``make verifiers``, or ``ASYNC_RL_VERIFIERS_PYTHON``)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from script_modules import ROOT, load_script

from buffers.common.records import Prompt, Sample, make_group
from tests.unit.test_gateway import Params, Utf8Tokenizer, fake_gateway, text_ids
from workers.rollout.agents import AgentConfig, AgentRunner

example = load_script("examples/agent_verifiers.py", "agent_verifiers_example")
TEMPLATE = (ROOT / "examples" / "calculator_chat.jinja").read_text()
EOS = 1


def verifiers_python() -> Path:
    try:
        return example.verifiers_python()
    except FileNotFoundError as err:
        pytest.skip(str(err))


class CalculatorEngine:
    """Writes a call of the prompt's expression when its context has no tool result yet,
    else the answer after the last result and EOS: a model that has learnt the task.
    The first request of ``guesses`` (a prompt) answers at once, wrongly."""

    def __init__(self, guesses: int = 0) -> None:
        self.prompts: list[str] = []
        self.guesses = guesses

    async def generate(self, ids: list[int], params: Params, greedy: bool) -> Sample:
        text = Utf8Tokenizer().decode(ids)
        self.prompts.append(text)
        if "<result>" in text:
            reply = text_ids("#### " + text[text.rfind("<result>") + 8:text.rfind("</result>")])
            reply.append(EOS)
        elif self.guesses:
            self.guesses -= 1
            reply = [*text_ids("#### 1"), EOS]
        else:
            reply = text_ids(f"<call>{text.split('=')[0]}</call>")
        out = reply[:params.max_tokens]
        return Sample(token_ids=tuple(out), logprobs=(-0.5,) * len(out),
                      versions=(2,) * len(out), finish_reason="stop", text="")


def play_group(engine: Any, solve: Any, size: int, timeout_s: float = 120.0,
               chat_template: str = TEMPLATE) -> tuple[Any, list[Sample], Counter[str]]:
    """One group of ``size`` trajectories of "7*6=" through the gateway and ``solve``."""
    prompt = Prompt(prompt_id="p", text="7*6=", answer="42",
                    columns={"prompt": "7*6=", "answer": "42"})

    async def main() -> Any:
        gateway = fake_gateway(engine, max_new_tokens=32, context=160, concurrency=4,
                               chat_template=chat_template)
        await gateway.start()
        config = AgentConfig(agent="unused", agent_timeout_s=timeout_s, max_turns=4)
        runner = AgentRunner(config, gateway, Utf8Tokenizer(), solve=solve)
        try:
            prompt_ids, samples, _ = await runner.group(prompt, size)
            return make_group(prompt, prompt_ids, samples), samples, runner.outcomes
        finally:
            await runner.close()

    return asyncio.run(main())


def test_a_group_played_by_verifiers_is_rewarded_and_trains_the_models_tokens() -> None:
    verifiers_python()
    engine = CalculatorEngine(guesses=1)
    group, samples, outcomes = play_group(engine, example.solve, 2)
    assert outcomes == Counter(done=2)
    assert sorted(group.rewards) == [0.0, 1.0] and group.excluded == ()
    # The model saw the task's own text: the calculator's result written after its call.
    assert sorted(set(engine.prompts)) == ["7*6=", "7*6=<call>7*6</call><result>42</result>"]
    # One segment a trajectory: the call and the answer (with its EOS) are the model's
    # (mask 1), the environment's result between them context (mask 0).
    assert group.member_trajectories == 2 and len(samples) == 2
    tool = len(text_ids("<result>42</result>"))
    for sample in samples:
        generated = sum(sample.loss_mask)
        if sample.reward == 1.0:
            assert generated == len(text_ids("<call>7*6</call>#### 42")) + 1
            assert len(sample.loss_mask) - generated == tool
        else:
            assert generated == len(sample.loss_mask) == len(text_ids("#### 1")) + 1


def test_the_taskset_loads_the_calculator_rows_through_verifiers() -> None:
    python = verifiers_python()
    check = (
        "import verifiers.v1 as vf, verifiers_calculator as calc\n"
        "config = vf.resolve_env_config({'taskset': {'id': calc.PLUGIN}})\n"
        "env = vf.load_environment(config)\n"
        "tasks = list(env.taskset)\n"
        "assert type(env).__name__ == 'CalculatorEnv', type(env)\n"
        "assert type(env._harnesses['agent']).__name__ == 'ChatHarness'\n"
        "assert len(tasks) == 1000 and tasks[0].data.prompt == '34*43=', tasks[0].data\n"
        "assert tasks[0].data.answer == '1462' and tasks[1].data.answer == '-44'\n"
        "assert [calc.calculate(e) for e in ('2*(3+4)', '-5-7', '1/2', 'x', '10**13')] == "
        "['14', '-12', 'error', 'error', 'error']\n"
        "assert [calc.final_answer(r) for r in ('#### -4', '#### 42</s>', '#### 042', "
        "' #### 4', '#### 4 ', '<call>1+2</call>', '4')] == ['-4', '42', None, None, None, "
        "None, None]\n"
        "print('ok')\n")
    out = subprocess.run([str(python), "-c", check], cwd=ROOT / "examples",
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# ---- the process's faults: any python plays the episode's script --------------------------


@pytest.fixture
def any_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(example.PYTHON_VARIABLE, sys.executable)


def scripted(path: Path) -> Any:
    async def solve(client: Any, row: dict[str, Any]) -> float:
        return float(await example.episode(client, row, script=path))
    return solve


@pytest.mark.parametrize(("source", "why"), [
    ("print('no reward here')", "printed no reward (its output ended 'no reward here')"),
    ("raise SystemExit('the environment broke')",
     "exited with status 1: the environment broke"),
])
def test_a_process_that_prints_no_reward_or_fails_is_an_agent_error(
        any_python: None, tmp_path: Path, caplog: pytest.LogCaptureFixture, source: str,
        why: str) -> None:
    script = tmp_path / "episode.py"
    script.write_text(source)
    group, _, outcomes = play_group(CalculatorEngine(), scripted(script), 2, timeout_s=30)
    assert outcomes == Counter(error=2)
    assert group.excluded == ("agent_error", "agent_error")
    assert why in caplog.text


def test_the_session_and_the_row_reach_the_process(any_python: None, tmp_path: Path) -> None:
    script = tmp_path / "episode.py"
    script.write_text(  # the openai client finds the session in the environment
        "import json, sys, openai\n"
        "row = json.load(sys.stdin)\n"
        "client = openai.OpenAI(max_retries=0)\n"
        "out = client.completions.create(model=client.models.list().data[0].id,\n"
        "                                prompt=row['prompt'], max_tokens=32)\n"
        "print('played'); print(0.25 if out.choices[0].text == '<call>7*6</call>' else 0)\n")
    group, _, outcomes = play_group(CalculatorEngine(), scripted(script), 2, timeout_s=60)
    assert outcomes == Counter(done=2) and group.rewards == (0.25, 0.25)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"  # a killed child whose parent has not reaped it yet


def test_a_trajectory_cut_at_its_timeout_kills_its_process_and_what_it_started(
        any_python: None, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = tmp_path / "episode.py"
    script.write_text(
        "import os, pathlib, subprocess, time\n"
        "child = subprocess.Popen(['sleep', '300'])\n"
        f"pathlib.Path({str(pids)!r}).write_text(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(300)\n")
    seen: list[int] = []

    async def solve(client: Any, row: dict[str, Any]) -> float:
        task = asyncio.ensure_future(example.episode(client, row, script=script))
        while not pids.exists() or not pids.read_text():
            await asyncio.sleep(0.05)
        seen.extend(int(pid) for pid in pids.read_text().split())
        return float(await task)

    group, _, outcomes = play_group(CalculatorEngine(), solve, 1, timeout_s=10)
    assert outcomes == Counter(timeout=1) and group.excluded == ("agent_timeout",)
    assert len(seen) == 2
    for _ in range(200):  # SIGKILL is delivered at once; an orphan's reaping may lag
        if not any(alive(pid) for pid in seen):
            break
        time.sleep(0.01)
    assert not any(alive(pid) for pid in seen)


def test_no_virtualenv_says_how_to_make_one(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    monkeypatch.setenv(example.PYTHON_VARIABLE, str(tmp_path / "no-venv" / "bin" / "python"))
    with pytest.raises(FileNotFoundError, match="make verifiers"):
        example.verifiers_python()


def test_processes_at_once_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(example.PROCESSES_VARIABLE, "3")
    assert example.processes_at_once() == 3
    monkeypatch.delenv(example.PROCESSES_VARIABLE)
    assert example.processes_at_once() == 2 * len(os.sched_getaffinity(0))
