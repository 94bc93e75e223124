"""Config decoding: good configs resolve, every bad input is one line naming the key."""

from __future__ import annotations

import inspect
import tomllib
import typing
from pathlib import Path

import msgspec
import pytest

from async_rl.cli import main
from async_rl.config import Config
from async_rl.config_io import apply_overrides, decode_config, load_config, to_toml
from buffers.common.config import ConfigError
from workers.weights.config import check_transport

GOOD = """
[model]
path = "runs/tiny-model"

[trainer]
num_shards = 2
groups_per_step = 4

[queue]
bucket_edges = [32, 64]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def load_config_text(text: str, overrides: list[str] | None = None) -> Config:
    return decode_config(apply_overrides(tomllib.loads(text), overrides or []))


def test_good_config_resolves_with_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD))
    assert config.trainer.num_shards == 2
    assert config.queue.bucket_edges == (32, 64)
    assert config.staleness.max_staleness == 2


def test_overrides_are_typed_as_toml_values(tmp_path: Path) -> None:
    config = load_config(
        write(tmp_path, GOOD),
        ["trainer.lr=3e-4", "weights.update_mode=drain", "run.progress=false",
         "queue.bucket_edges=[8, 16, 32]", "run.output_dir=runs/x"],
    )
    assert config.trainer.lr == pytest.approx(3e-4)
    assert config.weights.update_mode == "drain"
    assert config.run.progress is False
    assert config.queue.bucket_edges == (8, 16, 32)
    assert config.run.output_dir == "runs/x"


def test_resolved_toml_round_trips(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD), ["staleness.max_staleness=0"])
    again = load_config(write(tmp_path, to_toml(config)))
    assert again == config


def test_config_is_frozen(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD))
    with pytest.raises(AttributeError):
        config.trainer.lr = 1.0  # type: ignore[misc]


# (TOML text, overrides, the key the error must name, a fragment of what is allowed)
BAD: list[tuple[str, list[str], str, str]] = [
    (GOOD + "\n[bogus]\nx = 1\n", [], "bogus", "unknown key"),
    (GOOD.replace("[queue]", "[queue]\ncolour = 'red'"), [], "queue.colour", "unknown key"),
    (GOOD, ["trainer.lr=fast"], "trainer.lr", "expected `float`"),
    (GOOD, ["trainer.lr=-1.0"], "trainer.lr", "> 0"),
    (GOOD, ["trainer.lr=0"], "trainer.lr", "> 0"),
    (GOOD, ["trainer.num_shards=0"], "trainer.num_shards", ">= 1"),
    (GOOD, ["rollout.num_workers=-2"], "rollout.num_workers", ">= 1"),
    (GOOD, ["rollout.group_size=1"], "rollout.group_size", ">= 2"),
    (GOOD, ["queue.max_groups=0"], "queue.max_groups", ">= 1"),
    (GOOD, ["queue.max_tokens=-5"], "queue.max_tokens", ">= 1"),
    (GOOD, ["staleness.max_staleness=-1"], "staleness.max_staleness", ">= 0"),
    (GOOD, ["trainer.mini_batches=3"], "trainer.mini_batches", "must divide"),
    (GOOD, ["queue.max_groups=2"], "queue.max_groups", "groups_per_step"),
    ("[trainer]\nlr = 1e-3\n", [], "model", "required"),
    ("[model]\ndtype = 'float32'\n", [], "model.path", "required"),
    (GOOD, ["queue.bucket_edges=[64, 32]"], "queue.bucket_edges", "increasing"),
    (GOOD, ["queue.bucket_edges=[16, 16]"], "queue.bucket_edges", "increasing"),
    (GOOD, ["queue.bucket_edges=[0, 16]"], "queue.bucket_edges[0]", ">= 1"),
    (GOOD, ["queue.bucket_edges=12"], "queue.bucket_edges", "expected `array`"),
    (GOOD, ["weights.update_mode=sometimes"], "weights.update_mode", "'in_flight'"),
    (GOOD, ["weights.kv_policy=reuse"], "weights.kv_policy", "'keep'"),
    (GOOD, ["model.dtype=float8"], "model.dtype", "'float32'"),
    (GOOD, ["task.kind=jsonl"], "task.jsonl_path", 'task.kind = "jsonl"'),
    (GOOD, ["rollout.memory_fraction=1.5"], "rollout.memory_fraction", "<= 1"),
    (GOOD, ["rollout.temperature=0"], "rollout.temperature", "> 0"),
    (GOOD, ["trainer.clip_low=1.0"], "trainer.clip_low", "< 1"),
    (GOOD, ["trainer.micro_batch_tokens=4"], "trainer.micro_batch_tokens", "max_new_tokens"),
    (GOOD, ["trainer.nonexistent=1"], "trainer.nonexistent", "unknown key"),
    (GOOD, ["nosection.key=1"], "nosection.key", "unknown section"),
    (GOOD, ["justakey=1"], "justakey=1", "section.key=value"),
    (GOOD, ["run.progress=maybe"], "run.progress", "expected `bool`"),
    (GOOD, ["weights.sync_every=0"], "weights.sync_every", ">= 1"),
    (GOOD, ["run.eval_every=-1"], "run.eval_every", ">= 0"),
    (GOOD, ["run.eval_every=2.5"], "run.eval_every", "expected `int`"),
    (GOOD, ["run.target_accuracy=0"], "run.target_accuracy", "> 0"),
    (GOOD, ["run.target_accuracy=1.2"], "run.target_accuracy", "<= 1"),
    (GOOD, ["weights.sync_every=4"], "weights.sync_every", "staleness.max_staleness + 1"),
    (GOOD, ["weights.transport=shm"], "weights.transport", "'gloo'"),
    (GOOD, ["weights.transport=ipc"], "weights.transport", "run.colocate"),
    (GOOD, ["weights.transport=nccl", "run.colocate=true"], "weights.transport",
     "NCCL refuses two ranks on one GPU"),
    (GOOD, ["rollout.dtype=float16"], "rollout.dtype", "'bfloat16'"),
    (GOOD, ["weights.bucket_mb=0"], "weights.bucket_mb", ">= 1"),
    (GOOD, ["weights.timeout_s=0"], "weights.timeout_s", "> 0"),
    (GOOD.replace("[model]", "model = 3\n[modelx]"), [], "model", ""),
    (GOOD, ['run.loggers=["tensorboard"]'], "run.loggers", 'must list "jsonl"'),
    (GOOD, ['run.loggers=["jsonl", "jsonl"]'], "run.loggers", "no logger twice"),
    (GOOD, ['run.loggers=["jsonl", "tb"]'], "run.loggers[1] = 'tb'", "'tensorboard'"),
    (GOOD, ["trainer.clip_ratio_c=1.0"], "trainer.clip_ratio_c", "> 1"),
    (GOOD, ["trainer.clip_ratio_c=0.5"], "trainer.clip_ratio_c", "> 1"),
    (GOOD, ["trainer.mini_batches=0"], "trainer.mini_batches", ">= 1"),
    (GOOD, ["trainer.mini_batches=3"], "trainer.mini_batches", "must divide"),
    (GOOD, ["trainer.epochs=0"], "trainer.epochs", ">= 1"),
    (GOOD, ["trainer.advantage_std=bessel"], "trainer.advantage_std", "'sample'"),
    (GOOD, ["trainer.loss_agg=seq_mean"], "trainer.loss_agg", "'seq_mean_token_sum_norm'"),
    (GOOD, ["trainer.tis_mode=clip"], "trainer.tis_mode", "'truncate', 'mask'"),
    (GOOD, ["trainer.tis_cap=-1"], "trainer.tis_cap", ">= 0"),
    (GOOD, ["task.tool_latency_ms=50"], "task.tool_latency_ms", 'task.kind = "calculator"'),
    (GOOD, ["task.kind=calculator", "task.tool_latency_ms=-1"], "task.tool_latency_ms",
     ">= 0"),
    (GOOD, ["trainer.backend=fsdp"], "trainer.backend", "'ddp', 'fsdp2'"),
    (GOOD, ["trainer.offload=true"], "trainer.offload", 'trainer.backend = "fsdp2"'),
    (GOOD, ["trainer.param_dtype=bfloat16"], "trainer.param_dtype", '"fsdp2"'),
    (GOOD, ["trainer.reduce_dtype=float32"], "trainer.reduce_dtype", '"fsdp2"'),
    (GOOD, ["trainer.backend=fsdp2", "trainer.param_dtype=float16"], "trainer.param_dtype",
     "'bfloat16'"),
    (GOOD, ["trainer.shard_group=1"], "trainer.shard_group", '"fsdp2"'),
    (GOOD, ["trainer.backend=fsdp2", "trainer.num_shards=4", "trainer.groups_per_step=8",
            "trainer.shard_group=3"], "trainer.shard_group", "must divide trainer.num_shards"),
]


@pytest.mark.parametrize(("text", "overrides", "key", "allowed"), BAD)
def test_bad_input_is_one_line_naming_the_key(
    tmp_path: Path, text: str, overrides: list[str], key: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), overrides)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("config error: ")
    assert key in message
    assert allowed in message


def test_cuda_transports_need_gpus(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD), ["weights.transport=nccl"])
    check_transport(config.weights, cuda=True)
    with pytest.raises(ConfigError) as info:
        check_transport(config.weights, cuda=False)
    assert str(info.value) == ("config error: weights.transport = 'nccl': needs CUDA GPUs, "
                               'and the workers have none; use "gloo" on CPU')
    check_transport(load_config(write(tmp_path, GOOD)).weights, cuda=False)
    colocated = load_config(write(tmp_path, GOOD), [
        "weights.transport=ipc", "run.colocate=true", "trainer.num_shards=1"])
    assert colocated.weights.transport == "ipc"


def test_unparsable_toml_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[model\npath = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.toml")


def test_cli_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, GOOD)
    assert main(["config", "show", str(path), "--set", "staleness.max_staleness=-3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "staleness.max_staleness = -3" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("task", "overrides", "key", "owner"), [
    ('kind = "longtail"\npath = "rows.csv"\n', [], "task.path = 'rows.csv'", "dataset"),
    ("", ["task.jsonl_path=p.jsonl"], "task.jsonl_path = 'p.jsonl'", "jsonl"),
    ('kind = "dataset"\npath = "rows.csv"\n', ["task.tool_latency_ms=5"],
     "task.tool_latency_ms = 5", "calculator"),
    ('kind = "calculator"\n', ["task.prompt_key=q"], "task.prompt_key = 'q'", "dataset"),
])
def test_a_key_of_another_task_kind_exits_2_in_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], task: str, overrides: list[str],
    key: str, owner: str
) -> None:
    path = write(tmp_path, GOOD + "\n[task]\n" + task)
    args = [arg for override in overrides for arg in ("--set", override)]
    assert main(["config", "show", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"config error: {key}: not a key of task.kind")
    assert f'only for task.kind = "{owner}"' in err


def test_every_task_kind_decodes_with_its_own_keys(tmp_path: Path) -> None:
    """Each kind's section takes its own keys; a [task] without kind is arithmetic."""
    kinds = {"": {}, 'kind = "longtail"': {}, 'kind = "calculator"': {"tool_latency_ms": 5.0},
             'kind = "jsonl"': {"jsonl_path": "p.jsonl"},
             'kind = "dataset"': {"path": "rows.csv", "prompt_key": "q"}}
    decoded = []
    for kind, own in kinds.items():
        lines = "\n".join(f"{k} = {v!r}".replace("'", '"') for k, v in own.items())
        config = load_config(write(tmp_path, f"{GOOD}\n[task]\n{kind}\n{lines}\n"))
        assert all(getattr(config.task, k) == v for k, v in own.items())
        decoded.append(config.task.kind)
    assert decoded == ["arithmetic", "longtail", "calculator", "jsonl", "dataset"]


