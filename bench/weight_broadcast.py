"""Benchmark: weight broadcast of a ~100M-parameter state, the old path against the new,
in one run, against this machine's memcpy bandwidth.

Builds a random-init Qwen2-architecture model locally (about 100M parameters, float32,
the project's byte-level tokenizer; nothing is downloaded), starts a real Ray with one
``TrainerShard`` (core 1) and one ``RolloutWorker`` (core 0, the vLLM CPU build) and
alternates the two paths, ``--updates`` times each:

- new: what a run does (``workers.weights.broadcast.WeightBroadcast``): trainer shard 0 snapshots
  its parameters, then sends them through vLLM's weight-transfer API over the "gloo"
  backend (``weights.transport``) in ``--bucket-mb`` buckets; the engine pauses
  (``--mode``), receives and loads each bucket, relabels, resumes.
- old: the path the product had before, rebuilt here since the product dropped it:
  safetensors bytes of the state (trainer) -> Ray object store -> the rollout actor writes
  them to a file in /dev/shm -> pause -> ``collective_rpc`` with a callable that reads the
  file and runs the worker's ``reload_weights`` -> relabel -> resume.

Reported per path (medians over the updates): publish (trainer: snapshot or serialise),
transfer (new: engine paused, bytes moving into the model; old: object store fetch and
file write, before the pause), load (the rest of the engine's pause), the engine's pause
per update, and MB/s of the transfer and end to end (publish to resumed), each against
memcpy: one thread copying a tensor of the state's size (torch), best of 5, and all
threads for reference. Also the wire alone: the same tensors sent over a gloo pair
group between two bare processes on the same two cores (``workers.weights.bucket_transfer``,
no model, nothing loaded), which bounds what the new path's transfer can reach.

    python bench/weight_broadcast.py [--updates 5] [--bucket-mb 16] [--mode in_flight]
                                     [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
from quiet_stdout import stdout_to_stderr

SHAPE = {"hidden_size": 768, "num_layers": 16, "num_heads": 12, "num_kv_heads": 4,
         "intermediate_size": 2048}
"""About 100M parameters (the embedding is small: the byte-level vocabulary)."""


class PathFigures(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    publish_ms: float
    transfer_ms: float
    load_ms: float
    engine_paused_ms: float
    """The engine sampled nothing for this long per update."""
    end_to_end_ms: float
    """From the trainer starting to publish until the engine resumed on the new weights."""
    transfer_mb_s: float
    end_to_end_mb_s: float
    transfer_vs_memcpy: float
    end_to_end_vs_memcpy: float


class Figures(msgspec.Struct, frozen=True, kw_only=True):
    parameters: int
    state_mb: float
    bucket_mb: int
    mode: str
    updates: int
    memcpy_mb_s: float
    """One thread, a tensor of the state's size."""
    memcpy_all_threads_mb_s: float
    wire_mb_s: float
    """The gloo pair group alone, core 1 to core 0 (median of the updates, after one)."""
    paths: list[PathFigures]
    pause_minus_transfer_ms: float
    """New path: engine pause per update minus its transfer time (target <= 20 ms)."""


def memcpy_mb_s(num_bytes: int, threads: int) -> float:
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):  # the first copy also faults dst's pages in
        began = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - began)
    return num_bytes / best / 1e6


def build_model(out: Path) -> int:
    import torch
    from transformers import Qwen2ForCausalLM

    from async_rl.models.tiny_model import build_config, build_tokenizer

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(build_config(**SHAPE))
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- the wire alone


def wire_end(rank: int, port: int, specs: list[tuple[list[int], Any]], bucket_bytes: int,
             repeats: int, seconds: Any) -> None:
    """One end of the bare transfer, in its own process: rank 0 (the trainer's core 1)
    sends, rank 1 (the engine's core 0) receives and records each transfer's time."""
    import torch

    from workers.weights.bucket_transfer import (
        join_store,
        pair_group,
        receive_buckets,
        send_buckets,
    )

    os.sched_setaffinity(0, {1 if rank == 0 else 0})
    torch.set_num_threads(1)
    group = pair_group(join_store("127.0.0.1", port, 60.0), rank, 60.0)
    tensors = [torch.ones(shape, dtype=dtype) for shape, dtype in specs] if rank == 0 else []
    for _ in range(repeats):
        if rank == 0:
            send_buckets(group, tensors, bucket_bytes, 60.0)
            continue
        began = time.perf_counter()
        for _ in receive_buckets(group, specs, bucket_bytes, 60.0):
            pass
        seconds.put(time.perf_counter() - began)


