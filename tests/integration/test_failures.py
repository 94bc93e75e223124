"""Failures a run must survive or refuse cleanly: a rollout worker dies mid-run (the run
is told, goes on with the others, starts a new one in its place, loses nothing) and, in
the same run, another stops itself cleanly (its rollouts in progress are handed back and
continued on another engine, and it is replaced), the
only rollout worker dies mid-run and again after the model is saved, each time as
evaluations start (it is restarted, the run completes, the evaluations run; one run for
both: a Ray and vLLM start is most of a run's time here), and a weight transport the
hardware does not have (one config line, exit status 2)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import ray

from async_rl.cli import main
from async_rl.config_io import decode_config
from async_rl.control.evaluation_runner import EvaluationRunner
from async_rl.run.run_dir import FINAL_MODEL, METRICS, read_ledger
from async_rl.run.summary import RunSummary
from async_rl.shell.adapters import RayRollout
from async_rl.shell.ray_shell import NAMESPACE, run_training
from buffers.common.reports import EvalResult

pytestmark = pytest.mark.ray


def kill_during_run(tiny_model_dir: Path, out: Path, workers: int, victim: str,
                    leaving: str = "") -> tuple[RunSummary, int]:
    """Runs 12 steps on ``workers`` rollout workers and kills actor ``victim`` once 3
    steps have trained; ``leaving``: an actor stopped cleanly (``leave``) once 6 steps
    have trained, while it holds generated tokens. Returns the summary and the groups
    it handed back."""
    config = decode_config({
        "model": {"path": str(tiny_model_dir)},
        "task": {"eval_size": 0},
        # With an engine to stop cleanly: its tokens counted as they come, and longer
        # samples, so that it is stopped with tokens to hand back.
        "rollout": {"num_workers": workers, "group_size": 4,
                    "max_new_tokens": 16 if leaving else 6, "stream_tokens": bool(leaving),
                    "max_inflight_prompts": 4, "memory_fraction": 0.1},
        "staleness": {"max_staleness": 1},
        "trainer": {"groups_per_step": 4, "micro_batch_tokens": 512},
        "run": {"num_steps": 12, "output_dir": str(out), "progress": False},
    })
    result: list[RunSummary] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(run_training(config))
        except BaseException as err:  # surfaced by the assertions below
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not errors:
        metrics = out / METRICS
        if metrics.exists() and len(metrics.read_bytes().splitlines()) >= 3:
            break
        time.sleep(0.2)
    assert not errors, errors
    ray.kill(ray.get_actor(victim, namespace=NAMESPACE))
    handed = 0
    if leaving:
        actor = ray.get_actor(leaving, namespace=NAMESPACE)
        while time.monotonic() < deadline and not errors and not handed:
            metrics = out / METRICS
            if (metrics.exists() and len(metrics.read_bytes().splitlines()) >= 6
                    and ray.get(actor.statistics.remote()).tokens_in_flight >= 2):
                handed = ray.get(actor.leave.remote())
            time.sleep(0.01)
    thread.join(timeout=300)
    assert not thread.is_alive()
    assert not errors, errors
    (summary,) = result
    return summary, handed


def check_nothing_lost(out: Path, steps: int = 12) -> None:
    entries = read_ledger(out)
    trained = [e.prompt_id for e in entries if e.event == "trained"]
    assert len(trained) == len(set(trained)) == steps * 4
    assert all(e.reason for e in entries if e.event in ("failed", "requeued"))
    # Every prompt the dead worker held came back and was admitted again.
    requeued = {e.prompt_id for e in entries if e.event == "requeued"}
    for pid in requeued:
        admitted = [e for e in entries if e.prompt_id == pid and e.event == "admitted"]
        assert len(admitted) >= 2, pid


def test_dead_rollout_worker_is_replaced_and_its_prompts_requeued(
    tiny_model_dir: Path, tmp_path: Path, ray_shutdown: None
) -> None:
    """rollout-1 killed (SIGKILL: nothing handed back, its prompts run again) after
    step 3; rollout-0 stopped cleanly after step 6 while it generates: its groups in
    progress come back as partial rollouts, another engine continues each from its kept
    tokens, and it is replaced. Nothing lost, nothing trained twice."""
    out = tmp_path / "run"
    summary, handed = kill_during_run(tiny_model_dir, out, workers=2, victim="rollout-1",
                                      leaving="rollout-0")
    assert summary.steps == 12
    assert summary.retired_workers == summary.restarts == 2
    # The dead worker's transfer group failed alone: the survivor got every version,
    # and so did the replacement from the version it started at.
    assert summary.rollout_version == summary.final_version == 12
    check_nothing_lost(out)
    entries = read_ledger(out)
    back = [e for e in entries if (e.event, e.reason) == ("handed_back", "engine_stopped")]
    print(f"groups in progress at the clean stop: {handed}; handed back: "
          f"{[e.lengths for e in back]}")
    # The groups in progress at the stop came back with their tokens. A group sent to
    # the engine after it left, before the run saw it leave, comes back too: with nothing
    # kept (not started), or, a continuation, with what it was given (the same prompt
    # again).
    kept = {e.prompt_id for e in back if sum(e.lengths)}
    assert 1 <= len(kept) <= handed  # some tokens were kept, and continued
    for event in back:  # continued from what it kept (or run again: nothing kept)
        history = [(e.event, e.reason) for e in entries if e.prompt_id == event.prompt_id]
        after = history[history.index(("handed_back", "engine_stopped")) + 1:]
        first = ("admitted", "continue") if event.lengths else ("requeued", "not_started")
        # Then the run's own rules: trained, or (a continuation judged too stale, then
        # its prompt dropped as stale each time it ran again on a loaded machine) dropped
        # for good past run.max_readmissions, never lost.
        assert after[0] == first and after[-1] in (
            ("trained", ""), ("dropped", "readmissions_exhausted")), history


def test_the_only_rollout_worker_killed_mid_run_and_as_evaluations_start_is_restarted(
    tiny_model_dir: Path, tmp_path: Path, ray_shutdown: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The only rollout worker is killed as the step-3 evaluation (beside training) and
    as the final one (after the model is saved) start: each time it is restarted, the
    run completes, and the evaluation runs on the new engine; training loses nothing.
    The first kill is mid-run: at max_staleness 1 the last step trains on groups of
    version 4 or later, which only the restarted worker can have generated."""
    out = tmp_path / "run"
    config = decode_config({
        "model": {"path": str(tiny_model_dir)},
        "task": {"eval_size": 8},
        "rollout": {"group_size": 4, "max_new_tokens": 6, "memory_fraction": 0.1},
        "staleness": {"max_staleness": 1},
        "trainer": {"groups_per_step": 4, "micro_batch_tokens": 512},
        "run": {"num_steps": 6, "eval_every": 3, "output_dir": str(out),
                "progress": False},
    })
    on_rollout = EvaluationRunner._on_rollout
    killed: list[int] = []

    async def kill_then_evaluate(self: EvaluationRunner, step: int) -> EvalResult | None:
        if step > 0 and step not in killed:
            killed.append(step)
            victim = self.pool.workers[min(self.pool.workers)]
            assert isinstance(victim, RayRollout)
            ray.kill(victim.handle)
        return await on_rollout(self, step)

    monkeypatch.setattr(EvaluationRunner, "_on_rollout", kill_then_evaluate)
    summary = run_training(config)
    assert killed == [3, 6]
    assert summary.steps == summary.final_version == 6
    assert summary.restarts == summary.failures["worker_restarts"] == 2
    assert [p.step for p in summary.evals] == [0, 3, 6]
    assert summary.accuracy_end is not None
    assert (out / FINAL_MODEL / "config.json").exists()
    check_nothing_lost(out, steps=6)


def test_cuda_transport_without_gpus_is_a_config_error(
    tiny_model_dir: Path, tmp_path: Path, ray_shutdown: None,
    capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[model]\npath = "{tiny_model_dir}"\n[run]\nprogress = false\n'
                      f'output_dir = "{tmp_path / "run"}"\n')
    assert main(["train", str(config), "--set", "weights.transport=nccl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("config error: weights.transport = 'nccl': needs CUDA GPUs, and the "
                       'workers have none; use "gloo" on CPU')
