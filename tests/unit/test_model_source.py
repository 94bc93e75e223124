"""model.path as a local directory or a hub id: resolved through a hub cache laid out
here (nothing is downloaded), and one line, in well under a second, when it is neither."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import huggingface_hub
import msgspec
import pytest
from hub_cache import add_to_hub_cache
from huggingface_hub import constants

from async_rl.config import Config
from async_rl.run.inputs import check_inputs
from async_rl.run.model_source import resolve_model_path
from buffers.common.config import ConfigError

MODEL_CONFIG = json.dumps({"model_type": "qwen2"})
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache that huggingface_hub reads, offline (as HF_HUB_CACHE and
    HF_HUB_OFFLINE=1 in the environment make it at import)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_local_directory_is_used_as_given(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(MODEL_CONFIG)
    assert resolve_model_path(str(model)) == str(model)


def test_a_hub_id_resolves_to_its_snapshot_in_the_cache(hub: Path) -> None:
    snapshot = add_to_hub_cache(hub, "org/tiny", files={"config.json": MODEL_CONFIG})
    assert resolve_model_path("org/tiny") == str(snapshot)


def test_check_inputs_gives_the_run_the_snapshot_directory(hub: Path, tmp_path: Path) -> None:
    snapshot = add_to_hub_cache(hub, "org/tiny", files={"config.json": MODEL_CONFIG})
    config = msgspec.convert({"model": {"path": "org/tiny"},
                              "run": {"output_dir": str(tmp_path / "run")}}, Config)
    checked = check_inputs(config)
    assert checked.model.path == str(snapshot)
    assert checked.run == config.run


def test_a_missing_hub_id_is_one_line_at_once(hub: Path) -> None:
    began = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        resolve_model_path("org/not-there")
    assert time.perf_counter() - began < 2.0
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("config error: model.path = 'org/not-there': not a local directory")
    assert f"not in the hub cache at {hub}" in line
    assert "HF_HUB_OFFLINE" in line
    assert "hf download org/not-there" in line
    assert "async-rl make-model --out org/not-there" in line


def test_a_failed_download_is_one_line(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls: list[bool] = []

    def no_hub(repo_id: str, *, local_files_only: bool = False, **kwargs: object) -> str:
        calls.append(local_files_only)
        raise huggingface_hub.errors.LocalEntryNotFoundError("no connection\nmore")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    with pytest.raises(ConfigError) as err:
        resolve_model_path("org/not-there", task_kind="longtail")
    assert calls == [True, False]  # the cache, then one download: no retries here
    line = str(err.value)
    assert "\n" not in line
    assert "(the hub: LocalEntryNotFoundError: no connection)" in line
    assert "async-rl make-model --out org/not-there --task longtail" in line


def test_a_missing_local_path_says_how_to_build_it(tmp_path: Path) -> None:
    missing = tmp_path / "longtail-model"  # its folder exists: a local path, not a hub id
    with pytest.raises(ConfigError) as err:
        resolve_model_path(str(missing), task_kind="longtail")
    assert str(err.value) == (
        f"config error: model.path = {str(missing)!r}: no model there (build one with: "
        f"async-rl make-model --out {missing} --task longtail)")


def test_a_snapshot_without_a_model_config_is_refused(hub: Path) -> None:
    add_to_hub_cache(hub, "org/empty", files={"README.md": "no model"})
    with pytest.raises(ConfigError, match=r"model.path = 'org/empty': no model there"):
        resolve_model_path("org/empty")


def test_the_environment_picks_the_cache_and_offline_mode(tmp_path: Path) -> None:
    """HF_HOME and HF_HUB_OFFLINE as a user sets them, in a fresh interpreter."""
    snapshot = add_to_hub_cache(tmp_path / "home" / "hub", "org/tiny",
                                files={"config.json": MODEL_CONFIG})
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {"HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    script = ("from async_rl.run.model_source import resolve_model_path as r\n"
              "print(r('org/tiny'))\n"
              "try:\n    r('org/other')\nexcept Exception as err:\n    print(err)\n")
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=True)
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0] == str(snapshot)
    assert f"not in the hub cache at {tmp_path / 'home' / 'hub'}" in lines[1]


def test_async_rl_train_stops_on_a_missing_model_before_loading_torch(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[model]\npath = "org/missing"\n[run]\noutput_dir = "{tmp_path}/run"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    script = ("import sys\nfrom async_rl.cli import main\n"
              f"status = main(['train', {str(config)!r}])\n"
              "print(status, sorted(m for m in ('ray', 'torch', 'vllm') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "2 []"
    err = done.stderr.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("config error: model.path = 'org/missing': not a local directory")
    assert not (tmp_path / "run").exists()
