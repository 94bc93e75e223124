"""A run's inputs checked before anything starts: what would otherwise fail in a worker.

Owns: ``check_inputs`` (the model is a Hugging Face model, in a local directory or the
hub cache: ``async_rl.run.model_source``; the prompt file reads; the task's own reward
functions, named in task.rewards or passed as callables, import and can take a
completion; the optional loggers are installed), raising ``ConfigError`` with one line.
Used by ``async_rl.train`` (so ``async-rl train``) and by each trial of ``async-rl
sweep`` before it is launched.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

from async_rl.config import Config
from async_rl.run.loggers import check_installed
from async_rl.run.model_source import resolve_model_path
from buffers.config import ConfigError
from workers.reward_callable import Reward, check_function
from workers.reward_spec import load_reward


def check_inputs(config: Config, rewards: Sequence[Reward] = ()) -> Config:
    """Fails fast, in one line, on inputs that would otherwise fail inside a worker.

    Returns ``config`` with ``model.path`` resolved to the local directory the workers
    load (a hub id's snapshot in the hub cache); ``rewards``: the callables a script
    passes besides ``task.rewards`` (``async_rl.train``).
    """
    check_installed(config.run.loggers)
    path = resolve_model_path(config.model.path, task_kind=config.task.kind)
    config = msgspec.structs.replace(
        config, model=msgspec.structs.replace(config.model, path=path))
    for index, spec in enumerate(config.task.rewards):
        load_reward(spec, index=index)  # ConfigError naming task.rewards[i]
    for index, reward in enumerate(rewards):
        check_function(reward, index=index)  # ConfigError naming rewards[i]
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
    return config
