"""Benchmark: the CPU of one agent turn through the gateway, with no engine behind it.

What bench/gateway.py's gateway arm pays per turn beyond the in-process arm, alone:
examples/agent_openai.py's ``solve`` (the real ``openai`` client) plays calculator
trajectories through a real ``Gateway`` (uvicorn, HTTP on 127.0.0.1) and the
``AgentRunner``'s shared client, in front of a fake engine that answers each turn at
once (a tool call, then the answer after the tool's result) and vLLM's own
``SamplingParams`` (each turn clones them, as in a run), with the test models'
byte-level tokenizer (``async_rl.models.tiny_model.build_tokenizer``). ``--groups``
groups of 8 trajectories, ``--side-by-side`` groups at once (16: the examples'
rollout.max_inflight_prompts). Prints the process's CPU per turn (both threads: the
gateway's loop and the agents') and each thread's share.
One process, one core's worth of work: run it on a quiet machine (or under the shared
lock) for figures.

    python -m bench.gateway_turn --groups 96
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any

from buffers.common.records import Prompt, Sample

ROOT = Path(__file__).resolve().parents[1]
AGENT = str(ROOT / "examples" / "agent_openai.py") + ":solve"


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds so far of each of this process's threads, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in os.listdir("/proc/self/task"):
        fields = Path(f"/proc/self/task/{task}/stat").read_text().rsplit(")", 1)[1].split()
        out[task] = (int(fields[11]) + int(fields[12])) / tick
    return out


async def main(groups: int, side_by_side: int) -> None:
    from vllm import SamplingParams  # what the rollout worker hands the gateway

    from async_rl.models.tiny_model import build_tokenizer
    from workers.rollout.agents import AgentConfig, AgentRunner
    from workers.rollout.gateway import Gateway, GatewayLimits

    tokenizer = build_tokenizer()
    answer = [*tokenizer.encode("#### 3906", add_special_tokens=False), tokenizer.eos_token_id]
    call = tokenizer.encode("<call>47*83</call>", add_special_tokens=False)
    turns = 0

    async def generate(ids: list[int], params: Any, greedy: bool) -> Sample:
        nonlocal turns
        turns += 1
        told = str(tokenizer.decode(ids[-12:])).endswith("</result>")
        reply = answer if told else call
        await asyncio.sleep(0)
        return Sample(token_ids=tuple(reply), logprobs=(-0.1,) * len(reply),
                      versions=(0,) * len(reply), finish_reason="stop", text="")

    gateway = Gateway(model_name="calculator", tokenizer=tokenizer,
                      params={"sample": SamplingParams(max_tokens=32),
                              "greedy": SamplingParams(max_tokens=32, temperature=0.0)},
                      generate=generate,
                      limits=GatewayLimits(max_new_tokens=32, max_context=1024,
                                           max_trajectory_tokens=160,
                                           max_concurrency=side_by_side * 8,
                                           vocab_size=len(tokenizer)))
    await gateway.start()
    runner = AgentRunner(AgentConfig(agent=AGENT, max_turns=4, max_trajectory_tokens=160),
                         gateway, tokenizer)
    prompt = Prompt(prompt_id="p", text="47*83=", answer="3901",
                    columns={"prompt": "47*83=", "answer": "3901"})
    await runner.group(prompt, 8)  # warm: imports, the first connections
    turns = 0
    before, cpu, wall = thread_cpu_s(), time.process_time(), time.perf_counter()
    for _ in range(max(1, groups // side_by_side)):
        await asyncio.gather(*(runner.group(prompt, 8) for _ in range(side_by_side)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    after = thread_cpu_s()
    await runner.close()
    used = sorted((after[k] - before.get(k, 0.0) for k in after), reverse=True)
    print(f"{turns} turns: {1e3 * cpu / turns:.2f} ms CPU a turn ({1e3 * wall / turns:.2f} "
          f"ms wall), threads {', '.join(f'{1e3 * u / turns:.2f}' for u in used if u)} ms; "
          f"outcomes {dict(runner.outcomes)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=96)
    parser.add_argument("--side-by-side", type=int, default=16)
    args = parser.parse_args()
    asyncio.run(main(args.groups, args.side_by_side))
