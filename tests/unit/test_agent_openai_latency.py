"""examples/agent_openai.py's emulated tool latency (``tool_latency``): the in-process
tool's model (``ToolLatency``: log-normal around the median, sigma 1), one seeded stream
per setting in a process, a fixed latency at sigma 0, none without a median."""

from __future__ import annotations

import statistics

from script_modules import load_script

from async_rl.tasks.calculator import TOOL_LATENCY_SIGMA, ToolLatency

example = load_script("examples/agent_openai.py", "agent_openai_example")


def test_rows_without_a_median_have_no_latency() -> None:
    assert example.tool_latency({"prompt": "1+1="}) is None
    assert example.tool_latency({"prompt": "1+1=", "tool_latency_ms": 0}) is None


def test_a_median_draws_as_the_in_process_tool_does_from_one_stream_per_setting() -> None:
    row = {"prompt": "1+1=", "tool_latency_ms": 200.0}
    latency = example.tool_latency(row)
    assert latency is example.tool_latency({**row, "prompt": "2+2="})  # shared stream
    assert latency.sigma == TOOL_LATENCY_SIGMA
    assert isinstance(latency, ToolLatency)
    draws = [latency.draw_s() for _ in range(400)]
    assert len(draws) == 400 and min(draws) > 0
    assert 0.15 < statistics.median(draws) < 0.27  # around 200 ms
    assert max(draws) > 0.6  # a log-normal tail, not a fixed latency


def test_sigma_zero_makes_every_call_take_the_median() -> None:
    latency = example.tool_latency({"tool_latency_ms": 50.0, "tool_latency_sigma": 0.0})
    assert latency is not None
    assert {latency.draw_s() for _ in range(20)} == {0.05}
    assert example.tool_latency({"tool_latency_ms": 50.0}) is not latency