def wire_mb_s(model_dir: Path, bucket_bytes: int, repeats: int) -> float:
    """Median MB/s of the bare gloo transfer of the model's parameters (first one off)."""
    import multiprocessing

    from transformers import AutoModelForCausalLM

    from workers.weights.bucket_transfer import host_store

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    specs = [(list(p.shape), p.dtype) for p in model.parameters()]
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    store = host_store("127.0.0.1", 60.0)  # both ends join it as clients
    spawn = multiprocessing.get_context("spawn")
    seconds = spawn.Queue()
    ends = [spawn.Process(target=wire_end, args=(rank, store.port, specs, bucket_bytes,
                                                 repeats + 1, seconds)) for rank in (0, 1)]
    for end in ends:
        end.start()
    times = [seconds.get(timeout=600) for _ in range(repeats + 1)]
    for end in ends:
        end.join()
    return num_bytes / statistics.median(times[1:]) / 1e6


# ---------------------------------------------------------------- the old path


def old_publish(shard: Any) -> bytes:
    """The trainer's end of the old path: safetensors bytes, in checkpoint names."""
    import safetensors.torch

    state = {name: t.detach().to("cpu").contiguous()
             for name, t in shard.module.state_dict().items()}
    if shard.module.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses aliased tensors
    return safetensors.torch.save(state)


def load_from_file(worker: Any, path: str) -> None:
    """Runs in vLLM's worker process (collective_rpc with a callable): the old loader."""
    from safetensors.torch import load_file

    state = load_file(path, device="cpu")
    worker.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)
    model = worker.model_runner.get_model()
    head = model.lm_head  # tied: re-pack the CPU kernel's copy of the new embedding
    head.quant_method.process_weights_after_loading(head)


def bench_rollout_class() -> type:
    from buffers.records import BroadcastTiming
    from workers.rollout.worker import RolloutWorker

    class BenchRolloutWorker(RolloutWorker):
        """The product's rollout worker plus the old update path (reaches into its
        engine and version label, as the removed code did from inside)."""

        async def old_update(self, version: int, state: bytes, published_at: float,
                             mode: str) -> BroadcastTiming:
            engine = self._ready()
            path = Path("/dev/shm") / f"async_rl-bench-v{version}.safetensors"
            try:
                await asyncio.to_thread(path.write_bytes, state)
                transfer_s = time.time() - published_at
                began = time.perf_counter()
                await engine.engine_core.pause_scheduler_async(
                    mode="wait" if mode == "drain" else "keep", clear_cache=False)
                paused = time.perf_counter()
                await engine.collective_rpc(load_from_file, args=(str(path),))
                await engine.update_weight_version(str(version))
                self._receiver.version = version
                await engine.resume_generation()
                loaded = time.perf_counter()
            finally:
                path.unlink(missing_ok=True)
            return BroadcastTiming(version=version, rollout_rank=0, publish_s=0.0,
                                   transfer_s=transfer_s, pause_s=paused - began,
                                   load_s=loaded - paused)

    return BenchRolloutWorker


# ---------------------------------------------------------------- the run


async def run(model_dir: Path, updates: int, bucket_mb: int, mode: str
              ) -> dict[str, list[tuple[float, Any, float]]]:
    """Per path: (publish_s, BroadcastTiming, end_to_end_s) per update."""
    import ray

    from workers.model_config import ModelConfig
    from workers.rollout.config import RolloutConfig
    from workers.trainer.config import TrainerConfig
    from workers.trainer.shard import TrainerShard
    from workers.weights.broadcast import SEND_GROUP, WeightBroadcast
    from workers.weights.config import WeightsConfig

    weights = WeightsConfig(update_mode=mode, transport="gloo",  # type: ignore[arg-type]
                            bucket_mb=bucket_mb)
    model = ModelConfig(path=str(model_dir))
    trainer = ray.remote(concurrency_groups={SEND_GROUP: 1})(TrainerShard).options(
        num_cpus=1).remote(rank=0, world_size=1, model=model, trainer=TrainerConfig(),
                           seed=0, weights=weights, cpu_ids=(1,))
    # collective_rpc with a callable (the old path's loader) needs vLLM's pickle fallback.
    insecure = {"env_vars": {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}}
    rollout = ray.remote(bench_rollout_class()).options(
        num_cpus=1, max_concurrency=16, runtime_env=insecure).remote(
        rank=0, model=model,
        rollout=RolloutConfig(group_size=2, max_inflight_prompts=1, kv_cache_gib=1),
        weights=weights, reward_fn=lambda prompt, text: 0.0, cpu_ids=(0,))
    await asyncio.gather(trainer.setup.remote(), rollout.start.remote())
    await trainer.connect_rollout.remote(0, rollout)
    broadcast = WeightBroadcast(trainer, {0: rollout})
    results: dict[str, list[tuple[float, Any, float]]] = {"old": [], "new": []}
    version = 0
    for _ in range(updates):  # alternating, so drift on a shared machine hits both
        version += 1
        began = time.perf_counter()
        ref = trainer.__ray_call__.remote(old_publish)
        await asyncio.to_thread(ray.wait, [ref], fetch_local=False)
        publish_s = time.perf_counter() - began
        timing = await rollout.old_update.remote(version, ref, time.time(), mode)
        results["old"].append((publish_s, timing, time.perf_counter() - began))
        del ref

        version += 1
        began = time.perf_counter()
        published = await broadcast.publish(version)
        (timing,), failed = await broadcast.deliver(published)
        assert not failed
        results["new"].append((published.publish_s, timing, time.perf_counter() - began))
    await rollout.shutdown.remote()
    await trainer.shutdown.remote()
    return results


