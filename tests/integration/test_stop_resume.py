"""Stop and resume on real Ray, the real vLLM CPU build and the tiny model, with LoRA.

- As a user's process stopped by a scheduler: SIGTERM to the whole process group of
  ``async-rl train`` (the driver and Ray's own processes: its control store, raylet and
  agents) at once, mid-run. Ray's processes keep it pending, so the driver stops the
  run as for its own SIGTERM: exit 143 within Slurm's 30 s before SIGKILL, with a
  checkpoint, a readable report, and no process of the run left behind. Its model is
  named by hub id, resolved offline from a hub cache laid out here, and the run records
  the snapshot directory it loaded.
- Exact resume: that run (6 steps, SIGTERM after 3, at max_staleness 0 with seeded
  sampling) resumed with ``--resume`` trains the same prompts once each as 6 steps
  straight, to final adapters (and merged policies) equal within float tolerance. The
  checkpoint's queued
  groups (``check_restored``: none at max_staleness 0, where the stop waits for the last
  version's delivery and the next step's prompts start only then; some in
  test_environment_run.py's run at 1) are each trained once, without being generated
  again, and no prompt is both queued and owed. No partial rollout either: no prompt is
  admitted once the stop's step has trained, and at max_staleness 0 none started before
  it is left, so the equal weights hold (a continued rollout is exact in a weaker sense,
  docs/operations.md: its kept prefix bit for bit, its continuation a fresh sample).
  The straight run is also the synchronous run (``check_synchronous``): every group
  on-policy, and evaluations every 2 steps on the idle-CPU evaluator, versions
  delivered with the engines drained, each scoring exactly its step.
  SIGINT in process is test_ppo_run's stop (and test_environment_run's); the exact
  resume of full weights is test_ppo_run's too.
- LoRA, in both runs: the stop's checkpoint holds the adapter, the engines resume with
  it, each version carries only the adapters' bytes, and final_model holds the peft
  adapter and the merged policy.
- GRPO with the KL term in the loss to a reference of its own (reference.path, the
  long-tail warm start: another model of the policy's architecture and tokenizer): those
  runs have it, and ``kl/mean`` and ``kl/max`` are in every row, positive from the first
  step whatever the policy's rewards (0 at the first step with the initial policy as the
  reference: ``tests/unit/test_ppo_roles.py``); no critic metrics.

The one SIGTERM run serves every test here (``stopped_by_sigterm``): a Ray and vLLM
start is most of a run's time here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import psutil
import pytest
import torch
from hub_cache import add_to_hub_cache
from safetensors.torch import load_file
from test_async_grpo import check_evals, check_ledger
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_rl.config import Config
from async_rl.config_io import decode_config, load_config, to_toml
from async_rl.control.checkpoint_files import CHECKPOINTS, TRAINER, RunState, latest_checkpoint
from async_rl.run.inputs import check_inputs
from async_rl.run.run_dir import CONFIG, FINAL_MODEL, read_evals, read_ledger, read_metrics
from async_rl.run.summary import RunSummary
from async_rl.shell.ray_shell import run_training
from async_rl.tasks.table import build_task
from workers.eval.greedy import evaluate_accuracy

pytestmark = pytest.mark.ray

STEPS = 6
HUB_ID = "async-rl-tests/tiny"


LORA = {"rank": 8, "alpha": 16}


def config(model_dir: Path, out: Path, *, reference: Path, evals: bool = False) -> Config:
    """LoRA adapters with the merged policy saved too, the KL term in the loss to
    ``reference`` (reference.path). ``evals``: held-out evaluations every 2 steps on the
    idle-CPU evaluator, versions delivered with the engines drained (neither changes
    what trains)."""
    return check_inputs(decode_config({
        "model": {"path": str(model_dir), "lora": LORA},
        "task": {"eval_size": 16 if evals else 0},
        **({"weights": {"update_mode": "drain"}} if evals else {}),
        "rollout": {"group_size": 4, "max_new_tokens": 6, "max_inflight_prompts": 4,
                    "sampling_seed": 7},
        "staleness": {"max_staleness": 0},
        "trainer": {"groups_per_step": 4, "micro_batch_tokens": 512, "lr": 1e-4,
                    "kl_coef": 0.1},
        "reference": {"path": str(reference)},
        "run": {"num_steps": STEPS, "output_dir": str(out), "progress": False,
                "save_merged": True,
                **({"eval_every": 2, "eval_on": "idle_cpu"} if evals else {})},
    }))


def trained(run_dir: Path) -> Counter[str]:
    return Counter(e.prompt_id for e in read_ledger(run_dir) if e.event == "trained")


def check_restored(run_dir: Path, state: RunState) -> set[str]:
    """The queued groups of the checkpoint ``state`` a resume of ``run_dir`` continued
    from: none of them owed as well, their slots still held; after the resume each was
    restored once and trained once, without a new ``generated`` event (unless dropped as
    stale at the restore, then generated anew). Returns their prompts."""
    queued = {saved.group.prompt_id for saved in state.queue}
    assert len(queued) == len(state.queue)
    assert not queued & {prompt.prompt_id for prompt in state.reissue}
    assert state.gate.started == state.counters.groups_trained + len(state.queue)
    events: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for entry in read_ledger(run_dir):
        events[entry.prompt_id].append((entry.event, entry.reason))
    restored = {p for p, history in events.items() if ("restored", "resume") in history}
    assert restored == queued
    for prompt in restored:
        kinds = [event for event, _ in events[prompt]]
        after = events[prompt][kinds.index("restored") + 1:]
        assert kinds.count("restored") == 1 and kinds.count("trained") == 1, events[prompt]
        if ("dropped", "stale") not in after:
            assert [event for event, _ in after] == ["trained"], events[prompt]
    return queued


def signal_after_rows(run_dir: Path, rows: int, signum: int, pid: int) -> threading.Thread:
    """Sends ``signum`` to ``pid`` once metrics.jsonl has ``rows`` rows."""

    def watch() -> None:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_bytes().splitlines()) >= rows:
                os.kill(pid, signum)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


class Stopped(NamedTuple):
    """What ``async-rl train`` stopped by SIGTERM left, read before anything resumed it."""

    out: Path
    returncode: int
    output: str
    summary: dict[str, Any]
    checkpoint_version: int
    checkpoint: RunState
    """The stop's checkpoint, read before anything resumed it."""
    checkpoint_adapter: bool
    """Whether that checkpoint's trainer folder held the adapter (peft's file)."""
    checkpoints: int
    report: subprocess.CompletedProcess[str]
    group: list[int]
    """The process group the SIGTERM went to."""
    exited_s: float
    """Seconds from the SIGTERM to the driver's exit (at most 30: then it was killed)."""
    left: list[dict[str, Any]]
    """Processes of the run's session alive (not zombies) once it exited."""
    rows: list[dict[str, Any]]
    """Its metrics.jsonl."""
    snapshot: Path
    """Where the hub cache holds ``HUB_ID``, the run's model.path."""