@pytest.mark.parametrize("override", ["trainer.mini_batches=3", "trainer.loss_agg=sum",
                                      "trainer.clip_ratio_c=1", "trainer.tis_mode=drop"])
def test_cli_exits_2_naming_a_bad_loss_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str
) -> None:
    assert main(["config", "show", str(write(tmp_path, GOOD)), "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert override.split("=")[0] in err


def test_loss_defaults() -> None:
    trainer = load_config_text("[model]\npath = 'm'\n").trainer
    assert (trainer.mini_batches, trainer.epochs, trainer.clip_ratio_c) == (1, 1, 3.0)
    assert (trainer.advantage_std, trainer.loss_agg, trainer.tis_mode) == (
        "sample", "token_mean", "truncate")
    assert (trainer.clip_low, trainer.clip_high, trainer.tis_cap) == (0.2, 0.28, 2.0)
    four = load_config_text(GOOD, ["trainer.mini_batches=4", "trainer.epochs=2",
                                   "trainer.loss_agg=seq_mean_token_sum_norm"]).trainer
    assert (four.mini_batches, four.epochs, four.loss_agg) == (4, 2, "seq_mean_token_sum_norm")


def test_cli_show_prints_resolved_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "show", str(write(tmp_path, GOOD)), "--set", "trainer.lr=0.5"]) == 0
    out = capsys.readouterr().out
    assert "lr = 0.5" in out
    assert msgspec.convert(
        __import__("tomllib").loads(out), Config
    ).trainer.lr == pytest.approx(0.5)


