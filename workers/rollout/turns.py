"""Multi-turn trajectories: the turns between a rollout engine and an environment.

Owns: ``TurnRunner``, which plays a prompt's group of trajectories side by side, one
environment instance each (``workers.rollout.environment``): ``reset`` gives the first prompt,
then turn after turn the engine generates (until a stop string of task.environment.stop,
kept in the text, EOS, or rollout.max_new_tokens), ``step`` answers, and the
observation's tokens are appended (``workers.rollout.prompts.observation_ids``: with the
chat template on, as a tool turn), until the step says done, max_turns or
max_trajectory_tokens. A first prompt with no room for a turn is refused (outcome
"too_long", the trajectory excluded from its group as "env_too_long"). Each generation
continues on the whole context as token ids (with rollout.prefix_caching the engine
reuses its KV). The policy's tokens keep their behaviour logprobs and the version that
produced each (exact across weight updates between turns or inside one); observation
tokens get loss mask 0, logprob 0 and ``NO_VERSION``. Every environment call runs on an
event loop of its own (``workers.common.loop_thread``), never the engine's, bounded by
task.environment.turn_timeout_s: a call past it ends its trajectory (outcome "timeout"),
one that raises or returns no ``EnvStep`` ends it likewise (outcome "error"); with
on_timeout / on_error = "exclude" (the default) that trajectory is no member of its
group (``Sample.excluded``), with "train" it scores 0 (its environment reward here, the
task's own rewards in ``workers.rollout.scoring``, which never call them on it); a
failed reset gave no prompt and is never a member. The group's other trajectories go
on. Knows nothing about vLLM (the worker hands in how to run one request), rewards of
task.rewards (``workers.rollout.scoring``), queues or training.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec

from buffers.common.records import NO_VERSION, Prompt, Sample
from workers.common.loop_thread import LoopThread
from workers.rollout.environment import Environment, EnvironmentConfig, EnvStep, environment_class
from workers.rollout.prompts import PromptFormat, observation_ids, render
from workers.rollout.stop_strings import cut_at_stop

log = logging.getLogger("async_rl.environments")

Stream = Callable[[list[int], Any], Awaitable[Sample]]
"""Runs one engine request (the context's token ids, the sampling parameters) and returns
its unscored sample: how ``TurnRunner`` generates a turn."""
DONE, MAX_TURNS, MAX_TOKENS, TIMEOUT, ERROR, TOO_LONG = (
    "done", "max_turns", "max_tokens", "timeout", "error", "too_long")
"""How a trajectory ended (``Sample.env_outcome``)."""
EXCLUDED = {TIMEOUT: "env_timeout", ERROR: "env_error", TOO_LONG: "env_too_long"}
"""Why a trajectory that ended so is no group member (``Sample.excluded``)."""
_LOGGED = 3  # environment failures logged at WARNING; the rest at DEBUG
_SEED_RANGE = 2**63


def environment_row(prompt: Prompt) -> dict[str, Any]:
    """What ``reset`` gets: the row's dataset columns, ``prompt`` (its text, or its chat
    messages) and ``answer``."""
    first: Any = [dict(m) for m in prompt.messages] if prompt.messages else prompt.text
    return {"answer": prompt.answer, **prompt.columns, "prompt": first}


class TurnRunner:
    """Plays groups of trajectories with the class ``config`` names; see the module
    docstring. Made in the rollout worker's process (it imports the class there)."""

    def __init__(self, config: EnvironmentConfig, tokenizer: Any, fmt: PromptFormat,
                 max_new_tokens: int, make_environment: Callable[[], Any] | None = None
                 ) -> None:
        self.config = config
        # A task's own maker (its environments built with arguments, such as the
        # calculator's tool latency) or the class the config names, called bare.
        self._cls = make_environment or environment_class(config)
        self._tokenizer, self._format, self._max_new_tokens = tokenizer, fmt, max_new_tokens
        self._loop = LoopThread("async-rl-environments")
        self._failures = 0

    def close(self) -> None:
        """Stops the environments' loop (calls still running are cancelled)."""
        self._loop.close()

    async def group(self, prompt: Prompt, size: int, stream: Stream, params: Any,
                    seeds: Sequence[int] = ()) -> tuple[list[int], list[Sample]]:
        """``size`` trajectories of ``prompt``, side by side: (the prompt's token ids,
        the unscored samples, each with its environment reward and outcome).

        ``params``: the engine's sampling parameters, copied per turn with its stop
        strings and token budget; ``seeds``: one per trajectory (rollout.sampling_seed),
        each turn's seed made from it. An engine error fails the whole call.
        """
        row = environment_row(prompt)
        resets = await asyncio.gather(*(self._reset(row) for _ in range(size)))
        started = [ids for _, ids in resets if isinstance(ids, list)]
        prompt_ids = started[0] if started else self._ids(prompt)
        outcomes: list[str] = []  # per trajectory: "" (played) or why it never started
        for _, ids in resets:
            if isinstance(ids, list) and ids != prompt_ids:
                ids = self._failed(ERROR, "reset gave another prompt than its group's first")
            elif isinstance(ids, list) and len(ids) >= self.config.max_trajectory_tokens:
                ids = self._refused(len(ids))
            outcomes.append(ids if isinstance(ids, str) else "")
        try:
            async with asyncio.TaskGroup() as tasks:
                running = {k: tasks.create_task(self._play(env, prompt_ids, stream, params,
                                                           seeds[k] if seeds else None))
                           for k, (env, _) in enumerate(resets)
                           if env is not None and not outcomes[k]}
        except ExceptionGroup as group:
            raise group.exceptions[0] from group  # the engine failed: the others cancelled
        return prompt_ids, [running[k].result() if k in running else _empty(outcomes[k])
                            for k in range(size)]

    # ---- one trajectory ---------------------------------------------------------------

    async def _reset(self, row: dict[str, Any]) -> tuple[Environment | None, list[int] | str]:
        """A fresh environment and its first prompt's ids; (None, outcome) on a failure."""

        async def start() -> tuple[Environment, Any]:
            env = self._cls()
            return env, await env.reset(dict(row))

        try:
            env, first = await self._loop.run(start(), self.config.turn_timeout_s)
            if isinstance(first, str):
                return env, self._ids(Prompt(prompt_id="", text=first, answer=""))
            if not self._format.chat_template:
                raise TypeError("reset returned chat messages: set task.chat_template = true")
            messages = tuple({str(k): str(v) for k, v in m.items()} for m in first)
            return env, self._ids(Prompt(prompt_id="", text="", answer="", messages=messages))
        except TimeoutError:
            return None, self._failed(TIMEOUT, f"reset ran past {self.config.turn_timeout_s} s")
        except Exception as err:
            return None, self._failed(ERROR, f"reset raised {type(err).__name__}: {err}")

    def _ids(self, prompt: Prompt) -> list[int]:
        rendered = render(self._tokenizer, prompt, self._format)
        if isinstance(rendered, str):
            return [int(i) for i in self._tokenizer.encode(rendered)]  # as the engine would
        return rendered

    async def _play(self, env: Environment, prompt_ids: list[int], stream: Stream,
                    params: Any, seed: int | None) -> Sample:
        cfg = self.config
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        mask: list[int] = []
        reward, outcome, finish, longest = 0.0, MAX_TURNS, "stop", 0
        messages: list[dict[str, str]] = []  # the parts, as TRL-style rewards get them
        for turn in range(cfg.max_turns):
            room = cfg.max_trajectory_tokens - len(prompt_ids) - len(tokens)
            if room <= 0:
                outcome = MAX_TOKENS
                break
            turn_params = params.clone()
            turn_params.max_tokens = min(room, self._max_new_tokens)
            # vLLM matches stop strings on the detokenised text.
            turn_params.stop, turn_params.detokenize = list(cfg.stop), True
            turn_params.include_stop_str_in_output = True
            if seed is not None:
                turn_params.seed = (seed + turn) % _SEED_RANGE
            out = await stream([*prompt_ids, *tokens], turn_params)
            # vLLM cuts a stop string's text, not its tokens: the turn ends at the token
            # completing the stop string, and step() gets text ending right at it.
            cut = cut_at_stop(out.token_ids, out.logprobs, out.versions, self._tokenizer,
                              cfg.stop)
            tokens += cut.token_ids
            logprobs += cut.logprobs
            versions += cut.versions
            mask += [1] * len(cut.token_ids)
            longest = max(longest, len(cut.token_ids))
            messages.append({"role": "assistant", "content": cut.text})
            # A turn cut at its token budget makes the trajectory's finish "length" (what
            # trainer.overlong masks), whichever turn it was.
            finish = "length" if "length" in (finish, out.finish_reason) else out.finish_reason
            try:
                step = await self._loop.run(_checked_step(env, cut.text), cfg.turn_timeout_s)
            except TimeoutError:
                reward, outcome = 0.0, self._failed(
                    TIMEOUT, f"step ran past {cfg.turn_timeout_s} s")
                break
            except Exception as err:
                reward, outcome = 0.0, self._failed(
                    ERROR, f"step raised {type(err).__name__}: {err}")
                break
            reward += step.reward
            if step.done:
                outcome = DONE
                break
            if turn == cfg.max_turns - 1 or not step.observation:
                continue  # no observation, or no turn left to read it
            eos = getattr(self._tokenizer, "eos_token_id", None)
            observed = observation_ids(self._tokenizer, step.observation, self._format,
                                       after_eos=bool(cut.token_ids) and cut.token_ids[-1] == eos)
            if len(prompt_ids) + len(tokens) + len(observed) >= cfg.max_trajectory_tokens:
                outcome = MAX_TOKENS  # no room left to answer it
                break
            tokens += observed
            messages.append({"role": "tool", "content": step.observation})
            logprobs += [0.0] * len(observed)
            versions += [NO_VERSION] * len(observed)
            mask += [0] * len(observed)
        policy = {TIMEOUT: cfg.on_timeout, ERROR: cfg.on_error}.get(outcome, "")
        return Sample(token_ids=tuple(tokens), logprobs=tuple(logprobs),
                      versions=tuple(versions), finish_reason=finish,
                      text=str(self._tokenizer.decode(tokens, skip_special_tokens=True)),
                      reward=reward, loss_mask=tuple(mask), env_outcome=outcome,
                      excluded=EXCLUDED[outcome] if policy == "exclude" else "",
                      longest_turn=longest, messages=tuple(messages))

    def _failed(self, outcome: str, why: str) -> str:
        policy = self.config.on_timeout if outcome == TIMEOUT else self.config.on_error
        ends = "with reward 0" if policy == "train" else f"(on_{outcome} = {policy!r})"
        self._log(f"{why}; its trajectory ends {ends}")
        return outcome

    def _refused(self, length: int) -> str:
        self._log(f"reset gave a prompt of {length} tokens, no room for a turn within "
                  f"task.environment.max_trajectory_tokens = "
                  f"{self.config.max_trajectory_tokens}; the trajectory is refused")
        return TOO_LONG

    def _log(self, message: str) -> None:
        self._failures += 1
        level = logging.WARNING if self._failures <= _LOGGED else logging.DEBUG
        more = " (further ones are logged at DEBUG)" if self._failures == _LOGGED else ""
        log.log(level, "environment %s: %s%s", self.config.class_, message, more)


async def _checked_step(env: Environment, completion: str) -> EnvStep:
    """``env.step(completion)``, which must return an ``EnvStep`` with a finite reward."""
    step = await env.step(completion)
    if not isinstance(step, EnvStep):
        raise TypeError(f"step returned {type(step).__name__}, not async_rl.EnvStep")
    if not math.isfinite(float(step.reward)):
        raise ValueError(f"step returned a reward of {step.reward}")
    return msgspec.structs.replace(step, reward=float(step.reward))


def _empty(outcome: str) -> Sample:
    """A trajectory that never started (its reset failed, or its prompt was too long):
    no tokens, no group member."""
    return Sample(token_ids=(), logprobs=(), versions=(), finish_reason="abort", text="",
                  env_outcome=outcome, excluded=EXCLUDED[outcome])
