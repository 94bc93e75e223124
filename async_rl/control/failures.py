"""What fails in a run, as the orchestrator sees it: the errors its workers' protocols
(``async_rl.control.protocols``) raise, and finding them in task groups.

Owns: a worker's failures (``RolloutFailed``: one call, or the worker gone;
``EvaluationFailed``: an evaluation's row lost), the run's (``RunFailed`` and what it
is for a trainer shard, ``TrainerFailed``, a role's own worker, ``RoleFailed``, and a
call that got no answer in time, ``WaitTimedOut``), and ``all_errors`` /
``first_error``, which find them inside nested task-group errors. Knows nothing about
Ray or the workers.
"""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=Exception)


class RolloutFailed(Exception):
    """A rollout call did not produce its result.

    ``worker_gone``: the worker is dead or broken (a failed weight load, say) and must
    get no more work; otherwise only this call failed.
    """

    def __init__(self, reason: str, *, worker_gone: bool, out_of_memory: bool = False,
                 timed_out: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.worker_gone = worker_gone
        self.out_of_memory = out_of_memory
        self.timed_out = timed_out


class EvaluationFailed(Exception):
    """The evaluator could not score a version (it died, timed out or raised): the
    evaluation's row is lost, the run goes on."""


class RunFailed(Exception):
    """The run cannot go on (every rollout worker gone, restarts used up): one line."""


class RoleFailed(RunFailed):
    """A reference or critic worker of its own failed a stage (``dead``: its process
    is gone or stuck). The run stops as for a failed trainer shard; the trainer shards
    are alive, so they write its checkpoint (a dead critic's state cannot be in it)."""

    def __init__(self, name: str, reason: str, *, dead: bool, timed_out: bool = False) -> None:
        super().__init__(f"{name} {'died' if dead else 'failed'}: {reason}")
        self.name = name
        self.dead = dead
        self.timed_out = timed_out


class WaitTimedOut(RunFailed):
    """A call to a worker got no answer in time: names what was waited for, how long."""

    def __init__(self, what: str, seconds: float, key: str) -> None:
        super().__init__(f"timed out after {seconds:g} s waiting for {what} ({key})")


class TrainerFailed(RunFailed):
    """A trainer shard's step failed. ``dead``: its process is gone or stuck, so only
    the other shards can still write the checkpoint (shards are replicas)."""

    def __init__(self, rank: int, reason: str, *, dead: bool,
                 out_of_memory: bool = False, timed_out: bool = False) -> None:
        super().__init__(f"trainer-{rank} {'died' if dead else 'failed'}: {reason}")
        self.rank = rank
        self.dead = dead
        self.out_of_memory = out_of_memory
        self.timed_out = timed_out


def all_errors(group: BaseExceptionGroup[BaseException], kind: type[E]) -> list[E]:
    """Every error of ``kind`` inside nested task-group errors."""
    found: list[E] = []
    for error in group.exceptions:
        if isinstance(error, kind):
            found.append(error)
        elif isinstance(error, BaseExceptionGroup):
            found += all_errors(error, kind)
    return found


def first_error(group: BaseExceptionGroup[BaseException],
                kinds: tuple[type[Exception], ...] = ()) -> Exception | None:
    """The first error of ``kinds`` (default: ``RunFailed``) inside nested task-group
    errors, if there is one: what the user gets as one line instead of the tree."""
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):  # groups are Exceptions too: look inside
            if found := first_error(error, kinds):
                return found
        elif isinstance(error, kinds or (RunFailed,)):
            return error
    return None