@pytest.fixture(scope="module")
def stopped_by_sigterm(tiny_model_dir: Path, longtail_model_dir: Path,
                       tmp_path_factory: pytest.TempPathFactory) -> Stopped:
    """``async-rl train`` (a user's process in its own session and process group) on
    ``config``'s 6 steps with the KL to a reference, the model named by hub id
    (``HUB_ID``: the tiny model in a hub cache of its own, offline), its process group
    given SIGTERM once 3 steps are logged."""
    tmp = tmp_path_factory.mktemp("sigterm")
    out = tmp / "run"
    home = tmp / "hf-home"
    snapshot = add_to_hub_cache(home / "hub", HUB_ID, model_dir=tiny_model_dir)
    checked = config(tiny_model_dir, out, reference=longtail_model_dir)
    toml = tmp / "config.toml"
    toml.write_text(to_toml(msgspec.structs.replace(
        checked, model=msgspec.structs.replace(checked.model, path=HUB_ID),
        run=msgspec.structs.replace(checked.run, stop_timeout_s=20.0))))
    env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
    env |= {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "async_rl.cli", "train", str(toml)]
    # Its own session and group: every process it starts (Ray's too) carries the
    # session id; Ray's workers lead process groups of their own.
    child = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env)
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_bytes().splitlines()) >= 3):
        assert child.poll() is None and time.monotonic() < deadline, child.returncode
        time.sleep(0.05)
    group = [p.pid for p in psutil.process_iter() if _pgid(p) == child.pid]
    os.killpg(child.pid, signal.SIGTERM)
    sent = time.monotonic()
    try:
        output, _ = child.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        output, _ = child.communicate()
    exited_s = time.monotonic() - sent
    left = [p.info for p in psutil.process_iter(["pid", "name", "status"])
            if _session(p) == child.pid and p.info["status"] != psutil.STATUS_ZOMBIE]
    assert (out / "summary.json").is_file(), output[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    folder, state = latest_checkpoint(out)
    checkpoints = len(list((out / CHECKPOINTS).iterdir()))
    report = subprocess.run([sys.executable, "-m", "async_rl.cli", "report", str(out)],
                            capture_output=True, text=True, timeout=120)
    return Stopped(out=out, returncode=child.returncode, output=output, summary=summary,
                   checkpoint_version=state.version, checkpoint=state,
                   checkpoint_adapter=(folder / TRAINER / "adapter"
                                       / "adapter_model.safetensors").is_file(),
                   checkpoints=checkpoints, report=report, group=group, exited_s=exited_s,
                   left=left, rows=read_metrics(out), snapshot=snapshot)


def test_sigterm_exits_143_resumable_readable_and_leaves_nothing_behind(
    stopped_by_sigterm: Stopped,
) -> None:
    run = stopped_by_sigterm
    assert run.returncode == 143, run.output[-2000:]
    assert f"--resume {run.out}" in run.output.splitlines()[-1]
    assert run.summary["stopped"] == "SIGTERM" and run.summary["steps"] >= 3
    assert run.checkpoint_version == run.summary["steps"]
    assert run.checkpoints == 1
    assert run.report.returncode == 0 and "idle" in run.report.stdout.lower()
    assert not run.left, run.left


def test_sigterm_to_the_whole_process_group_stops_cleanly_and_resumes(
    stopped_by_sigterm: Stopped,
) -> None:
    """The SIGTERM reached Ray's own processes too, and the driver still stopped the run
    within Slurm's 30 s (the resume, which trains every prompt once: the straight-run
    test below)."""
    run = stopped_by_sigterm
    assert len(run.group) >= 3, run.group  # the driver, Ray's control store and raylet
    print(f"group SIGTERM: exit {run.returncode} after {run.exited_s:.1f} s")
    assert run.exited_s < 30 and run.returncode == 143, run.output[-2000:]
    assert run.summary["stopped"] == "SIGTERM" and not run.left


def test_train_runs_a_model_named_by_hub_id(stopped_by_sigterm: Stopped) -> None:
    run = stopped_by_sigterm
    assert run.summary["steps"] >= 3, run.output[-2000:]
    assert load_config(run.out / CONFIG).model.path == str(run.snapshot)


def test_grpo_with_a_kl_term_reports_the_kl_to_the_reference(
    stopped_by_sigterm: Stopped,
) -> None:
    rows = stopped_by_sigterm.rows
    assert len(rows) >= 3
    for row in rows:
        assert row["kl/mean"] > 0 and row["kl/max"] >= row["kl/mean"]
    assert not any(key.startswith("critic/") for key in rows[-1])


def test_stop_and_resume_trains_what_a_straight_run_trains(
    stopped_by_sigterm: Stopped, tiny_model_dir: Path, longtail_model_dir: Path,
    tmp_path: Path, ray_shutdown: None
) -> None:
    straight, resumed = tmp_path / "straight", stopped_by_sigterm.out
    straight_config = config(tiny_model_dir, straight, reference=longtail_model_dir,
                             evals=True)
    summary = run_training(straight_config)
    check_synchronous(straight, summary, straight_config, tiny_model_dir)

    stopped = stopped_by_sigterm.summary["steps"]
    assert stopped_by_sigterm.summary["stopped"] == "SIGTERM" and 3 <= stopped < STEPS
    assert stopped_by_sigterm.checkpoint_version == stopped
    assert stopped_by_sigterm.checkpoint_adapter
    # What --resume runs (the run directory's own config), with a checkpoint every step:
    # that rotates away the one the run resumed from (keep 2), and the later saves must
    # not need its folder.
    every_step = load_config(resumed / CONFIG, ["run.checkpoint_every=1"])
    second = run_training(every_step, resume=True)
    assert second.stopped == "" and second.final_version == second.rollout_version == STEPS

    # The same prompts, each trained exactly once, and no step row twice; the queued
    # groups the stop kept (none at max_staleness 0) trained as they were generated.
    assert trained(straight) == trained(resumed)
    assert len(trained(resumed)) == STEPS * 4 and set(trained(resumed).values()) == {1}
    kept = check_restored(resumed, stopped_by_sigterm.checkpoint)
    print(f"queued groups kept by the stop: {len(kept)}")
    assert stopped_by_sigterm.checkpoint.partials == ()  # nothing was in flight
    rows = read_metrics(resumed)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["kl/mean"] > 0 for r in rows)  # the reference resumed
    # Equal adapters, and so equal merged policies: same samples (seeded per request),
    # same updates; only float summation order may differ.
    for name in ("adapter_model.safetensors", "merged/model.safetensors"):
        a = load_file(straight / FINAL_MODEL / name)
        b = load_file(resumed / FINAL_MODEL / name)
        assert a.keys() == b.keys() and len(a) > 0
        worst = max(float((a[k] - b[k]).abs().max()) for k in a)
        print(f"largest difference in {name}, straight vs stopped and resumed: {worst:.3g}")
        assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a), worst
    check_adapter_versions(resumed, rows, tiny_model_dir)


