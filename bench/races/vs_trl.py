"""Benchmark: async-rl against TRL's GRPOTrainer, same machine, same job, one after the other.

Three runs in one process, in this order, on the same local model, the same prompts in
the same order (the task's prompt stream: ``build_task(config)[0].prompt_at(0..)``), the
same reward function and the same hyper-parameters:

(a) TRL ``GRPOTrainer`` (``trl==1.16.0``, the ``peer`` extra): transformers generation
    (``use_vllm=False``), fp32, 2 torch threads (``--trl-threads``) for generation and
    training together, ``OMP_WAIT_POLICY=PASSIVE`` (see ``OMP_WAIT_POLICY`` below);
(b) async-rl with the task's example config (``examples/cpu_default.toml`` or
    ``examples/cpu_longtail.toml``): one vLLM rollout worker and one trainer shard, one
    core each, at the config's max_staleness;
(c) async-rl with ``staleness.max_staleness=0``: the synchronous baseline, same engine.

Why TRL runs without vLLM: its colocated vLLM mode fails on the vLLM CPU build (0.32) at
the first weight reload (``'Parameter' object has no attribute 'weight_loader'``), and
server mode needs a second process and device; so TRL generates with
``model.generate`` (KV cache, left-padded batch of the whole step).

How async-rl's knobs map onto TRL's ``GRPOConfig`` (read in trl/trainer/grpo_config.py
and grpo_trainer.py of 1.16.0):

- rollout.group_size -> ``num_generations``.
- trainer.groups_per_step -> ``per_device_train_batch_size = groups_per_step * group_size``
  with ``gradient_accumulation_steps = 1`` and ``steps_per_generation = 1``, so
  ``generation_batch_size`` is one step's completions: one generation batch, one
  optimizer step, ``num_iterations = 1`` (each batch trained once, as async-rl does).
- rollout.max_new_tokens -> ``max_completion_length``; rollout.temperature ->
  ``temperature`` with ``top_p = 1.0``, ``top_k = 0``, no ``min_p``, ``repetition_penalty
  = 1.0`` (async-rl samples the full distribution; TRL scores at the same temperature).
- trainer.lr / weight_decay / max_grad_norm -> ``learning_rate`` / ``weight_decay`` /
  ``max_grad_norm``; ``optim = "adamw_torch_fused"`` (Trainer's default on torch >= 2.8)
  with torch's default betas and eps: async-rl's ``torch.optim.AdamW(fused=True)``;
  ``lr_scheduler_type = "constant"``, no warm-up (Trainer's default is a linear decay
  to 0; async-rl's lr is constant).
- loss: ``loss_type = "dapo"``: per-token losses summed and divided by the number of
  completion tokens in the whole generation batch: async-rl's ``trainer.loss_agg =
  "token_mean"`` over the step (the other two map to "grpo" and "dr_grpo"; a config
  TRL cannot match, population std or several updates per step, exits 2).
  ``scale_rewards = "group"``: (r - group mean) / (group std + 1e-4) with TRL's
  Bessel-corrected (n - 1) std (``trl.trainer.utils.nanstd``), as async-rl's default
  ``trainer.advantage_std = "sample"`` (eps 1e-6 there: a difference only for groups
  whose std is near 0; "none" maps to "none"). ``beta = 0`` (no KL, no reference model).
  ``epsilon``/``epsilon_high`` = clip_low/clip_high; on-policy with one update per batch
  the ratio is 1, so clipping never bites, the same as async-rl's decoupled loss with
  ``trainer.mini_batches = trainer.epochs = 1`` (r = pi / pi_prox = 1, so neither the
  clip nor the dual-clip bound binds; IS weight pi_theta / pi_vllm ~ 1 at max_staleness
  0). ``importance_sampling_level = "token"``.
- ``mask_truncated_completions = False`` (async-rl trains truncated completions too; the
  reward scores them 0); completion tokens include the EOS token in both.
- order: ``shuffle_dataset = False`` over a dataset of prompt_at(0 .. steps *
  groups_per_step - 1) in a "prompt" column (plain text, no chat template; the byte-level
  tokenizer adds no BOS), with "answer" and "prompt_id" columns for the reward.
- reward: the task's async-rl reward function, wrapped: TRL passes each completion's text
  (decoded without special tokens, as async-rl's rollout does) and the row's "answer".
- ``bf16 = False`` (fp32; ``True`` only if trainer.compute_dtype = "bfloat16", which
  autocasts the trainer's matmuls as Trainer's bf16 does), ``fp16 = False``,
  ``gradient_checkpointing = False``, ``use_cpu = True``,
  ``seed = run.seed``, ``disable_dropout = True`` (the model has none anyway).

Evaluation: async-rl's own evaluator for both, greedy held-out accuracy on the task's
eval prompts (``build_task``) with the task's reward, every ``eval_every`` steps. TRL: a
``TrainerCallback`` calls ``workers.eval.greedy.evaluate_accuracy`` (transformers greedy)
on the live model at step 0, every ``eval_every`` steps and at the last step; it is
stop-the-world and its time is taken OUT of TRL's clock. async-rl: ``run.eval_every``
evaluates beside training (``eval.jsonl``), where the example config's ``run.eval_on``
says: ``idle_cpu`` (both examples) runs that same transformers evaluator on exactly the
version due, in a process of its own at the OS's idle priority, so it takes only CPU
time the workers leave; whatever it still costs training (caches, memory bandwidth)
stays IN async-rl's clock. With ``rollout`` it runs on a rollout engine beside
generation, also IN the clock. async-rl's final model is also scored with the
transformers evaluator in this process (``end acc (HF)``), a cross-check.

Figures, per system: groups/s and tokens/s (completion tokens trained, EOS included, per
second) over the training loop only: model load, engine start-up and warm-up and the
first evaluation are excluded for both (TRL: from ``on_train_begin`` to ``on_train_end``
less its evaluations; async-rl: its summary's training window). Wall time to the target
held-out accuracy: the ``wall_s`` of the first evaluation at or above ``--target``
(default: the config's ``run.target_accuracy``), where an evaluation's ``wall_s`` is the
training-loop time at which the policy it scored was produced; same rule for every
system, so the resolution is ``eval_every`` steps. Accuracy start -> end. Ratios are
async-rl / TRL (above 1 is better for groups/s, tokens/s and accuracy; below 1 is better
for time to target). Timings on a shared 2-core machine are noisy: compare runs made back
to back, as these are.

    python -m bench.races.vs_trl --task arithmetic --steps 60          # the full arithmetic race
    python -m bench.races.vs_trl --task longtail
    python -m bench.races.vs_trl --task arithmetic --steps 4 --eval-every 2 --json

Each run's directory lies under ``--out-dir``/<task>/ (trl, async, sync; TRL's holds its
eval.jsonl and summary.json), with the whole result in result.json beside them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from async_rl.config import Config
from async_rl.config_io import decode_config, load_config
from async_rl.run.inputs import check_inputs
from async_rl.tasks.sources import IndexedSource, PromptSource
from bench.common.quiet_stdout import stdout_to_stderr
from buffers.common.config import ConfigError
from buffers.common.records import Prompt
from workers.rewards.function import RewardFn, guarded_reward

CONFIGS = {"arithmetic": "examples/cpu_default.toml", "longtail": "examples/cpu_longtail.toml"}
TRL_THREADS = 2
"""Torch threads of the TRL run: the two cores async-rl's two workers get, one each."""
OMP_WAIT_POLICY = "PASSIVE"
"""For the TRL run unless OMP_WAIT_POLICY is already set. With the default (spinning)
policy a 2-thread torch process on a shared machine stalls at every parallel region's
barrier whenever its other thread is descheduled: TRL took 4.0 s a step that way against
0.81 s passive (0.68 s on one thread), same machine, same minute, load about 3.6 on 2
cores. async-rl's workers run one thread each and never meet that barrier."""
DEFAULT_EVAL_EVERY = 10
VLLM_NOTE = ("TRL generates with transformers (use_vllm=False): its colocated vLLM mode "
             "fails on the vLLM CPU build at the first weight reload ('Parameter' object "
             "has no attribute 'weight_loader')")


