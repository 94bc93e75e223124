"""Your own job from a script: a dataset file, a TRL-style reward, the Python API.

Writes a small Parquet file of arithmetic questions with its own column names
(``question``, ``answer``), then runs async GRPO on it with the CPU default's settings
and a reward written as for TRL's GRPOTrainer.

    async-rl make-model --size small --out runs/small-model   # once (or: make demo)
    python examples/own_reward.py [--steps 20] [--chat-template]
    python examples/own_reward.py --data-only   # then: async-rl train examples/own_dataset.toml

``--chat-template`` renders the prompts with the tokenizer's chat template (the reward
then gets completions as message lists, as TRL passes them). The small local model was
warm-started on raw prompts, so it starts from a lower accuracy with the template.

The ``if __name__ == "__main__":`` guard is required: sync rewards run in a pool of
processes, which import this file again.
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

import datasets

import async_rl

DATA = Path("runs/own-reward-data/train.parquet")


def correctness(prompts: list[object], completions: list[object], answer: list[str],
                **kwargs: object) -> list[float]:
    """TRL style: one call per group; completions are text, or message lists with chat
    templates on (``[{"role": "assistant", "content": ...}]``), as TRL passes them."""
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion[0]["content"] if isinstance(completion, list) else str(completion)
        found = re.match(r"\s*(-?\d+)", text)
        scores.append(1.0 if found and found.group(1) == expected else 0.0)
    return scores


def write_dataset(path: Path, rows: int = 2000, seed: int = 0) -> Path:
    """Questions such as ``"What is 12+7?"`` with the answer as text."""
    rng = random.Random(seed)
    questions, answers = [], []
    for _ in range(rows):
        a, b = rng.randint(0, 29), rng.randint(0, 29)
        if rng.random() < 0.5:
            questions.append(f"{a}+{b}=")
            answers.append(str(a + b))
        else:
            a, b = max(a, b), min(a, b)
            questions.append(f"{a}-{b}=")
            answers.append(str(a - b))
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict({"question": questions, "answer": answers}).to_parquet(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="runs/own-reward")
    parser.add_argument("--chat-template", action="store_true")
    parser.add_argument("--model", default="runs/small-model", help="directory or hub id")
    parser.add_argument("--data-only", action="store_true",
                        help="write the Parquet file (for examples/own_dataset.toml) and stop")
    args = parser.parse_args()
    data = write_dataset(DATA)
    if args.data_only:
        print(f"wrote {data}")
        return
    config = async_rl.load_config("examples/cpu_default.toml", overrides={
        "task.kind": "dataset", "task.path": str(data), "task.prompt_key": "question",
        "task.answer_key": "answer", "task.eval_fraction": 0.05, "task.eval_size": 64,
        "task.chat_template": args.chat_template, "model.path": args.model,
        "run.num_steps": args.steps, "run.eval_every": 0, "run.output_dir": args.out,
    })
    summary = async_rl.train(config, rewards=[correctness], overwrite=True)
    print(f"{summary.steps} steps, {summary.groups_per_s:.1f} groups/s, held-out accuracy "
          f"{summary.accuracy_start} -> {summary.accuracy_end}; run directory: {args.out}")


if __name__ == "__main__":
    main()