def check_adapter_versions(run_dir: Path, rows: list[dict[str, Any]],
                           base_dir: Path) -> None:
    """Every version the run (stopped and resumed) delivered beside the next step carried
    the adapters' bytes only, and final_model holds that adapter, trained, with peft's
    config and the merged policy beside it."""
    full = sum(t.numel() * t.element_size()
               for t in load_file(base_dir / "model.safetensors").values())
    sent = [b["bytes"] for r in rows for b in r["broadcast"]]
    assert len(sent) >= 2 and len(set(sent)) == 1
    print(f"bytes per version: {sent[0]} of {full} ({sent[0] / full:.1%})")
    assert 0 < sent[0] < 0.1 * full

    final = run_dir / FINAL_MODEL
    adapter = load_file(final / "adapter_model.safetensors")
    assert sum(t.numel() * t.element_size() for t in adapter.values()) == sent[0]
    assert any(t.any() for k, t in adapter.items() if ".lora_B." in k)  # it trained
    assert (final / "adapter_config.json").is_file()
    merged = load_file(final / "merged" / "model.safetensors")
    base = load_file(base_dir / "model.safetensors")
    assert merged.keys() == base.keys()
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])


def check_synchronous(run_dir: Path, summary: RunSummary, run_config: Config,
                      model_dir: Path) -> None:
    """At max_staleness 0 every group trains on-policy, none is dropped as stale, and each
    evaluation (every 2 steps, on the idle-CPU evaluator) scores exactly its step's
    version, the last one the saved merged policy as transformers scores it."""
    assert summary.staleness_histogram == (STEPS * 4,)
    assert summary.dropped_stale == 0
    check_ledger(run_dir, summary.groups_trained)
    check_evals(run_dir, summary, steps=[0, 2, 4, 6], group_size=4, groups_per_step=4)
    rows = read_evals(run_dir)
    assert [(r.version_min, r.version) for r in rows] == [(0, 0), (2, 2), (4, 4), (6, 6)]
    final = AutoModelForCausalLM.from_pretrained(run_dir / FINAL_MODEL / "merged")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    _, reward_fn, prompts = build_task(run_config)
    assert rows[-1].accuracy == evaluate_accuracy(final, tokenizer, prompts, reward_fn,
                                                  max_new_tokens=6)


def _pgid(process: psutil.Process) -> int:
    try:
        return os.getpgid(process.pid)
    except OSError:  # exited meanwhile
        return -1


def _session(process: psutil.Process) -> int:
    try:
        return os.getsid(process.pid)
    except OSError:  # exited meanwhile
        return -1
