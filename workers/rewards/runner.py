"""Running a task's reward functions off the caller's event loop: bounded, summed, counted.

Owns: ``RewardRunner`` (scores a group with every reward and sums them by weight),
``GroupRewards`` (what it reports) and ``UserRewards`` (a task's rewards as sent to an
actor, which builds its runner from them). Sync rewards run in a ``pebble.ProcessPool``
whose workers load the rewards once when they start (specs by the same file path or module;
callables passed directly travel pickled, by value with cloudpickle where it is
installed), or, with ``threads=True``, in a thread pool. ``async def`` rewards run on an
event loop of their own, in its own thread (``workers.common.loop_thread``). Every call is
bounded by ``timeout_s``: a call that raises, returns the wrong shape or a non-finite
score, or times out scores 0 for the samples it covers (one for per-sample styles, the
group for TRL) and is counted, per sample, in ``errors`` or ``timeouts``; the other
samples' calls go on. A timed-out process is killed and replaced (pebble); a timed-out
thread cannot be killed and runs on in its pool, and once every thread is stuck so,
calls are refused at once and counted (``saturated``; ``workers.rewards.threads``). The
processes start by forkserver (spawn where there is none; never fork, as the caller has
threads), so, as with any multiprocessing, a script that makes a runner
needs an ``if __name__ == "__main__":`` guard. How one call binds its arguments is
``workers.rewards.calls``'; the guarded call and the workers' side ``workers.rewards.guard``';
loading and naming the rewards it is given, ``workers.rewards.loading``'.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pebble

from workers.common.loop_thread import LoopThread
from workers.common.user_code import loaded_user_files
from workers.rewards import guard as reward_guard
from workers.rewards.callables import Reward, dumps
from workers.rewards.calls import Message, RewardValues, chat_messages, is_async_reward
from workers.rewards.guard import (
    CallFailed,
    child_init,
    child_score,
    describe,
    guarded,
    guarded_async,
)
from workers.rewards.loading import RewardLike, final_names, load_rewards
from workers.rewards.spec import DEFAULT_COLUMNS, RewardSpec, Style, reward_name
from workers.rewards.threads import PoolSaturated, RewardThreads

log = logging.getLogger("async_rl.rewards")

_GRACE_S = 1.0  # an async reward that blocks its event loop is given up this much later
_LOGGED_FAILURES = 3  # per reward, at WARNING; the rest at DEBUG


class GroupRewards(msgspec.Struct, frozen=True, kw_only=True):
    """Every reward's verdict on one group."""

    total: tuple[float, ...]
    """Per sample: the weighted sum of the rewards (a failed one counts 0)."""
    scores: dict[str, tuple[float | None, ...]]
    """Per reward name, and per ``<reward name>/<key>`` extra metric of a verl-style
    reward: each sample's value, unweighted; None where its score was lost or it gave
    no such metric (a lost score is no 0: it stays out of reward/<name>)."""
    errors: int = 0
    """Scores lost to a call that raised, returned the wrong shape or a non-finite score
    (per sample and reward: a failed TRL call loses the whole group's)."""
    timeouts: int = 0
    """Scores lost to a call that ran past the timeout (counted the same way)."""
    failed: tuple[bool, ...] = ()
    """Per sample: some reward's score of it was lost (an error or a timeout)."""
    saturated: int = 0
    """Of ``timeouts``, the scores whose call was refused at once because every reward
    thread was stuck in an earlier call past its deadline (threads only)."""


