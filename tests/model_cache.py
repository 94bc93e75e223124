"""The test tiers' model cache: each model a test needs is built once, then reused by every
later fixture, tier and pytest session of the same checkout until its builder changes.

Owns: ``cached_model(**kwargs)``, the directory of
``async_rl.models.tiny_model.make_model(<dir>, **kwargs)``, stored under a key that
hashes the builder's source (``tiny_model.py`` and every project module it names in an
import, followed transitively; a package's ``__init__`` only when an import names the
package itself), the versions of the libraries whose numerics decide the weights, and
the keyword arguments. Editing the builder, anything it calls, or the arguments gives a
new key, so a stale model is never reused. A build runs in a child process (see
``_build``) into a temporary directory renamed into place, under an ``fcntl`` lock, so
concurrent sessions neither collide nor see a half-written model. A manifest of file
hashes, checked on every reuse, gets a model that a test modified rebuilt, not trusted.

Where: ``$ASYNC_RL_TEST_CACHE`` if set, else ``$XDG_CACHE_HOME/async-rl/test-models``
(``~/.cache`` when unset): outside the checkout, so a fresh clone reuses the models an
earlier clone of the same builder code made, as a hub cache would (the key, not the
path, decides reuse). Builds no session used for two weeks are removed
when another is built. Knows nothing about pytest.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import os
import pickle
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from async_rl.models.tiny_model import MadeModel

REPO = Path(__file__).resolve().parents[1]
BUILDER = "async_rl.models.tiny_model"
"""The module whose ``make_model`` builds every test model."""
PROJECT_PACKAGES = ("async_rl", "workers", "buffers")
LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "msgspec")
"""Whose versions join the key: their kernels and serialisation decide the weights."""
CACHE_ENV = "ASYNC_RL_TEST_CACHE"
MANIFEST = ".test-cache-manifest.json"
STALE_S = 14 * 24 * 3600
"""A build no session asked for in this long is removed after the next build."""
FORMAT = 1
"""Bumped when this module changes how it lays out or keys the cache."""


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    user_cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(user_cache) / "async-rl" / "test-models"


def _module_file(name: str) -> Path | None:
    """The project file that ``import name`` runs last (a package's ``__init__``)."""
    if name.split(".")[0] not in PROJECT_PACKAGES:
        return None
    base = REPO.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported(path: Path, name: str) -> set[str]:
    """Project modules named by the imports anywhere in one module (including imports
    inside functions: more than is imported at run time, never less)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{anchor}.{node.module}" if node.module else anchor
            else:
                module = node.module or ""
            found.add(module)
            # ``from pkg import mod`` imports the submodule pkg.mod when there is one.
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return {m for m in found if _module_file(m) is not None}


def builder_sources(root: str = BUILDER) -> dict[str, Path]:
    """``root`` and every project module reachable from it through imports."""
    seen: dict[str, Path] = {}
    todo = [root]
    while todo:
        name = todo.pop()
        path = _module_file(name)
        if name in seen or path is None:
            continue
        seen[name] = path
        todo.extend(_imported(path, name))
    return dict(sorted(seen.items()))


def _canonical(value: Any) -> Any:
    """Keyword arguments as JSON (msgspec structs such as ``ModelSize`` as their fields)."""
    import msgspec

    return msgspec.to_builtins(value, order="sorted")


def cache_key(kwargs: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    for name, path in builder_sources().items():
        digest.update(f"{name}\0".encode())
        digest.update(path.read_bytes())
    versions = {lib: metadata.version(lib) for lib in LIBRARIES}
    digest.update(json.dumps({
        "format": FORMAT,
        "python": sys.version_info[:2],
        "machine": platform.machine(),
        "libraries": versions,
        "kwargs": _canonical(kwargs),
    }, sort_keys=True).encode())
    return digest.hexdigest()[:20]


def _file_hashes(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def _intact(directory: Path) -> bool:
    try:
        recorded = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(recorded, dict) and recorded == _file_hashes(directory)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _label(kwargs: dict[str, Any]) -> str:
    size = getattr(kwargs.get("size"), "name", "tiny")
    task = getattr(kwargs.get("task"), "name", "arithmetic")
    return f"{task}-{size}"


def cached_model(**kwargs: Any) -> Path:
    """The directory of ``make_model(<dir>, **kwargs)`` (``log`` is always ``None``),
    built now unless an intact build under the same key exists. Its ``made_model.json``
    is the build's record, ``path`` naming this directory."""
    if "log" in kwargs or "out_dir" in kwargs:
        raise TypeError("cached_model chooses out_dir and log itself")
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_label(kwargs)}-{cache_key(kwargs)}"
    lock = root / f"{final.name}.lock"
    with _locked(lock):
        os.utime(lock)  # when this key was last used (see _prune)
        if final.is_dir():
            if _intact(final):
                return final
            shutil.rmtree(final)  # modified by a test or cut short: never trust it
        import msgspec

        from async_rl.models.tiny_model import MADE_MODEL_FILE

        staging = root / f"{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            _build(staging, kwargs)
            made = made_record(staging)
            record = msgspec.structs.replace(made, path=str(final))
            (staging / MADE_MODEL_FILE).write_bytes(
                msgspec.json.format(msgspec.json.encode(record)))
            (staging / MANIFEST).write_text(json.dumps(_file_hashes(staging), indent=1))
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    _prune(root, keep=final)
    return final


def _prune(root: Path, keep: Path) -> None:
    """Removes the builds of other keys unused for ``STALE_S`` (the models of builder
    versions long edited away), each under its lock and only when no one holds it."""
    now = time.time()
    for lock in root.glob("*.lock"):
        directory = lock.with_suffix("")
        if directory == keep or now - lock.stat().st_mtime < STALE_S:
            continue
        with open(lock, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # in use right now
            shutil.rmtree(directory, ignore_errors=True)
            lock.unlink(missing_ok=True)


def _build(out: Path, kwargs: dict[str, Any]) -> None:
    """``make_model(out, **kwargs)`` in a child process, for two reasons. OpenMP's
    default busy-waiting makes a multi-threaded warm start several times slower on a
    machine whose cores other processes also use (measured here: 154 s against 29 s for
    30 steps of the small model on two threads beside a running test; the weights are
    bit-identical), so the child waits passively unless ``OMP_WAIT_POLICY`` is set. And
    the test process keeps its own torch state (``make_model`` seeds the global
    generator), whether or not the model came from the cache."""
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
           # The child builds from the sources the key hashed, whatever is installed.
           "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO),
                                                       os.environ.get("PYTHONPATH"))))}
    done = subprocess.run(
        [sys.executable, __file__, str(out)], input=pickle.dumps(kwargs), env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False,
    )
    if done.returncode != 0:
        tail = done.stdout.decode(errors="replace")[-4000:]
        raise RuntimeError(f"building the test model {kwargs} failed "
                           f"(exit {done.returncode}):\n{tail}")


def made_record(directory: Path) -> MadeModel:
    """The ``MadeModel`` record of a model directory."""
    import msgspec

    from async_rl.models.tiny_model import MADE_MODEL_FILE, MadeModel

    return msgspec.json.decode((directory / MADE_MODEL_FILE).read_bytes(), type=MadeModel)


if __name__ == "__main__":  # the child of _build: out_dir as argument, kwargs pickled on stdin
    from async_rl.models.tiny_model import make_model

    make_model(sys.argv[1], **pickle.loads(sys.stdin.buffer.read()), log=None)
