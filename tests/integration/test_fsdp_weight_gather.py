"""FSDP2 weight publishing gathers bucket by bucket: two trainer shards in processes of
their own (gloo on CPU, no Ray, no engine) publish a version of a 4M-parameter model in
1 MiB buckets; shard 0's snapshot holds exactly the whole weights, and the gathered
bytes alive at any bucket never exceed about two buckets (the whole model is 16)."""

from __future__ import annotations

import multiprocessing
import socket
import weakref
from pathlib import Path
from typing import Any

import pytest

BUCKET_MB = 1
SHAPE = {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
         "intermediate_size": 1024}
"""The small model's shape (about 4M parameters, 16 MB in float32)."""


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import Qwen2ForCausalLM

    from async_rl.models.tiny_model import build_config, build_tokenizer

    out = tmp_path_factory.mktemp("small-model")
    torch.manual_seed(0)
    Qwen2ForCausalLM(build_config(**SHAPE)).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def publish(rank: int, port: int, model_dir: str, out: Any) -> None:
    """One shard's process: builds the sharded policy and publishes version 1 through
    the real snapshot path, counting the gathered bytes alive at each bucket."""
    import torch

    import workers.trainer.publisher as publisher_module
    from workers.model_config import ModelConfig
    from workers.trainer.config import TrainerConfig
    from workers.trainer.fsdp import full_state, gather_buckets
    from workers.trainer.shard import TrainerShard
    from workers.trainer.spec import TrainerSpec
    from workers.weights.config import WeightsConfig

    torch.set_num_threads(1)
    alive, peak, buckets = [0], [0], [0]

    def freed(nbytes: int) -> None:
        alive[0] -= nbytes

    def counted(module: torch.nn.Module, bucket_bytes: int) -> Any:
        for bucket in gather_buckets(module, bucket_bytes):
            for _, tensor in bucket:
                nbytes = tensor.numel() * tensor.element_size()
                alive[0] += nbytes
                weakref.finalize(tensor, freed, nbytes)
            peak[0] = max(peak[0], alive[0])
            buckets[0] += 1
            yield bucket

    publisher_module.gather_buckets = counted  # the publisher's own call, counted
    shard = TrainerShard(TrainerSpec(
        rank=rank, world_size=2, model=ModelConfig(path=model_dir),
        trainer=TrainerConfig(backend="fsdp2", num_shards=2),
        weights=WeightsConfig(bucket_mb=BUCKET_MB), seed=0, master_port=port, record_spans=False))
    shard.setup()
    if rank == 0:
        shard.connect_rollout(0, None)  # the sender; no member is sent to here
    published = shard.snapshot_weights(1)
    whole = full_state(shard.module)  # the reference: gathered at once
    result: dict[str, Any] = {"rank": rank, "published": published, "peak": peak[0],
                              "buckets": buckets[0]}
    if rank == 0:
        assert shard.sender is not None
        snapshot = dict(shard.sender._snapshots[1])
        names = [name for name, _ in shard.module.named_parameters()]
        result["whole_bytes"] = sum(whole[n].numel() * whole[n].element_size()
                                    for n in names)
        result["same"] = (list(snapshot) == names
                          and all(torch.equal(snapshot[n], whole[n]) for n in names))
        result["largest"] = max(whole[n].numel() * whole[n].element_size() for n in names)
    shard.shutdown()
    out.put(result)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_fsdp2_publishes_bucket_by_bucket_without_a_second_whole_copy(
        small_model_dir: Path) -> None:
    spawn = multiprocessing.get_context("spawn")
    out = spawn.Queue()
    port = free_port()
    shards = [spawn.Process(target=publish, args=(rank, port, str(small_model_dir), out))
              for rank in range(2)]
    for shard in shards:
        shard.start()
    results = {r["rank"]: r for r in (out.get(timeout=240) for _ in shards)}
    for shard in shards:
        shard.join(timeout=60)
    assert sorted(results) == [0, 1]
    zero, other = results[0], results[1]
    # The bytes delivered are the whole weights', exactly.
    assert zero["same"] is True
    assert zero["published"] == zero["whole_bytes"] > 15e6
    assert other["published"] == 0 and other["buckets"] == 0  # it took part, holds none
    # Many buckets, of which at most about two were ever alive at once.
    bucket = max(BUCKET_MB << 20, zero["largest"])
    assert zero["buckets"] >= 10
    assert bucket <= zero["peak"] <= 2 * bucket, zero
    print(f"fsdp2 publish: {zero['buckets']} buckets, peak gathered-but-not-copied "
          f"{zero['peak'] / 1e6:.2f} MB of {zero['whole_bytes'] / 1e6:.1f} MB")
