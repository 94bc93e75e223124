"""Importing user code a config names: ``"path/to/file.py:name"`` or ``"package.module:name"``.

Owns: ``import_object`` (the object such a name points at, a dotted name inside allowed;
a bad one is a ``ConfigError`` of one line naming the key), loading a file under a name
stable across processes (``import_user_file``, ``module_name_for``), so that its
functions pickle by reference, the files this process has loaded
(``loaded_user_files``, for the processes it starts), and file paths made absolute
(``absolute_target``). Rewards (``workers.rewards.spec``) and environments
(``workers.rollout.environment``) import through it. Knows nothing about what the objects are.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from buffers.common.config import ConfigError
from workers.common.errors import first_line


def is_file_target(target: str) -> bool:
    """Whether ``target`` (the part before the colon) is a file path, not a module path."""
    return target.endswith(".py") or "/" in target or os.sep in target


_MODULE_PREFIX = "_async_rl_reward_"


def module_name_for(path: Path) -> str:
    """The stable ``sys.modules`` name a user file (a reward's, an environment's) is
    loaded under: the same in every process that loads the same absolute path, so its
    functions pickle by reference."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    stem = re.sub(r"\W", "_", path.stem)
    return f"{_MODULE_PREFIX}{stem}_{digest}"


def loaded_user_files() -> list[str]:
    """The absolute paths of the user files this process has loaded: another process
    that loads them too (``import_user_file``) can unpickle their functions."""
    return [str(module.__file__) for name, module in list(sys.modules.items())
            if name.startswith(_MODULE_PREFIX) and getattr(module, "__file__", None)]


def absolute_target(where: str, base_dir: str | Path | None = None) -> str:
    """``"file.py:name"`` with a relative file path made absolute against ``base_dir``
    (default: the working directory), so that another process loads the very same file;
    a module path as it is."""
    target, sep, attr = where.rpartition(":")
    if not sep or not is_file_target(target):
        return where
    path = Path(target).expanduser()
    if not path.is_absolute():
        path = Path(base_dir or os.getcwd()) / path
    return f"{path.resolve()}:{attr}"


def import_user_file(path: Path) -> Any:
    """The module of user file ``path`` (absolute), loaded once per process under
    ``module_name_for(path)``."""
    name = module_name_for(path)
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"not a Python module: {path}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_object(where: str, key: str, *, base_dir: str | Path | None = None,
                  kind: str = "function") -> Any:
    """The object ``where`` names (``"path/to/file.py:name"`` or
    ``"package.module:name"``, a dotted name inside allowed), unchecked; raises
    ``ConfigError`` naming ``key`` (``kind`` says what the name should be)."""

    def fail(why: str) -> ConfigError:
        return ConfigError(f"config error: {key} = {where!r}: {why}")

    target, sep, attr = absolute_target(where, base_dir).rpartition(":")
    if not sep or not target or not attr:
        raise fail(f"expected 'path/to/file.py:{kind}' or 'package.module:{kind}'")
    if is_file_target(target):
        path = Path(target)
        if not path.is_file():
            raise fail(f"file not found: {path}")
        loader: Callable[[], Any] = functools.partial(import_user_file, path)
    else:
        loader = functools.partial(importlib.import_module, target)
    try:
        module = loader()
    except BaseException as err:  # SystemExit too: the user's module must not end the run
        if isinstance(err, KeyboardInterrupt):
            raise
        raise fail(f"cannot import it: {first_line(err)}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise fail(f"no {part!r} in {target}")
        obj = getattr(obj, part)
    return obj
