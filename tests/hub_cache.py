"""A Hugging Face hub cache laid out by hand, for tests that resolve hub ids offline.

Owns: ``add_to_hub_cache``, which writes the layout ``huggingface_hub`` reads (under the
cache directory, ``models--<org>--<name>/refs/main`` naming a commit and
``models--<org>--<name>/snapshots/<commit>/`` holding the files), with a model
directory's files linked in or files given by content. Nothing is downloaded. Knows
nothing about pytest.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def add_to_hub_cache(cache: Path, repo_id: str, *, model_dir: Path | None = None,
                     files: dict[str, str] | None = None) -> Path:
    """Puts ``repo_id`` in the hub cache at ``cache`` (the ``HF_HUB_CACHE`` directory):
    symlinks to the files of ``model_dir``, and/or ``files`` (name -> text). Returns the
    snapshot directory, which is what resolving ``repo_id`` must give."""
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    if model_dir is not None:
        for source in Path(model_dir).iterdir():
            if source.is_file() and not source.name.startswith("."):
                (snapshot / source.name).symlink_to(source.resolve())
    for name, text in (files or {}).items():
        (snapshot / name).write_text(text)
    return snapshot