class _Reward(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    weight: float
    style: Style
    fn: Callable[..., Any]
    is_async: bool
    slot: int
    """Its index in the process workers' list of sync rewards (-1: not there)."""


class RewardRunner:
    """Scores groups with several rewards, off the caller's event loop."""

    def __init__(self, rewards: Sequence[RewardLike], weights: Sequence[float] | None = None,
                 names: Sequence[str] | None = None, *, timeout_s: float = 30.0,
                 workers: int = 2, threads: bool = False, chat: bool = False,
                 styles: Sequence[str] | None = None,
                 columns: Collection[str] = DEFAULT_COLUMNS,
                 base_dir: str | Path | None = None, start_method: str | None = None) -> None:
        """``rewards``: config entries (loaded here and, the sync ones, in every process
        worker) or callables. ``weights``, ``names``, ``styles``: per reward, overriding
        the entries' (empty names and styles: the entry's, else derived). ``workers``:
        the pool for sync rewards; ``threads``: threads instead of processes; ``chat``:
        TRL-style rewards get prompts and completions as message lists; ``columns``: the
        dataset columns every row has (for checking required parameters); ``base_dir``:
        what relative reward files are relative to (default: the working directory);
        ``start_method``: of the processes (default: forkserver where there is one,
        since a parent with threads must not fork)."""
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive number, got {timeout_s}")
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        for label, given in (("weights", weights), ("names", names), ("styles", styles)):
            if given is not None and len(given) != len(rewards):
                raise ValueError(f"{len(given)} {label} for {len(rewards)} rewards")
        self._timeout_s, self._workers, self._chat = timeout_s, workers, chat
        loaded = load_rewards(rewards, styles or [""] * len(rewards), columns, base_dir)
        final = final_names(loaded, names or [""] * len(rewards))
        self._entries: list[RewardSpec | bytes] = []  # what the process workers load
        self._rewards: list[_Reward] = []
        for i, (item, name) in enumerate(zip(loaded, final, strict=True)):
            weight = float(weights[i]) if weights is not None else item.weight
            if not math.isfinite(weight):
                raise ValueError(f"reward {i} ({name}): weight {weight} is not finite")
            is_async, slot = is_async_reward(item.fn), -1
            if not is_async and not threads:
                slot = len(self._entries)
                self._entries.append(item.spec if item.spec is not None
                                     else self._pickled(i, item.fn))
            self._rewards.append(_Reward(name=name, weight=weight, style=item.style,
                                         fn=item.fn, is_async=is_async, slot=slot))
        if start_method is None:
            methods = multiprocessing.get_all_start_methods()
            start_method = "forkserver" if "forkserver" in methods else "spawn"
        self._mp_context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":  # its children start with reward_guard imported
            self._mp_context.set_forkserver_preload(["__main__", reward_guard.__name__])
        self._pool: pebble.ProcessPool | None = None
        if self._entries:
            self._pool = self._new_pool()
            _ = self._pool.active  # starts the workers now: they load while the caller does
        has_sync = any(not r.is_async for r in self._rewards)
        self._threads = RewardThreads(workers, timeout_s) if threads and has_sync else None
        self._loop = (LoopThread("async-rl-rewards")
                      if any(r.is_async for r in self._rewards) else None)
        self._failures: dict[str, int] = {}
        self._closed = False

    @property
    def names(self) -> tuple[str, ...]:
        """The rewards' metric names, in order."""
        return tuple(r.name for r in self._rewards)

    @property
    def weights(self) -> tuple[float, ...]:
        return tuple(r.weight for r in self._rewards)

    @property
    def styles(self) -> tuple[Style, ...]:
        return tuple(r.style for r in self._rewards)

    @staticmethod
    def _pickled(index: int, fn: Callable[..., Any]) -> bytes:
        try:
            return dumps(fn)
        except Exception as err:
            raise TypeError(f"reward {index} ({reward_name(fn)}) cannot be sent to the "
                            f"reward processes ({describe(err)}); define it at module "
                            "level, or pass threads=True") from None

    def _new_pool(self) -> pebble.ProcessPool:
        return pebble.ProcessPool(max_workers=self._workers, initializer=child_init,
                                  initargs=(self._entries, loaded_user_files()),
                                  context=self._mp_context)

    async def score(self, *, prompts: Sequence[str | list[Message]],
                    completions: Sequence[str],
                    completion_ids: Sequence[Sequence[int]],
                    columns: Mapping[str, Any] | None = None,
                    data_source: str = "",
                    completion_turns: Sequence[list[Message]] | None = None
                    ) -> GroupRewards:
        """Scores one group: sample i is ``prompts[i]`` (one prompt repeated, for GRPO:
        its text, or its chat messages) completed by ``completions[i]`` (text), whose
        tokens are ``completion_ids[i]``; ``completion_turns``: multi-turn trajectories
        as messages (policy turns "assistant", observations "tool"), which TRL-style
        rewards get instead of the text.
        ``columns``: the row's dataset columns besides the prompt (``answer``, ...);
        ``data_source``: verl's name for rows without a ``data_source`` column."""
        if self._closed:
            raise RuntimeError("the reward runner is closed")
        n = len(completions)
        if len(prompts) != n or len(completion_ids) != n:
            raise ValueError(f"{n} completions came with {len(prompts)} prompts and "
                             f"{len(completion_ids)} completion_ids")
        inputs: dict[str, Any] = {
            "prompts": list(prompts), "completions": list(completions),
            "completion_ids": [list(ids) for ids in completion_ids],
            "columns": dict(columns or {}), "data_source": data_source}
        turns = list(completion_turns) if completion_turns is not None else None
        scored = await asyncio.gather(*(self._score_one(r, inputs, n, turns)
                                        for r in self._rewards))
        total = [0.0] * n
        failed = [False] * n
        scores: dict[str, tuple[float | None, ...]] = {}
        errors = timeouts = saturated = 0
        for reward, (values, lost, extras, n_errors, n_timeouts, n_saturated) in zip(
                self._rewards, scored, strict=True):
            for i in range(n):
                total[i] += reward.weight * values[i]
                failed[i] = failed[i] or lost[i]
            scores[reward.name] = tuple(None if lost[i] else values[i] for i in range(n))
            scores |= {f"{reward.name}/{key}": tuple(v) for key, v in extras.items()}
            errors, timeouts = errors + n_errors, timeouts + n_timeouts
            saturated += n_saturated
        return GroupRewards(total=tuple(total), scores=scores, errors=errors,
                            timeouts=timeouts, failed=tuple(failed), saturated=saturated)

    async def _score_one(self, reward: _Reward, inputs: dict[str, Any], n: int,
                         turns: list[list[Message]] | None = None
                         ) -> tuple[list[float], list[bool], dict[str, list[float | None]],
                                    int, int, int]:
        """One reward on the group: its per-sample values (0 where lost), which were
        lost, its extra metrics' per-sample values (None where a sample gave none), and
        the errors, timeouts and saturated ones."""
        if reward.style == "trl":
            trl = inputs if turns is None else {**inputs, "completions": turns}
            calls = [(list(range(n)), self._trl_inputs(trl))]
        else:
            calls = [([i], {**inputs, "prompts": inputs["prompts"][i:i + 1],
                            "completions": inputs["completions"][i:i + 1],
                            "completion_ids": inputs["completion_ids"][i:i + 1]})
                     for i in range(n)]
        outcomes = await asyncio.gather(*(self._call(reward, sub) for _, sub in calls))
        values, lost = [0.0] * n, [False] * n
        extras: dict[str, list[float | None]] = {}
        errors = timeouts = saturated = 0
        for (indices, _), outcome in zip(calls, outcomes, strict=True):
            if isinstance(outcome, CallFailed):
                saturated += len(indices) if isinstance(outcome, PoolSaturated) else 0
                if outcome.timed_out:
                    timeouts += len(indices)
                else:
                    errors += len(indices)
                for i in indices:
                    lost[i] = True
                self._log_failure(reward, len(indices), outcome)
                continue
            for j, i in enumerate(indices):
                values[i] = outcome.scores[j] or 0.0
            for j in outcome.nonfinite:
                lost[indices[j]] = True
            if outcome.nonfinite:
                errors += len(outcome.nonfinite)
                self._log_failure(reward, len(outcome.nonfinite),
                                  CallFailed("returned a non-finite score"))
            # Extra metrics come from per-sample calls only: one value at most per call.
            for key, metric in outcome.extra.items():
                for i, value in zip(indices, metric, strict=False):
                    extras.setdefault(key, [None] * n)[i] = value
        return values, lost, extras, errors, timeouts, saturated

    def _trl_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        if not self._chat:
            return inputs
        prompts, completions = chat_messages(inputs["prompts"], inputs["completions"])
        return {**inputs, "prompts": prompts, "completions": completions}

    async def _call(self, reward: _Reward, inputs: dict[str, Any]
                    ) -> RewardValues | CallFailed:
        """One call of ``reward``, wherever it runs; never raises (but cancellation)."""
        timeout_s = self._timeout_s
        if reward.is_async:
            assert self._loop is not None
            try:
                return await self._loop.run(
                    guarded_async(reward.fn, reward.style, inputs, timeout_s),
                    timeout_s + _GRACE_S)
            except TimeoutError:  # the reward blocks its event loop
                return CallFailed(f"ran past {timeout_s} s (blocking its event loop)", True)
        if self._threads is not None:
            outcome: RewardValues | CallFailed = await self._threads.call(
                guarded, reward.fn, reward.style, inputs)
            return outcome
        try:
            process_future = self._process_pool().schedule(
                child_score, args=(reward.slot, reward.style, inputs), timeout=timeout_s)
            return await asyncio.wrap_future(process_future)
        except TimeoutError:  # pebble killed the process and starts another
            return CallFailed(f"ran past {timeout_s} s", timed_out=True)
        except Exception as err:  # the process died, or the inputs do not pickle
            return CallFailed(describe(err))

    def _process_pool(self) -> pebble.ProcessPool:
        assert self._pool is not None
        if not self._pool.active:
            log.warning("the reward process pool broke; starting a new one")
            self._pool.stop()
            self._pool = self._new_pool()
        return self._pool

    def _log_failure(self, reward: _Reward, samples: int, outcome: CallFailed) -> None:
        count = self._failures[reward.name] = self._failures.get(reward.name, 0) + 1
        what = "timed out" if outcome.timed_out else "failed"
        level = logging.WARNING if count <= _LOGGED_FAILURES else logging.DEBUG
        more = " (its further failures are logged at DEBUG)" if count == _LOGGED_FAILURES \
            else ""
        log.log(level, "reward %s %s on %d sample(s), scored 0: %s%s", reward.name, what,
                samples, outcome.message, more)

    def close(self) -> None:
        """Stops the process workers and the async rewards' loop; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.stop()
            self._pool.join()
        if self._threads is not None:
            self._threads.close()
        if self._loop is not None:
            self._loop.close()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class UserRewards(msgspec.Struct, frozen=True, kw_only=True):
    """A task's own rewards (task.rewards and its knobs) as a rollout worker or the
    evaluator runs them: sent to the actor, turned into a ``RewardRunner`` there."""

    specs: tuple[RewardSpec | Reward, ...]
    """The entries, with file paths made absolute (actors may run elsewhere), then the
    callables a script passed (pickled with the actor's arguments)."""
    timeout_s: float = 30.0
    workers: int = 2
    threads: bool = False
    chat: bool = False
    """Chat templates are on: TRL-style rewards get prompts and completions as messages."""
    columns: tuple[str, ...] = DEFAULT_COLUMNS
    """The dataset columns every row has (a reward may require any of them)."""
    eval_reward: str = ""
    """The reward whose mean over greedy completions is an evaluation's accuracy (a
    metric name; "" = the weighted sum)."""

    def runner(self) -> RewardRunner:
        """Loads the rewards and starts their pool (in the calling process)."""
        return RewardRunner(list(self.specs), timeout_s=self.timeout_s,
                            workers=self.workers, threads=self.threads, chat=self.chat,
                            columns=self.columns)
