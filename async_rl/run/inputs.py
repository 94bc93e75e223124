"""A run's inputs checked before anything starts: what would otherwise fail in a worker.

Owns: ``check_inputs`` (the model directory is a Hugging Face model, the prompt file
reads, the task's own reward functions import and can take a completion, the optional
loggers are installed), raising ``ConfigError`` with one line. Used
by ``async-rl train`` and by each trial of ``async-rl sweep`` before it is launched.
"""

from __future__ import annotations

import json
from pathlib import Path

from async_rl.config import Config
from async_rl.run.loggers import check_installed
from buffers.config import ConfigError
from workers.reward_spec import load_reward


def check_inputs(config: Config) -> None:
    """Fails fast, in one line, on inputs that would otherwise fail inside a worker."""
    check_installed(config.run.loggers)
    model = Path(config.model.path)
    if not (model / "config.json").is_file():
        raise ConfigError(
            f"config error: model.path = {config.model.path!r}: no model there "
            f"(build one with: async-rl make-model --out {config.model.path})"
        )
    try:
        model_type = json.loads((model / "config.json").read_text()).get("model_type")
    except (ValueError, AttributeError):
        model_type = None
    if not model_type:
        raise ConfigError(
            f"config error: model.path = {config.model.path!r}: its config.json is not a "
            f"Hugging Face model config (no model_type)"
        )
    for index, spec in enumerate(config.task.rewards):
        load_reward(spec, index=index)  # ConfigError naming task.rewards[i]
    if config.task.kind == "jsonl":
        from async_rl.tasks.sources import PromptFileError, read_prompt_file

        if not Path(config.task.jsonl_path).is_file():
            raise ConfigError(
                f"config error: task.jsonl_path = {config.task.jsonl_path!r}: file not found"
            )
        try:
            read_prompt_file(config.task.jsonl_path)
        except PromptFileError as err:
            raise ConfigError(f"prompt file error: {err}") from None