def summarise(path: str, rows: list[tuple[float, Any, float]], num_bytes: int,
              memcpy: float) -> PathFigures:
    def median_ms(values: list[float]) -> float:
        return statistics.median(values) * 1e3

    publish = median_ms([p for p, _, _ in rows])
    transfer = median_ms([t.transfer_s for _, t, _ in rows])
    load = median_ms([t.load_s for _, t, _ in rows])
    # New path: the pause spans transfer and load; old: only the load from the file.
    paused = median_ms([(t.transfer_s if path == "new" else 0.0) + t.load_s
                        for _, t, _ in rows])
    end_to_end = median_ms([e for _, _, e in rows])
    mb = num_bytes / 1e6
    return PathFigures(
        path=path, publish_ms=publish, transfer_ms=transfer, load_ms=load,
        engine_paused_ms=paused, end_to_end_ms=end_to_end,
        transfer_mb_s=mb / (transfer / 1e3), end_to_end_mb_s=mb / (end_to_end / 1e3),
        transfer_vs_memcpy=mb / (transfer / 1e3) / memcpy,
        end_to_end_vs_memcpy=mb / (end_to_end / 1e3) / memcpy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=5, help="updates per path")
    parser.add_argument("--bucket-mb", type=int, default=16, help="weights.bucket_mb")
    parser.add_argument("--mode", choices=("in_flight", "drain"), default="in_flight")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()

    import ray

    with stdout_to_stderr(args.json), \
            tempfile.TemporaryDirectory(prefix="async-rl-bench-") as root:
        model_dir = Path(root) / "model"
        parameters = build_model(model_dir)
        num_bytes = parameters * 4  # float32
        memcpy = memcpy_mb_s(num_bytes, threads=1)
        memcpy_all = memcpy_mb_s(num_bytes, threads=os.cpu_count() or 1)
        wire = wire_mb_s(model_dir, args.bucket_mb << 20, args.updates)
        # A Ray of its own (not one another process runs); this script's functions
        # travel to the actors by value (it is __main__).
        ray.init(address="local", num_cpus=2, include_dashboard=False,
                 object_store_memory=4 * num_bytes)
        try:
            results = asyncio.run(run(model_dir, args.updates, args.bucket_mb, args.mode))
        finally:
            ray.shutdown()
    paths = [summarise(path, rows, num_bytes, memcpy) for path, rows in results.items()]
    new = paths[1]
    figures = Figures(parameters=parameters, state_mb=num_bytes / 1e6,
                      bucket_mb=args.bucket_mb, mode=args.mode, updates=args.updates,
                      memcpy_mb_s=memcpy, memcpy_all_threads_mb_s=memcpy_all,
                      wire_mb_s=wire, paths=paths,
                      pause_minus_transfer_ms=new.engine_paused_ms - new.transfer_ms)
    if args.json:
        print(msgspec.json.encode(figures).decode())
        return
    print(f"{parameters / 1e6:.1f}M parameters, {num_bytes / 1e6:.0f} MB float32; "
          f"memcpy {memcpy:.0f} MB/s (1 thread), {memcpy_all:.0f} MB/s (all threads); "
          f"{args.updates} updates per path, {args.mode}, {args.bucket_mb} MiB buckets")
    print(f"wire alone (gloo pair, core 1 -> core 0, nothing loaded): {wire:.0f} MB/s, "
          f"{wire / memcpy:.2f}x memcpy")
    for p in paths:
        print(f"{p.path:>4}: publish {p.publish_ms:.0f} ms, transfer {p.transfer_ms:.0f} ms "
              f"({p.transfer_mb_s:.0f} MB/s, {p.transfer_vs_memcpy:.2f}x memcpy), load "
              f"{p.load_ms:.0f} ms; engine paused {p.engine_paused_ms:.0f} ms; end to end "
              f"{p.end_to_end_ms:.0f} ms ({p.end_to_end_mb_s:.0f} MB/s, "
              f"{p.end_to_end_vs_memcpy:.2f}x memcpy)")
    print(f"new path: engine pause - transfer = {figures.pause_minus_transfer_ms:.1f} ms "
          "per update (target <= 20 ms)")


if __name__ == "__main__":
    main()