def test_every_field_is_documented() -> None:
    for section in msgspec.structs.fields(Config):
        # [task] is one section per task.kind: each of them.
        for section_type in typing.get_args(section.type) or (section.type,):
            # Each section lives beside its component: read the file that defines it.
            source = Path(inspect.getsourcefile(section_type) or "").read_text()
            for field in msgspec.structs.fields(section_type):
                after = source.split(f"    {field.name}: ", 1)[1].splitlines()[1].strip()
                assert after.startswith('"""'), f"{section.name}.{field.name} has no docstring"


def test_train_without_a_model_exits_2_naming_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, GOOD.replace("runs/tiny-model", str(tmp_path / "nope")))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.path" in err and "make-model" in err


def test_train_with_a_malformed_prompt_file_exits_2_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": oops}\n')
    path = write(tmp_path, f'[model]\npath = "{model}"\n[task]\nkind = "jsonl"\n'
                           f'jsonl_path = "{prompts}"\n')
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "p.jsonl:2" in err


def model_dir(tmp_path: Path, config_json: str = '{"model_type": "qwen2"}') -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(config_json)
    return model


def test_train_with_a_config_json_that_is_not_a_model_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = model_dir(tmp_path, '{"hello": 1}')
    path = write(tmp_path, f'[model]\npath = "{model}"\n[run]\noutput_dir = "{tmp_path}/r"\n')
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.path" in err and "model_type" in err
    assert not (tmp_path / "r").exists()  # nothing started, nothing written


