"""Rewards, every kind, in one place: how a completion gets its score.

``function`` (``RewardFn``, the built-in tasks' reward protocol, called guarded), ``spec``
(``[[task.rewards]]`` entries: naming, loading and reading a user's reward), ``callables``
(a script's reward callables, checked and pickled for the workers), ``calls`` (calling
one in its style: TRL, verl or per sample, sync or async), ``guard`` (one call that
never raises: values or why not), ``threads`` (the thread pool of task.reward_threads),
``loading`` (the rewards a runner is given, loaded, checked and named) and ``runner``
(``RewardRunner``: every user reward of a group, off the engine's loop, bounded by
task.reward_timeout_s). The built-in tasks' reward functions are the tasks'
own (``async_rl.tasks.rewards``); the rollout side applies rewards to its samples in
``workers.rollout.scoring``.
"""
