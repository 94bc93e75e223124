"""Benchmark: which stage is slower, per model size, on one core each (why the CPU default
uses ``SMALL``).

For every ``async_rl.models.tiny_model.MODEL_SIZES`` entry (weights as initialised: the shape is
what costs, not what was learned) it times, on one core:

- train: one forward + backward + AdamW step over 128 sequences of 11 tokens (a CPU
  default step is 16 groups x 8 samples of about that length), torch on one thread;
- generate: vLLM's CPU build (offline ``LLM``, eager, float32, behaviour logprobs on as
  in a run) producing 16 prompts x 8 samples x 4 tokens.

and prints generate / train. Below 1 the trainer is the bottleneck and asynchrony can keep
it busy; above 1 rollout is, and only more rollout workers help.

    python bench/model_size.py [--json]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import msgspec
from quiet_stdout import stdout_to_stderr

REPEATS = 5


class SizeFigures(msgspec.Struct, frozen=True, kw_only=True):
    size: str
    parameters: int
    train_ms: float
    generate_ms: float
    generate_over_train: float


def time_train(model_dir: Path) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(3, 200, (128, 11), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        logp = model(input_ids=ids, use_cache=False).logits.log_softmax(-1)
        loss = -logp.gather(-1, ids[..., None]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()  # first-call allocations are not what a run pays per step
    began = time.perf_counter()
    for _ in range(REPEATS):
        step()
    return (time.perf_counter() - began) / REPEATS * 1e3


def time_generate(model_dir: Path) -> float:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True,
              gpu_memory_utilization=0.1, max_model_len=128, enable_prefix_caching=False)
    params = SamplingParams(n=8, max_tokens=4, min_tokens=4, ignore_eos=True,
                            temperature=1.0, logprobs=0, detokenize=False)
    prompts = [f"{i}+{(7 * i) % 30}=" for i in range(16)]
    llm.generate(prompts, params, use_tqdm=False)  # warm, as a worker's start() does
    began = time.perf_counter()
    for _ in range(REPEATS):
        llm.generate(prompts, params, use_tqdm=False)
    elapsed = (time.perf_counter() - began) / REPEATS * 1e3
    # Now, not at interpreter exit: its shutdown logs must not follow the JSON object.
    llm.llm_engine.engine_core.shutdown()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()

    import torch
    from transformers import Qwen2ForCausalLM

    from async_rl.models.tiny_model import MODEL_SIZES, build_tokenizer, size_config

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    rows = []
    # vLLM's engine processes log to stdout: keep it for the JSON object.
    with stdout_to_stderr(args.json), \
            tempfile.TemporaryDirectory(prefix="async-rl-bench-") as root:
        for size in MODEL_SIZES.values():
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(size_config(size))
            path = Path(root) / size.name
            model.save_pretrained(path)
            build_tokenizer().save_pretrained(path)
            train_ms, generate_ms = time_train(path), time_generate(path)
            rows.append(SizeFigures(
                size=size.name, parameters=sum(p.numel() for p in model.parameters()),
                train_ms=train_ms, generate_ms=generate_ms,
                generate_over_train=generate_ms / train_ms))
    if args.json:
        print(msgspec.json.encode({"sizes": rows}).decode())
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="one core per stage: train 128 x 11 tokens vs generate 16 x 8 x 4")
    for column in ("size", "parameters", "train ms", "generate ms", "generate / train"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r.size, f"{r.parameters / 1e6:.2f}M", f"{r.train_ms:.0f}",
                      f"{r.generate_ms:.0f}", f"{r.generate_over_train:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
