"""examples/agent_verifiers.py without Ray or vLLM, through the real gateway and
``AgentRunner`` in front of a fake engine that has learnt the task.

With the verifiers virtualenv (else skipped, except under ``make test``, which makes it
first: ``make verifiers``, or ``ASYNC_RL_VERIFIERS_PYTHON``), the real episode server
(examples/verifiers_calculator.py): a group played by one server process (the rewards
come back, each trajectory is one segment trained only on the model's tokens, and the
model sees the task's raw text through examples/calculator_chat.jinja); trajectories cut
at their timeout leave the server playing the next ones; a server whose stdin ends exits
and the next ``solve`` starts another; what an episode costs once the server runs; the
taskset loaded through verifiers' own loader.

Without it, fake servers (any python speaking the same JSON lines) for the faults: an
episode that fails or replies no reward, a server that fails to start or is killed with
episodes pending, the cancel sent for a trajectory cut at its timeout, the server killed
at this interpreter's exit, no virtualenv."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from script_modules import ROOT, load_script

from async_rl.tasks.calculator import ERROR_RESULT, ExpressionError, evaluate_expression
from buffers.common.records import Prompt, Sample, make_group
from tests.unit.test_gateway import Params, Utf8Tokenizer, fake_gateway, text_ids
from workers.rollout.agents import AgentConfig, AgentRunner

example = load_script("examples/agent_verifiers.py", "agent_verifiers_example")
TEMPLATE = (ROOT / "examples" / "calculator_chat.jinja").read_text()
EOS = 1


REQUIRED = "ASYNC_RL_VERIFIERS_REQUIRED"
"""Set by ``make test``, which makes the virtualenv first: there a missing one fails
these tests instead of skipping them."""


def verifiers_python() -> Path:
    try:
        return example.verifiers_python()
    except FileNotFoundError as err:
        if os.environ.get(REQUIRED):
            pytest.fail(f"{REQUIRED} is set: {err}")
        pytest.skip(str(err))


class CalculatorEngine:
    """Writes a call of the prompt's expression when its context has no tool result yet,
    else the answer after the last result and EOS: a model that has learnt the task.
    The first request of ``guesses`` (a prompt) answers at once, wrongly; while
    ``hang`` is set, requests never end."""

    def __init__(self, guesses: int = 0) -> None:
        self.prompts: list[str] = []
        self.guesses = guesses
        self.hang = False

    async def generate(self, ids: list[int], params: Params, greedy: bool) -> Sample:
        if self.hang:
            await asyncio.sleep(3600)
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


def play_groups(engine: Any, solve: Any, sizes: list[int], timeout_s: float = 120.0
                ) -> list[tuple[Any, list[Sample], Counter[str]]]:
    """Groups of "7*6=" of ``sizes`` trajectories, one after the other, through one
    gateway and ``solve``: each (the group, its samples, the outcomes so far)."""
    prompt = Prompt(prompt_id="p", text="7*6=", answer="42",
                    columns={"prompt": "7*6=", "answer": "42"})

    async def main() -> Any:
        gateway = fake_gateway(engine, max_new_tokens=32, context=160, concurrency=8,
                               chat_template=TEMPLATE)
        await gateway.start()
        config = AgentConfig(agent="unused", agent_timeout_s=timeout_s, max_turns=4)
        runner = AgentRunner(config, gateway, Utf8Tokenizer(), solve=solve)
        played = []
        try:
            for size in sizes:
                prompt_ids, samples, _ = await runner.group(prompt, size)
                played.append((make_group(prompt, prompt_ids, samples), samples,
                               Counter(runner.outcomes)))
            return played
        finally:
            await runner.close()

    return asyncio.run(main())


def play_group(engine: Any, solve: Any, size: int, timeout_s: float = 120.0
               ) -> tuple[Any, list[Sample], Counter[str]]:
    """One group of ``size`` trajectories of "7*6=" through the gateway and ``solve``."""
    return play_groups(engine, solve, [size], timeout_s)[0]


def served(pids: set[int], script: Path = example.SCRIPT) -> Any:
    """``solve`` on ``script``'s server, noting each server's pid in ``pids``."""
    async def solve(client: Any, row: dict[str, Any]) -> float:
        pids.add(example.server(script).pid)
        return float(await example.episode(client, row, script=script))
    return solve


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"  # a killed child whose parent has not reaped it yet


def gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(pid)


# ---- the real server: verifiers' episodes --------------------------------------------------


def test_a_group_played_by_one_verifiers_server_is_rewarded_and_trains_the_models_tokens(
        ) -> None:
    verifiers_python()
    engine, pids = CalculatorEngine(guesses=1), set[int]()
    group, samples, outcomes = play_group(engine, served(pids), 4)
    assert outcomes == Counter(done=4)
    assert sorted(group.rewards) == [0.0, 1.0, 1.0, 1.0] and group.excluded == ()
    # One server played the four episodes, and outlives them.
    assert len(pids) == 1 and alive(next(iter(pids)))
    # The model saw the task's own text: the calculator's result written after its call.
    assert sorted(set(engine.prompts)) == ["7*6=", "7*6=<call>7*6</call><result>42</result>"]
    # One segment a trajectory: the call and the answer (with its EOS) are the model's
    # (mask 1), the environment's result between them context (mask 0).
    assert group.member_trajectories == 4 and len(samples) == 4
    tool = len(text_ids("<result>42</result>"))
    for sample in samples:
        generated = sum(sample.loss_mask)
        if sample.reward == 1.0:
            assert generated == len(text_ids("<call>7*6</call>#### 42")) + 1
            assert len(sample.loss_mask) - generated == tool
        else:
            assert generated == len(sample.loss_mask) == len(text_ids("#### 1")) + 1


def test_the_server_plays_on_after_cancelled_episodes_and_is_replaced_when_it_ends(
        ) -> None:
    verifiers_python()
    engine, pids = CalculatorEngine(), set[int]()
    play_group(engine, served(pids), 1)  # the server is up
    engine.hang = True  # every turn hangs: the trajectories are cut, their episodes cancelled
    _, _, outcomes = play_group(engine, served(pids), 2, timeout_s=3.0)
    assert outcomes == Counter(timeout=2)
    engine.hang = False
    group, _, outcomes = play_group(engine, served(pids), 2)
    assert outcomes == Counter(done=2) and group.rewards == (1.0, 1.0)
    assert len(pids) == 1
    # Its stdin ends (as when this process dies): it exits by itself, and the next
    # trajectory starts another.
    first = example.server()
    assert first.process.stdin is not None
    first.process.stdin.close()
    assert first.process.wait(timeout=30) == 0
    starts = example.starts()
    group, _, outcomes = play_group(engine, served(pids), 2)
    assert outcomes == Counter(done=2) and group.rewards == (1.0, 1.0)
    assert example.starts() == starts + 1 and len(pids) == 2


def test_an_episode_costs_little_cpu_once_the_server_runs(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """The figure docs/agents.md gives: ``pytest tests/unit/test_agent_verifiers.py -k cpu
    -s`` prints the server's CPU seconds per trajectory over groups of 8."""
    verifiers_python()
    engine, pids = CalculatorEngine(), set[int]()
    play_group(engine, served(pids), 8)  # the server is up, and warm
    server = psutil.Process(next(iter(pids)))

    def cpu() -> float:
        times = server.cpu_times()
        return float(times.user + times.system + times.children_user + times.children_system)

    before, groups = cpu(), 4
    played = play_groups(engine, served(pids), [8] * groups)
    per_trajectory = (cpu() - before) / (8 * groups)
    assert played[-1][2] == Counter(done=8 * groups) and len(pids) == 1
    with capsys.disabled():
        print(f"\nverifiers episode server: {per_trajectory * 1000:.0f} ms of CPU a "
              f"trajectory ({groups} groups of 8 after the first)")
    assert per_trajectory < 1.0  # a process of its own a trajectory took about 7.5 s


