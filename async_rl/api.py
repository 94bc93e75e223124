"""The Python API: a run's config from a file, and the run itself, from a script.

Owns: ``load_config`` (a TOML file and overrides, as ``async-rl train --set`` reads
them), ``train`` (the job ``async-rl train`` runs: inputs checked, the run directory
made, the workers started; with reward callables besides ``task.rewards``), ``simulate``
(the same job on simulated workers, ``async-rl simulate``) and the
forms a reward callable may be given in (``RewardArg``). ``async-rl train`` is a thin
layer over these. Importing this module is light: Ray, torch and vLLM load when
``train`` starts a run.

Example (``my_job.py``)::

    import async_rl

    def correctness(prompts, completions, answer, **kwargs):   # TRL style
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    async def short(prompt, completion):                       # sample style, async
        return 1.0 if len(completion) < 40 else 0.0

    if __name__ == "__main__":   # needed: rewards run in process pools
        config = async_rl.load_config("examples/cpu_default.toml",
                                      overrides={"run.num_steps": 3})
        summary = async_rl.train(config, rewards=[correctness, (short, 0.2)])
        # summary.accuracy_start, summary.accuracy_end: held-out accuracy before, after
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from async_rl.config import Config
from async_rl.config_io import Overrides
from async_rl.config_io import load_config as _load_config
from async_rl.run.inputs import check_inputs
from async_rl.run.run_dir import CONFIG
from async_rl.run.summary import RunSummary
from buffers.common.config import ConfigError
from workers.rewards.callables import Reward

RewardArg = Reward | Callable[..., Any] | tuple[Callable[..., Any], float]
"""A reward as ``train`` takes it: a callable (weight 1, its own name, its style guessed
from its parameters), a ``(callable, weight)`` pair, or a ``Reward`` (weight, name and
style given)."""


def load_config(path: str | Path, overrides: Overrides | None = None) -> Config:
    """The run config in the TOML file ``path``, with ``overrides`` applied and all of it
    validated as ``async-rl train`` does.

    ``overrides``: ``{"section.key": value}`` with Python values (``{"run.num_steps": 3,
    "model.path": "Qwen/Qwen2.5-0.5B-Instruct"}``), or ``--set`` items
    (``["run.num_steps=3"]``, TOML values). An unknown key or a bad value raises
    ``ConfigError`` with one line naming the key.
    """
    return _load_config(path, overrides)


def as_rewards(rewards: RewardArg | Iterable[RewardArg]) -> tuple[Reward, ...]:
    """``rewards`` (a list of them, or a single callable or ``Reward``) as ``Reward``
    records; ``ConfigError`` naming ``rewards[i]`` for anything else."""
    items: Any = [rewards] if isinstance(rewards, Reward) or callable(rewards) else rewards
    if not isinstance(items, Iterable) or isinstance(items, str | bytes):
        raise ConfigError(f"config error: rewards = {rewards!r}: expected a list of "
                          "callables, (callable, weight) pairs or async_rl.Reward records")
    out = []
    for index, item in enumerate(items):
        if isinstance(item, Reward):
            out.append(item)
        elif isinstance(item, tuple) and len(item) == 2 and callable(item[0]) \
                and isinstance(item[1], int | float) and not isinstance(item[1], bool):
            out.append(Reward(fn=item[0], weight=float(item[1])))
        elif callable(item):
            out.append(Reward(fn=item))
        else:
            raise ConfigError(f"config error: rewards[{index}] = {item!r}: expected a "
                              "callable, a (callable, weight) pair or an async_rl.Reward")
    return tuple(out)


def _new_run_dir(config: Config, overwrite: bool) -> None:
    """A new run's directory: refuses to mix with an earlier run's unless told to."""
    out = Path(config.run.output_dir)
    if (out / CONFIG).exists() and not overwrite:
        raise ConfigError(
            f"run.output_dir = {str(out)!r} already holds a run: continue it with "
            f"--resume {out} (resume=True), replace it with --overwrite (overwrite=True), "
            "or choose another directory")
    if overwrite and out.exists():
        shutil.rmtree(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"config error: run.output_dir = {str(out)!r}: cannot create it "
                          f"({err.strerror})") from None


def train(config: Config, rewards: RewardArg | Iterable[RewardArg] = (), *,
          overwrite: bool = False, resume: bool = False, verbose: bool = False
          ) -> RunSummary:
    """Runs async GRPO as ``async-rl train`` does and returns the run's summary (also in
    RUN_DIR/summary.json).

    ``rewards``: reward functions, scored besides the config's ``task.rewards`` and,
    like them, replacing the task's built-in reward in training and evaluation. Each
    is a callable, a ``(callable, weight)`` pair or an ``async_rl.Reward``; sync or
    ``async def``; in TRL, verl or sample style, recognised by its parameters as for
    ``task.rewards`` (docs/rewards.md). Each one's mean is logged per step as
    ``reward/<name>``. They are pickled to the workers (by value when they are your
    own code); sync ones run in process pools, so the script that calls ``train``
    needs an ``if __name__ == "__main__":`` guard.

    ``overwrite``: replace an existing run in ``run.output_dir`` (else that is a
    ``ConfigError``); ``resume``: continue it from its newest good checkpoint (load its
    config with ``load_config(RUN_DIR / "config.toml")``); ``verbose``: every line the
    workers print on the console, not only their warnings and errors.

    Everything is checked before Ray starts (``ConfigError``, one line naming the key):
    the model (``model.path``: a local directory or a hub id in the hub cache), the
    prompt file, each reward. Raises ``CheckpointError`` when ``resume`` finds no
    checkpoint, ``RunFailed`` when the run fails, ``RunInterrupted`` when a second
    Ctrl-C stops it at once; after one Ctrl-C the run stops cleanly after its current
    step and the summary says so (``summary.stopped``).
    """
    if overwrite and resume:
        raise ConfigError("usage error: resume and overwrite exclude each other")
    if config.run.colocate == "time":
        raise ConfigError('config error: run.colocate = "time": only async-rl simulate '
                          "models time-shared devices; a real run colocates with true "
                          "(both roles at once) or not at all (docs/simulator.md)")
    checked = as_rewards(rewards)
    config = check_inputs(config, checked)
    if not resume:
        _new_run_dir(config, overwrite)
    from async_rl.shell.ray_shell import run_training

    return run_training(config, resume=resume, verbose=verbose, rewards=checked)


def simulate(config: Config, *, overwrite: bool = False) -> RunSummary:
    """Simulates the run ``config`` describes, as ``async-rl simulate`` does: the real
    orchestrator with simulated workers on a virtual clock, costed by the hardware file
    of ``simulate.hardware`` (docs/simulator.md). Writes a run directory in
    ``run.output_dir`` (marked simulated in run.json) and returns its summary; a model
    that is not there is fine when ``simulate.parameters`` and
    ``simulate.kv_bytes_per_token`` give its size. Light: no Ray, torch or vLLM."""
    _new_run_dir(config, overwrite)
    from async_rl.sim.run import simulate as simulate_run

    return simulate_run(config)
