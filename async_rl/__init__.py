"""async-rl: asynchronous, pipelined, off-policy GRPO post-training for LLMs.

The Python API (``async_rl.api``)::

    import async_rl

    if __name__ == "__main__":   # rewards run in process pools
        config = async_rl.load_config("examples/cpu_default.toml",
                                      overrides={"run.num_steps": 3})
        summary = async_rl.train(config, rewards=[my_reward])

``load_config`` and ``train`` are those of ``async_rl.api``; ``Reward`` gives a reward
callable its weight, metric name or style; ``Config``, ``ConfigError`` and
``RunSummary`` are what they take, raise and return; ``EnvStep`` is what a multi-turn
environment's ``step`` returns, and ``Environment`` the protocol it implements
(docs/environments.md); ``AgentResult`` is what an agent's ``solve`` may return
(docs/agents.md). Each is imported on first use:
``import async_rl`` loads none of Ray, torch or vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from async_rl.api import load_config, train
    from async_rl.config import Config
    from async_rl.run.summary import RunSummary
    from buffers.common.config import ConfigError
    from workers.rewards.callables import Reward
    from workers.rollout.agents import AgentResult
    from workers.rollout.environment import Environment, EnvStep

__version__ = "0.1.0"
__all__ = ["AgentResult", "Config", "ConfigError", "EnvStep", "Environment", "Reward", "RunSummary",
           "load_config", "train"]

_HOMES = {"load_config": "async_rl.api", "train": "async_rl.api", "Config": "async_rl.config",
          "ConfigError": "buffers.common.config", "Reward": "workers.rewards.callables",
          "EnvStep": "workers.rollout.environment", "Environment": "workers.rollout.environment",
          "RunSummary": "async_rl.run.summary", "AgentResult": "workers.rollout.agents"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'async_rl' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
