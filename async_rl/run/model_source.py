"""Where a run's model comes from: a local directory, or a hub id found through the hub's cache.

Owns: ``resolve_model_path``, the one place ``model.path`` is turned into the local
directory every worker loads (rollout engines, trainer shards, the evaluator) and the
run directory records. A local directory is used as given; a Hugging Face hub id such as
``Qwen/Qwen2.5-0.5B-Instruct`` is looked up in ``huggingface_hub``'s cache (which honours
``HF_HOME``, ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE``, as read when ``huggingface_hub`` is
first imported) and, unless offline, downloaded into it once. Either way the directory
must hold a Hugging Face model config. Anything else is a ``ConfigError`` of one line,
raised in the driver before Ray starts: a missing model fails in seconds, not after a
worker's download retries.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from buffers.common.config import ConfigError
from workers.common.errors import first_line

log = logging.getLogger(__name__)

UNUSED_FILES = ("*.onnx", "onnx/*", "*.msgpack", "*.h5", "*.tflite", "*.ot", "*.gguf",
                "original/*", "*.mlmodel", "coreml/*", "openvino/*")
"""Files of a hub repository no worker loads (other frameworks' weights, the original
checkpoint beside a converted one): not downloaded."""


def _is_hub_id(path: str) -> bool:
    """``path`` reads as a hub repository id (``name`` or ``org/name``) and not as a path
    here: ``runs/small-model``, whose folder ``runs`` exists, is a local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if "/" in path and Path(path).parent.is_dir():
        return False
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def _check_model_dir(path: str, directory: Path, hint: str) -> None:
    """``directory`` holds a Hugging Face model config, or a ConfigError says what not."""
    key = f"config error: model.path = {path!r}"
    config = directory / "config.json"
    if not config.is_file():
        raise ConfigError(f"{key}: no model there ({hint})")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (ValueError, AttributeError):
        model_type = None
    if not model_type:
        raise ConfigError(f"{key}: its config.json is not a Hugging Face model config "
                          "(no model_type)")


def _from_hub_cache(repo_id: str, make: str) -> Path:
    """The snapshot directory of ``repo_id`` in the hub cache, downloaded there first when
    it is missing and the hub may be reached (HF_HUB_OFFLINE unset)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    where = f"not a local directory, and not in the hub cache at {constants.HF_HUB_CACHE}"
    if not constants.HF_HUB_OFFLINE:
        log.info("model.path = %r: downloading it from the hub into %s", repo_id,
                 constants.HF_HUB_CACHE)
        try:
            return Path(snapshot_download(repo_id, ignore_patterns=list(UNUSED_FILES)))
        except Exception as err:  # no connection, no such repository, gated, ...
            where += f" (the hub: {first_line(err)})"
    else:
        where += " (HF_HUB_OFFLINE is set: nothing is downloaded)"
    raise ConfigError(f"config error: model.path = {repo_id!r}: {where}; get it with "
                      f"`hf download {repo_id}`, or build a local one with `{make}`")


def resolve_model_path(path: str, *, task_kind: str = "arithmetic") -> str:
    """The local directory of ``model.path``: ``path`` itself when it is a directory, else
    the hub cache's snapshot of the hub id ``path``. ``task_kind`` (task.kind) picks the
    ``async-rl make-model`` command the error suggests."""
    task = f" --task {task_kind}" if task_kind in ("longtail", "calculator") else ""
    make = f"async-rl make-model --out {path}{task}"
    local = Path(path).expanduser()
    if local.exists() or not _is_hub_id(path):
        _check_model_dir(path, local, f"build one with: {make}")
        return path
    snapshot = _from_hub_cache(path, make)
    _check_model_dir(path, snapshot, f"the hub cache's snapshot {snapshot} has no config.json")
    log.info("model.path = %r: %s", path, snapshot)
    return str(snapshot)