def calculator_value(expression: str) -> str:
    """The calculator task's value of ``expression``, as the tool reports it."""
    try:
        return str(evaluate_expression(expression))
    except ExpressionError:
        return ERROR_RESULT


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
        "import json, sys\n"
        "expressions, values = json.loads(sys.argv[1])\n"
        "assert [calc.calculate(e) for e in expressions] == values, expressions\n"
        "assert [calc.final_answer(r) for r in ('#### -4', '#### 42</s>', '#### 042', "
        "' #### 4', '#### 4 ', '<call>1+2</call>', '4')] == ['-4', '42', None, None, None, "
        "None, None]\n"
        "print('ok')\n")
    # The copy of the calculator agrees with the task's own, errors included.
    expressions = ["2*(3+4)", "-5-7", "1/2", "x", "10**13", "10000000000000",
                   "999999*999999*9", "(((1)))", "2*-3", "", " 7 ", "1+" * 150 + "1"]
    values = [calculator_value(e) for e in expressions]
    assert values[:5] == ["14", "-12", "error", "error", "error"]
    out = subprocess.run([str(python), "-c", check, json.dumps([expressions, values])],
                         cwd=ROOT / "examples",
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# ---- the faults: fake servers, any python speaking the same lines --------------------------

# A fake episode generates nothing: its trajectory has no segment to carry a reward, so
# these tests read the outcomes.
FAKE_SERVER = '''
import asyncio, json, pathlib, sys

RECEIVED = pathlib.Path(__file__).with_name("received.jsonl")
HANG = pathlib.Path(__file__).with_name("hang")

{handler}

async def main():
    lines = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(lines), sys.stdin)
    episodes = {{}}

    def answer(key, task):
        episodes.pop(key, None)
        if not task.cancelled():
            print(json.dumps({{"id": key, **task.result()}}), flush=True)

    while line := await lines.readline():
        with RECEIVED.open("a") as received:
            received.write(line.decode())
        request = json.loads(line)
        if "cancel" in request:
            episodes[request["cancel"]].cancel()
            continue
        episodes[request["id"]] = task = asyncio.ensure_future(handle(request))
        task.add_done_callback(lambda task, key=request["id"]: answer(key, task))

asyncio.run(main())
'''


@pytest.fixture
def fake_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    """Writes a fake server of an ``async def handle(request)`` (returning the reply's
    fields) in a folder of its own: its script. Its servers are killed after the test."""
    monkeypatch.setenv(example.PYTHON_VARIABLE, sys.executable)

    def write(handler: str, raw: str = "") -> Path:
        script = tmp_path / "server.py"
        script.write_text(raw or FAKE_SERVER.format(handler=handler))
        return script

    yield write
    example.kill_servers()


def received(script: Path) -> list[dict[str, Any]]:
    path = script.with_name("received.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize(("reply", "why"), [
    ('{"error": "RuntimeError: the environment broke"}',
     "the verifiers episode failed: RuntimeError: the environment broke"),
    ("{}", "the verifiers episode server replied no reward"),
])
def test_an_episode_that_fails_or_replies_no_reward_is_an_agent_error(
        fake_server: Any, caplog: pytest.LogCaptureFixture, reply: str, why: str) -> None:
    script = fake_server(f"async def handle(request):\n    return {reply}")
    pids = set[int]()
    group, _, outcomes = play_group(CalculatorEngine(), served(pids, script), 2, timeout_s=30)
    assert outcomes == Counter(error=2)
    assert group.excluded == ("agent_error", "agent_error")
    assert why in caplog.text and len(pids) == 1