def test_fsdp2_with_a_model_whose_layers_cannot_be_found_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = model_dir(tmp_path, '{"model_type": "qwen2", "architectures": ["MadeUpLM"]}')
    path = write(tmp_path, f'[model]\npath = "{model}"\n[trainer]\nbackend = "fsdp2"\n'
                           f'[run]\noutput_dir = "{tmp_path}/r"\n')
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trainer.backend" in err and "decoder layers" in err
    assert not (tmp_path / "r").exists()


def test_train_into_an_uncreatable_output_dir_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("not a directory")
    model = model_dir(tmp_path)
    path = write(tmp_path, f'[model]\npath = "{model}"\n'
                           f'[run]\noutput_dir = "{tmp_path}/file/run"\n')
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run.output_dir" in err and "cannot create" in err


def test_train_into_an_earlier_run_refuses_without_resume_or_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = model_dir(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.toml").write_text("# an earlier run")
    (out / "metrics.jsonl").write_text("{}\n")
    path = write(tmp_path, f'[model]\npath = "{model}"\n[run]\noutput_dir = "{out}"\n')
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--resume" in err and "--overwrite" in err
    assert (out / "metrics.jsonl").read_text() == "{}\n"  # untouched


def test_resume_needs_a_run_directory_with_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    path = write(tmp_path, GOOD)
    assert main(["train", str(path), "--resume", str(tmp_path)]) == 2
    assert "not both" in capsys.readouterr().err


EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.toml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_configs_are_valid(example: Path) -> None:
    assert load_config(example).run.num_steps >= 1


@pytest.mark.parametrize(("architecture", "shardable"),
                         [("Qwen2ForCausalLM", True), ("NoSuchForCausalLM", False)])
def test_fsdp2_needs_a_model_whose_decoder_layers_are_named(
    tmp_path: Path, architecture: str, shardable: bool
) -> None:
    import json

    from async_rl.run.inputs import check_shardable

    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen2", "architectures": [architecture]}))
    if shardable:
        check_shardable(str(tmp_path))
        return
    with pytest.raises(ConfigError) as info:
        check_shardable(str(tmp_path))
    message = str(info.value)
    assert "\n" not in message and message.startswith("config error: trainer.backend")