class EvalPoint(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    wall_s: float
    """Training-loop seconds at this evaluation (TRL: its evaluations excluded)."""
    samples: int
    groups: int
    completion_tokens: int
    accuracy: float


class SystemFigures(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    run_dir: str
    max_staleness: int | None
    steps: int
    wall_s: float
    """Training-loop seconds (model load, engine start-up excluded)."""
    eval_s: float
    """TRL: evaluation seconds taken out of wall_s; async-rl: 0 (evaluation runs beside
    training and stays in wall_s)."""
    groups: int
    samples: int
    completion_tokens: int
    groups_per_s: float
    tokens_per_s: float
    """Completion tokens trained per second."""
    accuracy_start: float | None
    accuracy_end: float | None
    accuracy_end_hf: float | None
    """async-rl's final model scored by the transformers evaluator TRL's runs use."""
    time_to_target_s: float | None
    samples_to_target: int | None
    evals: tuple[EvalPoint, ...]


class Ratio(msgspec.Struct, frozen=True, kw_only=True):
    """One async-rl run's figures over TRL's (None where either side is missing)."""

    name: str
    groups_per_s: float | None
    tokens_per_s: float | None
    time_to_target: float | None
    accuracy_end: float | None


class Result(msgspec.Struct, frozen=True, kw_only=True):
    task: str
    config: str
    model: str
    steps: int
    eval_every: int
    target_accuracy: float
    group_size: int
    groups_per_step: int
    max_new_tokens: int
    trl_threads: int
    omp_wait_policy: str
    trl_settings: dict[str, Any]
    systems: tuple[SystemFigures, ...]
    ratios: tuple[Ratio, ...]
    notes: tuple[str, ...]


# ---- shared helpers --------------------------------------------------------------------


def first_at_target(evals: Sequence[EvalPoint], target: float) -> EvalPoint | None:
    """The earliest evaluation (by wall_s) at or above ``target``; the rule of
    ``async_rl.control.evaluation.first_at_target``, applied to every system alike."""
    reached = [e for e in evals if e.accuracy >= target]
    return min(reached, key=lambda e: (e.wall_s, e.step), default=None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _indexed(source: PromptSource) -> IndexedSource:
    """The task's prompt stream as prompt_at(i) (every built-in source has it)."""
    if not isinstance(source, IndexedSource):
        raise TypeError(f"{type(source).__name__} cannot make prompt i directly")
    return source


def prompt_lengths(tokenizer: Any, prompts: Sequence[Prompt]) -> dict[str, int]:
    """Token count of each prompt's text, by prompt id."""
    return {p.prompt_id: len(tokenizer.encode(p.text)) for p in prompts}


def race_config(base: Config, *, steps: int, eval_every: int, target: float, model: str,
                out_dir: Path, name: str, max_staleness: int | None) -> Config:
    """The example config for one async-rl run of the race (re-validated)."""
    raw = msgspec.to_builtins(base)
    raw["model"]["path"] = model
    if max_staleness is not None:
        raw["staleness"]["max_staleness"] = max_staleness
        raw["weights"]["sync_every"] = min(raw["weights"]["sync_every"], max_staleness + 1)
    raw["run"].update(num_steps=steps, output_dir=str(out_dir / name), progress=False,
                      eval_every=eval_every, target_accuracy=target)
    return decode_config(raw)


# ---- TRL ---------------------------------------------------------------------------------


TRL_SCALE_REWARDS = {"sample": "group", "none": "none"}
"""trainer.advantage_std -> GRPOConfig.scale_rewards (TRL has no population std)."""
TRL_LOSS_TYPE = {"token_mean": "dapo", "seq_mean_token_mean": "grpo",
                 "seq_mean_token_sum_norm": "dr_grpo"}
"""trainer.loss_agg -> GRPOConfig.loss_type (TRL's dr_grpo divides by the batch's
sequences times max_completion_length, as seq_mean_token_sum_norm does)."""


def check_trl_mapping(config: Config) -> None:
    """Refuses a trainer config the race cannot give TRL the same loss for."""
    tr = config.trainer
    if tr.advantage_std not in TRL_SCALE_REWARDS:
        raise ConfigError(f"config error: trainer.advantage_std = {tr.advantage_std!r}: "
                          f"the race maps only {', '.join(map(repr, TRL_SCALE_REWARDS))}")
    if (tr.mini_batches, tr.epochs) != (1, 1):
        raise ConfigError(f"config error: trainer.mini_batches = {tr.mini_batches}, "
                          f"trainer.epochs = {tr.epochs}: the race runs one update per step "
                          "on both sides (TRL num_iterations = 1)")


def trl_settings(config: Config, steps: int, out_dir: Path) -> dict[str, Any]:
    """GRPOConfig keyword arguments for the same job (see the module docstring)."""
    check_trl_mapping(config)
    tr, ro = config.trainer, config.rollout
    batch = tr.groups_per_step * ro.group_size
    return dict(
        output_dir=str(out_dir), max_steps=steps, seed=config.run.seed,
        use_vllm=False, use_cpu=True, fp16=False,
        bf16=getattr(tr, "compute_dtype", "float32") == "bfloat16",
        gradient_checkpointing=False,
        num_generations=ro.group_size, per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        max_completion_length=ro.max_new_tokens, temperature=ro.temperature, top_p=1.0,
        top_k=0, min_p=None, repetition_penalty=1.0,
        learning_rate=tr.lr, weight_decay=tr.weight_decay, max_grad_norm=tr.max_grad_norm,
        optim="adamw_torch_fused", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        lr_scheduler_type="constant", warmup_steps=0,
        beta=0.0, loss_type=TRL_LOSS_TYPE[tr.loss_agg],
        scale_rewards=TRL_SCALE_REWARDS[tr.advantage_std], epsilon=tr.clip_low,
        epsilon_high=tr.clip_high, importance_sampling_level="token",
        mask_truncated_completions=False, shuffle_dataset=False, disable_dropout=True,
        remove_unused_columns=False, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )


@contextmanager
def omp_wait_policy(policy: str) -> Iterator[str]:
    """Sets OMP_WAIT_POLICY (unless already set) for the block; yields the one in force.

    OpenMP reads it when torch first loads, so the TRL run must be the first in the
    process to import torch; it is restored afterwards so that Ray workers started later
    inherit the caller's environment.
    """
    saved = os.environ.get("OMP_WAIT_POLICY")
    if saved is None:
        os.environ["OMP_WAIT_POLICY"] = policy
    try:
        yield os.environ["OMP_WAIT_POLICY"]
    finally:
        if saved is None:
            os.environ.pop("OMP_WAIT_POLICY", None)


def run_trl(config: Config, *, steps: int, eval_every: int, target: float,
            out_dir: Path, threads: int = TRL_THREADS) -> tuple[SystemFigures, dict[str, Any]]:
    """TRL's GRPOTrainer on the job; evaluations stop its clock."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from async_rl.tasks.table import build_task
    from workers.eval.greedy import evaluate_accuracy

    torch.set_num_threads(threads)
    source, reward_fn, eval_prompts = build_task(config)
    indexed = _indexed(source)
    ro, tr = config.rollout, config.trainer
    prompts = [indexed.prompt_at(i) for i in range(steps * tr.groups_per_step)]
    dataset = Dataset.from_dict({
        "prompt": [p.text for p in prompts],
        "answer": [p.answer for p in prompts],
        "prompt_id": [p.prompt_id for p in prompts],
    })
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32)
    settings = trl_settings(config, steps, out_dir)
    counts = {"completion_tokens": 0, "samples": 0, "reward_failures": 0}

    def reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
               answer: list[str], prompt_id: list[str], **_: Any) -> list[float | None]:
        counts["completion_tokens"] += sum(len(ids) for ids in completion_ids)
        counts["samples"] += len(completions)
        return [_safe_reward(reward_fn, Prompt(prompt_id=pid, text=text, answer=ans), c, counts)
                for text, c, ans, pid in zip(prompts, completions, answer, prompt_id,
                                              strict=True)]

    reward.__name__ = f"{config.task.kind}_reward"
    evals: list[EvalPoint] = []
    clock = {"start": 0.0, "end": 0.0, "eval_s": 0.0}

    def evaluate(step: int, live: Any) -> None:
        began = time.perf_counter()
        wall = began - clock["start"] - clock["eval_s"] if step else 0.0
        accuracy = evaluate_accuracy(live, tokenizer, eval_prompts, reward_fn,
                                     max_new_tokens=ro.max_new_tokens)
        samples = step * tr.groups_per_step * ro.group_size
        evals.append(EvalPoint(step=step, wall_s=wall, samples=samples,
                               groups=step * tr.groups_per_step,
                               completion_tokens=counts["completion_tokens"],
                               accuracy=accuracy))
        print(f"trl eval accuracy at step {step}: {accuracy:.3f}", file=sys.stderr)
        if step:
            clock["eval_s"] += time.perf_counter() - began

    class StopTheWorldEval(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            torch.set_num_threads(threads)
            evaluate(0, kw["model"])
            clock["start"] = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            step = state.global_step
            if step % eval_every == 0 or step == steps:
                evaluate(step, kw["model"])

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock["end"] = time.perf_counter()

    trainer = GRPOTrainer(
        model=model, reward_funcs=[reward], args=GRPOConfig(**settings),
        train_dataset=dataset, processing_class=tokenizer, callbacks=[StopTheWorldEval()],
    )
    trainer.train()
    if not evals or evals[-1].step != steps:  # on_step_end did not see the last step
        evaluate(steps, trainer.model)
        clock["end"] = clock["end"] or time.perf_counter()
    wall = clock["end"] - clock["start"] - clock["eval_s"]
    groups = steps * tr.groups_per_step
    reached = first_at_target(evals, target)
    figures = SystemFigures(
        name="TRL GRPOTrainer", run_dir=str(out_dir), max_staleness=None, steps=steps,
        wall_s=wall, eval_s=clock["eval_s"], groups=groups, samples=counts["samples"],
        completion_tokens=counts["completion_tokens"],
        groups_per_s=groups / wall if wall else 0.0,
        tokens_per_s=counts["completion_tokens"] / wall if wall else 0.0,
        accuracy_start=evals[0].accuracy if evals else None,
        accuracy_end=evals[-1].accuracy if evals else None, accuracy_end_hf=None,
        time_to_target_s=reached.wall_s if reached else None,
        samples_to_target=reached.samples if reached else None, evals=tuple(evals),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.jsonl").write_bytes(b"".join(msgspec.json.encode(e) + b"\n" for e in evals))
    (out_dir / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(figures)))
    return figures, settings


def _safe_reward(reward_fn: RewardFn, prompt: Prompt, text: str, counts: dict[str, int]) -> float:
    """The task's reward, 0 when it raises or is not finite (as async-rl's rollout
    worker scores)."""
    reward = guarded_reward(reward_fn, prompt, text)
    if reward is None:
        counts["reward_failures"] += 1
    return reward or 0.0


# ---- async-rl ----------------------------------------------------------------------------


def run_async_rl(config: Config, name: str, target: float) -> SystemFigures:
    """One async-rl run (starts and stops its own Ray), read back from its run directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from async_rl.run.run_dir import FINAL_MODEL, read_ledger, read_metrics
    from async_rl.shell.ray_shell import run_training
    from async_rl.tasks.table import build_task
    from workers.eval.greedy import evaluate_accuracy

    run_training(config)
    run_dir = Path(config.run.output_dir)
    summary: dict[str, Any] = msgspec.json.decode((run_dir / "summary.json").read_bytes())
    source, reward_fn, eval_prompts = build_task(config)
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    group_size = config.rollout.group_size

    # Completion tokens per step: the run counts its members' prompt + completion tokens;
    # take the trained prompts' tokens (ledger: "trained" at version step - 1, one
    # reward per member) back out.
    trained = [e for e in read_ledger(run_dir) if e.event == "trained"]
    last = _max_index(e.prompt_id for e in trained)
    stream = [_indexed(source).prompt_at(i) for i in range(last + 1)]
    lengths = prompt_lengths(tokenizer, stream)
    prompt_tokens_at: dict[int, int] = {}
    for entry in trained:
        prompt_tokens_at[entry.version + 1] = (prompt_tokens_at.get(entry.version + 1, 0)
                                               + len(entry.rewards) * lengths[entry.prompt_id])
    completion_by_step: dict[int, int] = {0: 0}
    groups_by_step: dict[int, int] = {0: 0}
    total = groups = 0
    for row in read_metrics(run_dir):
        total += int(row["tokens"]) - prompt_tokens_at.get(int(row["step"]), 0)
        groups += int(row["groups"])
        completion_by_step[int(row["step"])] = total
        groups_by_step[int(row["step"])] = groups

    evals = _async_evals(run_dir, summary, completion_by_step, groups_by_step, group_size)
    wall = float(summary["wall_s"])
    reached = first_at_target(evals, target)
    with torch.no_grad():
        final = AutoModelForCausalLM.from_pretrained(str(run_dir / FINAL_MODEL),
                                                     dtype=torch.float32)
        torch.set_num_threads(TRL_THREADS)
        accuracy_hf = evaluate_accuracy(final, tokenizer, eval_prompts, reward_fn,
                                        max_new_tokens=config.rollout.max_new_tokens)
    return SystemFigures(
        name=name, run_dir=str(run_dir), max_staleness=config.staleness.max_staleness,
        steps=int(summary["steps"]), wall_s=wall, eval_s=0.0,
        groups=int(summary["groups_trained"]),
        samples=int(summary.get("samples_trained") or int(summary["groups_trained"]) * group_size),
        completion_tokens=total, groups_per_s=float(summary["groups_per_s"]),
        tokens_per_s=total / wall if wall else 0.0,
        accuracy_start=summary.get("accuracy_start"), accuracy_end=summary.get("accuracy_end"),
        accuracy_end_hf=accuracy_hf,
        time_to_target_s=reached.wall_s if reached else None,
        samples_to_target=reached.samples if reached else None, evals=tuple(evals),
    )


def _max_index(prompt_ids: Any) -> int:
    return max((int(pid.rsplit("-", 1)[1]) for pid in prompt_ids), default=-1)


def _async_evals(run_dir: Path, summary: dict[str, Any], completion_by_step: dict[int, int],
                 groups_by_step: dict[int, int], group_size: int) -> list[EvalPoint]:
    """eval.jsonl rows as EvalPoints; without the file, the summary's start and end."""
    path = run_dir / "eval.jsonl"
    rows: list[dict[str, Any]] = []
    if path.exists():
        rows = [msgspec.json.decode(line) for line in path.read_bytes().splitlines() if line]
    if not rows:  # no periodic evaluation: the start and end accuracies only
        steps = int(summary["steps"])
        rows = [{"step": s, "accuracy": a, "wall_s": w} for s, a, w in
                ((0, summary.get("accuracy_start"), 0.0),
                 (steps, summary.get("accuracy_end"), float(summary["wall_s"])))
                if a is not None]
    points = []
    for row in rows:
        # A row's training figures are those when the scored version was produced
        # (version = optimizer steps applied), not at the step its evaluation fell due.
        version = int(row.get("version", row["step"]))
        groups = int(row.get("groups_trained", groups_by_step.get(version, 0)))
        points.append(EvalPoint(
            step=int(row["step"]), wall_s=float(row["wall_s"]),
            samples=int(row.get("samples_trained", groups * group_size)), groups=groups,
            completion_tokens=completion_by_step.get(version, 0),
            accuracy=float(row["accuracy"]),
        ))
    return sorted(points, key=lambda p: p.step)


# ---- output ------------------------------------------------------------------------------


def ratios(systems: Sequence[SystemFigures]) -> tuple[Ratio, ...]:
    trl, others = systems[0], systems[1:]
    return tuple(
        Ratio(name=s.name,
              groups_per_s=_ratio(s.groups_per_s, trl.groups_per_s),
              tokens_per_s=_ratio(s.tokens_per_s, trl.tokens_per_s),
              time_to_target=_ratio(s.time_to_target_s, trl.time_to_target_s),
              accuracy_end=_ratio(s.accuracy_end, trl.accuracy_end))
        for s in others
    )


def _f(value: float | None, fmt: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def print_result(result: Result, console: Console) -> None:
    table = Table(title=(
        f"async-rl vs TRL GRPOTrainer: {result.task} ({result.config}, {result.model}), "
        f"{result.steps} steps x {result.groups_per_step} groups x {result.group_size}, "
        f"target {result.target_accuracy:.2f}, eval every {result.eval_every}"))
    for column in ("system", "wall s", "groups/s", "tokens/s", "time to target s",
                   "samples to target", "accuracy start -> end", "end acc (HF)",
                   "x groups/s", "x tokens/s", "x time to target"):
        table.add_column(column, justify="left" if column == "system" else "right")
    by_name = {r.name: r for r in result.ratios}
    for s in result.systems:
        r = by_name.get(s.name)
        table.add_row(
            s.name, f"{s.wall_s:.1f}", f"{s.groups_per_s:.2f}", f"{s.tokens_per_s:.0f}",
            _f(s.time_to_target_s, ".1f", "not reached"),
            "-" if s.samples_to_target is None else str(s.samples_to_target),
            f"{_f(s.accuracy_start, '.3f')} -> {_f(s.accuracy_end, '.3f')}",
            _f(s.accuracy_end_hf, ".3f"),
            _f(r.groups_per_s if r else 1.0) + "x",
            _f(r.tokens_per_s if r else 1.0) + "x",
            (_f(r.time_to_target) + "x" if r and r.time_to_target is not None
             else "1.00x" if r is None and s.time_to_target_s is not None else "-"),
        )
    console.print(table)
    for note in result.notes:
        console.print(f"- {note}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--task", choices=sorted(CONFIGS), default="arithmetic")
    parser.add_argument("--config", help="config file (default: the task's example config)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run "
                        "(default: the config's run.num_steps)")
    parser.add_argument("--model", help="model directory (default: the config's model.path)")
    parser.add_argument("--target", type=float,
                        help="held-out accuracy to time (default: run.target_accuracy)")
    parser.add_argument("--eval-every", type=int, help="steps between evaluations "
                        f"(default: run.eval_every, or {DEFAULT_EVAL_EVERY} when that is 0)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="config override (repeatable)")
    parser.add_argument("--trl-threads", type=int, default=TRL_THREADS,
                        help="torch threads of the TRL run")
    parser.add_argument("--out-dir", default="runs/bench-vs-trl")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)

    config_path = args.config or CONFIGS[args.task]
    with stdout_to_stderr(args.json):
        try:
            model_set = [f"model.path={msgspec.json.encode(args.model).decode()}"] \
                if args.model else []
            # The model resolved (a hub id too) or one line saying how to build it.
            base = check_inputs(load_config(config_path, [*args.overrides, *model_set]))
        except ConfigError as err:
            print(str(err), file=sys.stderr)
            return 2
        if base.task.kind != args.task:
            print(f"{config_path}: task.kind is {base.task.kind!r}, not {args.task!r}",
                  file=sys.stderr)
            return 2
        if not base.task.eval_size:
            print("task.eval_size is 0: the race needs held-out evaluation", file=sys.stderr)
            return 2
        steps = args.steps or base.run.num_steps
        eval_every = args.eval_every or base.run.eval_every or DEFAULT_EVAL_EVERY
        target = args.target if args.target is not None else base.run.target_accuracy
        model = base.model.path
        out = Path(args.out_dir) / args.task
        try:
            common = dict(steps=steps, eval_every=eval_every, target=target, model=model,
                          out_dir=out)
            trl_config = race_config(base, name="trl", max_staleness=None, **common)
            async_config = race_config(base, name="async", max_staleness=None, **common)
            sync_config = race_config(base, name="sync", max_staleness=0, **common)
            check_trl_mapping(base)
        except ConfigError as err:
            print(str(err), file=sys.stderr)
            return 2
        with omp_wait_policy(OMP_WAIT_POLICY) as policy:
            trl, settings = run_trl(trl_config, steps=steps, eval_every=eval_every,
                                    target=target, out_dir=out / "trl", threads=args.trl_threads)
        eta = async_config.staleness.max_staleness
        systems = (
            trl,
            run_async_rl(async_config, f"async-rl (max_staleness={eta})", target),
            run_async_rl(sync_config, "async-rl sync (max_staleness=0)", target),
        )
        ro, tr = base.rollout, base.trainer
        result = Result(
            task=args.task, config=config_path, model=model, steps=steps,
            eval_every=eval_every, target_accuracy=target, group_size=ro.group_size,
            groups_per_step=tr.groups_per_step, max_new_tokens=ro.max_new_tokens,
            trl_threads=args.trl_threads, omp_wait_policy=policy, trl_settings=settings,
            systems=systems, ratios=ratios(systems),
            notes=(
                VLLM_NOTE,
                f"TRL: {'bf16 autocast' if settings['bf16'] else 'fp32'}, "
                f"{args.trl_threads} torch threads (OMP_WAIT_POLICY={policy}) for "
                "generation and training; "
                "async-rl: one vLLM rollout worker and one trainer shard, one core each",
                "throughput over the training loop only (model load, engine start-up and "
                "the first evaluation excluded); TRL's evaluations stop its clock and are "
                "taken out, async-rl evaluates beside training and keeps that time in",
                "ratios are async-rl / TRL; time to target = wall s at the first "
                f"evaluation >= {target:.2f} (resolution: {eval_every} steps)",
                "end acc (HF): async-rl's final model scored by the transformers "
                "evaluator that scores TRL",
            ),
        )
    (out / "result.json").write_bytes(msgspec.json.format(msgspec.json.encode(result)))
    if args.json:
        print(msgspec.json.encode(result).decode())
    else:
        console = Console()
        print_result(result, console if console.is_terminal else Console(width=200))
    return 0


if __name__ == "__main__":
    sys.exit(main())