def test_the_session_and_the_row_reach_the_server(fake_server: Any) -> None:
    script = fake_server(  # a request is a session: the openai client plays it
        "import openai\n"
        "async def handle(request):\n"
        "    client = openai.AsyncOpenAI(base_url=request['base_url'],\n"
        "                                api_key=request['api_key'], max_retries=0)\n"
        "    model = (await client.models.list()).data[0].id\n"
        "    out = await client.completions.create(model=model,\n"
        "        prompt=request['row']['prompt'], max_tokens=32)\n"
        "    return {'reward': 0.25 if out.choices[0].text == '<call>7*6</call>' else 0}\n")
    pids = set[int]()
    group, _, outcomes = play_group(CalculatorEngine(), served(pids, script), 3, timeout_s=60)
    assert outcomes == Counter(done=3) and group.rewards == (0.25, 0.25, 0.25)
    assert len(pids) == 1 and len(received(script)) == 3


def test_a_server_that_fails_to_start_fails_its_episodes_and_the_next_starts_another(
        fake_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    script = fake_server("", raw="raise SystemExit('the environment broke')")
    starts, pids = example.starts(), set[int]()
    played = play_groups(CalculatorEngine(), served(pids, script), [2, 1], timeout_s=30)
    assert [outcomes for _, _, outcomes in played] == [Counter(error=2), Counter(error=3)]
    assert "exited with status 1: the environment broke" in caplog.text
    assert example.starts() == starts + 2 and len(pids) == 2


def hanging_server(fake_server: Any) -> Path:
    """A fake server whose episodes hang while the file ``hang`` beside it exists (it
    does, until the test removes it), then reward 1."""
    script: Path = fake_server(
        "async def handle(request):\n"
        "    if HANG.exists():\n"
        "        await asyncio.sleep(3600)\n"
        "    return {'reward': 1.0}\n")
    script.with_name("hang").touch()
    return script


def test_a_cut_trajectory_cancels_its_episode_and_the_server_plays_the_next(
        fake_server: Any) -> None:
    script = hanging_server(fake_server)
    pids = set[int]()
    _, _, outcomes = play_group(CalculatorEngine(), served(pids, script), 1, timeout_s=3)
    assert outcomes == Counter(timeout=1)
    script.with_name("hang").unlink()
    _, _, outcomes = play_group(CalculatorEngine(), served(pids, script), 1)
    assert outcomes == Counter(done=1)
    first, cancel, second = received(script)
    assert cancel == {"cancel": first["id"]} and second["id"] != first["id"]
    assert len(pids) == 1


def test_a_killed_server_fails_its_pending_episodes_and_the_next_solve_starts_another(
        fake_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    script = hanging_server(fake_server)
    killed: list[int] = []

    async def solve(client: Any, row: dict[str, Any]) -> float:
        pending = asyncio.ensure_future(example.episode(client, row, script=script))
        while len(received(script)) < 2:  # both episodes are the server's
            await asyncio.sleep(0.02)
        if not killed:
            killed.append(example.server(script).pid)
            os.kill(killed[0], signal.SIGKILL)
        return await pending

    starts = example.starts()
    _, _, outcomes = play_group(CalculatorEngine(), solve, 2, timeout_s=30)
    assert outcomes == Counter(error=2)
    assert f"(pid {killed[0]}) exited with status -9" in caplog.text
    script.with_name("hang").unlink()
    pids = set[int]()
    _, _, outcomes = play_group(CalculatorEngine(), served(pids, script), 2)
    assert outcomes == Counter(done=2)
    assert example.starts() == starts + 2 and killed[0] not in pids


def test_the_server_is_killed_at_exit(tmp_path: Path) -> None:
    script = tmp_path / "server.py"
    script.write_text("import time\ntime.sleep(300)\n")  # deaf to its stdin
    out = subprocess.run(
        [sys.executable, "-c",
         "import sys; sys.path.insert(0, sys.argv[1])\n"
         "from script_modules import load_script\n"
         "example = load_script('examples/agent_verifiers.py', 'agent_verifiers_example')\n"
         "print(example.server(example.Path(sys.argv[2])).pid)\n",
         str(Path(__file__).parent), str(script)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, example.PYTHON_VARIABLE: sys.executable})
    assert out.returncode == 0, out.stderr[-2000:]
    assert gone(int(out.stdout.split()[-1]))


def test_no_virtualenv_says_how_to_make_one(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    monkeypatch.setenv(example.PYTHON_VARIABLE, str(tmp_path / "no-venv" / "bin" / "python"))
    with pytest.raises(FileNotFoundError, match="make verifiers"):
        example.verifiers_python()
