"""Benchmark: a weight version delivered to 1, 2 and 4 real vLLM CPU engines, the old
pairwise path against the collective, side by side in one run, against memcpy.

Builds a random-init Qwen2-architecture model locally (``--size``: tiny 0.5M, small 4M
or 100m parameters, float32, the project's byte-level tokenizer; nothing is downloaded),
starts a real Ray with as many ``RolloutWorker`` engines as the largest ``--engines``
(the vLLM CPU build, ``--kv-cache-gib`` each, on cores 0 and 1 in turn) and a sender
actor on core 1 that plays trainer shard 0 (``workers.weights.sender.WeightSender``,
what the trainer runs), then, for each engine count N, alternates the two paths
``--updates`` times each (ABBA):

- collective: what a run does now: one broadcast group of the sender and the N engines,
  one collective per version (``weights.transport`` "gloo", ``weights.shared_memory``:
  the engines, all on the sender's machine, read the version from one shared-memory
  segment the sender writes once, in ``--bucket-mb`` buckets);
- chain: the same group without shared memory (``weights.shared_memory = false``, what
  engines on other machines get): a pipelined chain over TCP, each engine forwarding
  every bucket to the next;
- pairwise: the path before: one group per engine (a ``WeightSender`` with one member
  each, over TCP), the N sends started at once from the sender, as shard 0 did.

Reported per path and N (medians over the updates): the wire time of a version (from
the first byte sent, once every engine is in its receive, until the last engine holds
every byte: the gloo data plane stamps both on the machine's clock), the whole
delivery (the sender's send: pausing the engines, their calls into vLLM, the wire,
their loads, resuming), the engines' load time and pause (each engine stands still for
its receive plus its load), and bytes/s: the bytes delivered (N copies of the model)
over the wire time and one model over the wire time, each against memcpy (one thread
copying a tensor of the model's size). The groups are rebuilt before every version
(the engines join the other paths' groups in between); that is not in the wire time.
Also the wire alone: the same broadcast between bare processes on the same cores
(``workers.weights.bucket_transfer``, no engine, nothing loaded), over shared memory
and over the chain.

    python -m bench.weights.weight_broadcast --engines 1,2,4 [--updates 4] [--size tiny]
                                     [--bucket-mb 1] [--kv-cache-gib 1] [--json]

The last line reads ``weight_broadcast: collective 4/1 engines R1, pairwise 4/1 engines
R2`` (wire time with the most engines over that with the fewest, each path).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from bench.common.quiet_stdout import stdout_to_stderr

SHAPES = {
    "tiny": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
             "intermediate_size": 512},
    "small": {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
              "intermediate_size": 1024},
    "100m": {"hidden_size": 768, "num_layers": 16, "num_heads": 12, "num_kv_heads": 4,
             "intermediate_size": 2048},
}
"""The tiny and small models' shapes (``async_rl.models.tiny_model``), and a 100M one."""
PATHS = ("collective", "chain", "pairwise")


class PathFigures(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    engines: int
    wire_ms: float
    """From the first byte sent until the last engine held every byte (median)."""
    delivery_ms: float
    """The sender's whole send of a version: pause, calls, wire, loads, resume (median)."""
    load_ms: float
    """An engine's load of the version once it holds it (median over engines)."""
    engine_paused_ms: float
    """An engine's receive plus load: it sampled nothing for this long (median)."""
    delivered_mb_s: float
    """N copies of the model over the wire time."""
    link_mb_s: float
    """One model over the wire time: what each link carried per second."""
    delivered_vs_memcpy: float
    link_vs_memcpy: float


class Figures(msgspec.Struct, frozen=True, kw_only=True):
    parameters: int
    model_mb: float
    bucket_mb: int
    updates: int
    memcpy_mb_s: float
    paths: list[PathFigures]
    ratios: dict[str, float]
    """Per path: wire time with the most engines over that with the fewest."""
    bare_wire_ms: dict[str, dict[int, float]]
    """The wire alone, per way ("shared", "chain") and engine count: bare processes."""


def memcpy_mb_s(num_bytes: int) -> float:
    import torch

    torch.set_num_threads(1)
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):  # the first copy also faults dst's pages in
        began = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - began)
    return num_bytes / best / 1e6


def build_model(out: Path, size: str) -> int:
    import torch
    from transformers import Qwen2ForCausalLM

    from async_rl.models.tiny_model import build_config, build_tokenizer

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(build_config(**SHAPES[size]))
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- the wire alone


def bare_end(rank: int, size: int, port: int, num_bytes: int, bucket_bytes: int,
             repeats: int, segment: tuple[str, int, str] | None, spans: Any) -> None:
    """One member of a bare broadcast, in its own process (rank 0 on core 1, the others
    on cores 0 and 1 in turn, as the engines): no vLLM, nothing loaded. ``segment``
    (path, bytes, token): every receiver is local and reads it; None: the chain."""
    import os

    import torch

    from workers.weights.bucket_transfer import (
        broadcast_group,
        join_store,
        receive_buckets,
        receive_local,
        send_buckets,
    )
    from workers.weights.shared_segment import SharedSegment

    os.sched_setaffinity(0, {1 if rank == 0 else (rank - 1) % 2})
    torch.set_num_threads(1)
    mapped = SharedSegment.open(*segment) if segment is not None else None
    group = broadcast_group(join_store("127.0.0.1", port, 60.0), rank, size, 60.0)
    tensors = [torch.ones(num_bytes // 4)]
    specs = [((num_bytes // 4,), torch.float32)]
    local = list(range(1, size)) if mapped is not None else []
    for _ in range(repeats):
        group.barrier().wait()
        if rank == 0:
            spans.put(send_buckets(group, tensors, bucket_bytes, 60.0, local=local,
                                   segment=mapped))
        elif mapped is not None:
            receive_local(group, mapped, specs, bucket_bytes, 60.0)
        else:
            for _ in receive_buckets(group, specs, bucket_bytes, 60.0):
                pass


def bare_wire_ms(count: int, num_bytes: int, bucket_bytes: int, repeats: int,
                 shared: bool) -> float:
    """Median wire time of a broadcast to ``count`` bare receivers (first one off), all
    reading shared memory (``shared``) or in the chain."""
    import multiprocessing

    from workers.weights.bucket_plan import plan_buckets, segment_layout
    from workers.weights.bucket_transfer import host_store
    from workers.weights.shared_segment import SharedSegment

    store = host_store("127.0.0.1", 60.0)  # every member joins it as a client
    segment = (SharedSegment.create(segment_layout(plan_buckets([num_bytes], bucket_bytes))[1])
               if shared else None)
    where = (str(segment.path), segment.nbytes, segment.token.hex()) if segment else None
    spawn = multiprocessing.get_context("spawn")
    spans = spawn.Queue()
    ends = [spawn.Process(target=bare_end, args=(rank, count + 1, store.port, num_bytes,
                                                 bucket_bytes, repeats + 1, where, spans))
            for rank in range(count + 1)]
    for end in ends:
        end.start()
    rows = [spans.get(timeout=300) for _ in range(repeats + 1)]
    for end in ends:
        end.join()
    if segment is not None:
        segment.unlink()
    return statistics.median(ended - began for began, ended in rows[1:]) * 1e3


# ---------------------------------------------------------------- real engines


class BenchSender:
    """Trainer shard 0's part, on core 1: the model's parameters as the weights, and the
    two ways to deliver a version of them."""

    def __init__(self, model_dir: str, engines: list[Any], bucket_mb: int) -> None:
        import os

        import torch
        from transformers import AutoModelForCausalLM

        from workers.weights.config import WeightsConfig
        from workers.weights.sender import WeightSender

        os.sched_setaffinity(0, {1})
        torch.set_num_threads(1)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        self.named = [(n, p.detach()) for n, p in model.named_parameters()]
        self.engines = engines
        def sender(shared_memory: bool) -> WeightSender:
            weights = WeightsConfig(transport="gloo", bucket_mb=bucket_mb, timeout_s=120.0,
                                    shared_memory=shared_memory)
            return WeightSender(weights, address="127.0.0.1", device=torch.device("cpu"))

        self.collective, self.chain = sender(True), sender(False)
        self.pairs = [sender(False) for _ in engines]

    def deliver(self, path: str, version: int, count: int
                ) -> tuple[float, float, list[Any]]:
        """Version ``version`` to the first ``count`` engines: (wire seconds, delivery
        seconds, timings)."""
        if path == "pairwise":
            senders = [(self.pairs[rank], [rank]) for rank in range(count)]
        else:
            sender = self.collective if path == "collective" else self.chain
            senders = [(sender, list(range(count)))]
        for sender, ranks in senders:
            for rank in ranks:  # (re)joining: the groups are built again at the send
                sender.connect(rank, self.engines[rank])
            sender.snapshot(version, self.named)
        deliveries: list[Any] = [None] * len(senders)

        def send(index: int) -> None:
            sender, ranks = senders[index]
            deliveries[index] = sender.send(version, ranks)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(senders))]
        began = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        delivery = time.perf_counter() - began
        for sender, _ in senders:
            sender.release(version)
        assert all(d is not None and not d.failed for d in deliveries), deliveries
        timings = [t for d in deliveries for t in d.timings]
        assert len(timings) == count, timings
        wire = (max(d.wire_end for d in deliveries) - min(d.wire_start for d in deliveries))
        return wire, delivery, timings


async def run(model_dir: Path, counts: list[int], updates: int, bucket_mb: int,
              kv_cache_gib: int) -> dict[tuple[str, int], list[tuple[float, float, list[Any]]]]:
    import ray

    from workers.model_config import ModelConfig
    from workers.rollout.config import RolloutConfig
    from workers.rollout.spec import RolloutSpec
    from workers.rollout.task import WorkerTask
    from workers.rollout.worker import RolloutWorker
    from workers.weights.config import WeightsConfig

    model = ModelConfig(path=str(model_dir))
    engine_cls = ray.remote(RolloutWorker).options(num_cpus=0, max_concurrency=16)
    engines = [engine_cls.remote(RolloutSpec(
        rank=rank, model=model, weights=WeightsConfig(transport="gloo"),
        rollout=RolloutConfig(group_size=2, max_inflight_prompts=1, kv_cache_gib=kv_cache_gib),
        cpu_ids=(rank % 2,), record_spans=False),
        WorkerTask(reward_fn=lambda prompt, text: 0.0))
        for rank in range(max(counts))]
    # One at a time: four engines starting at once on two cores take longer in all.
    for engine in engines:
        await engine.start.remote()
    sender = ray.remote(BenchSender).options(num_cpus=0).remote(
        str(model_dir), engines, bucket_mb)
    results: dict[tuple[str, int], list[tuple[float, float, list[Any]]]] = {}
    version = 0
    for count in counts:
        for update in range(updates):  # ABC CBA: drift on a shared machine hits all
            for path in PATHS if update % 2 == 0 else PATHS[::-1]:
                version += 1
                results.setdefault((path, count), []).append(
                    await sender.deliver.remote(path, version, count))
    for engine in engines:
        await engine.shutdown.remote()
    return results


def summarise(path: str, count: int, rows: list[tuple[float, float, list[Any]]],
              num_bytes: int, memcpy: float) -> PathFigures:
    wire = statistics.median(w for w, _, _ in rows)
    delivery = statistics.median(d for _, d, _ in rows)
    timings = [t for _, _, ts in rows for t in ts]
    load = statistics.median(t.load_s for t in timings)
    paused = statistics.median(t.transfer_s + t.load_s for t in timings)
    mb = num_bytes / 1e6
    return PathFigures(
        path=path, engines=count, wire_ms=wire * 1e3, delivery_ms=delivery * 1e3,
        load_ms=load * 1e3,
        engine_paused_ms=paused * 1e3, delivered_mb_s=count * mb / wire,
        link_mb_s=mb / wire, delivered_vs_memcpy=count * mb / wire / memcpy,
        link_vs_memcpy=mb / wire / memcpy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="1,2,4",
                        help="engine counts, comma-separated (the ratio: last over first)")
    parser.add_argument("--updates", type=int, default=4, help="versions per path and count")
    parser.add_argument("--size", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--bucket-mb", type=int, default=1, help="weights.bucket_mb")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="each engine's KV cache")
    parser.add_argument("--json", action="store_true", help="one JSON object, then the line")
    args = parser.parse_args()
    counts = sorted({int(c) for c in args.engines.split(",")})
    if counts[0] < 1:
        parser.error("--engines: counts of at least 1")

    import ray

    with stdout_to_stderr(args.json), \
            tempfile.TemporaryDirectory(prefix="async-rl-bench-") as root:
        model_dir = Path(root) / "model"
        parameters = build_model(model_dir, args.size)
        num_bytes = parameters * 4  # float32
        memcpy = memcpy_mb_s(num_bytes)
        bare = {way: {count: bare_wire_ms(count, num_bytes, args.bucket_mb << 20,
                                          args.updates, way == "shared")
                      for count in counts}
                for way in ("shared", "chain")}
        # A Ray of its own; this script's classes travel to the actors by value.
        ray.init(address="local", num_cpus=2, include_dashboard=False)
        try:
            results = asyncio.run(run(model_dir, counts, args.updates, args.bucket_mb,
                                      args.kv_cache_gib))
        finally:
            ray.shutdown()
    paths = [summarise(path, count, results[path, count], num_bytes, memcpy)
             for count in counts for path in PATHS]
    wire = {(p.path, p.engines): p.wire_ms for p in paths}
    ratios = {path: wire[path, counts[-1]] / wire[path, counts[0]] for path in PATHS}
    figures = Figures(parameters=parameters, model_mb=num_bytes / 1e6,
                      bucket_mb=args.bucket_mb, updates=args.updates, memcpy_mb_s=memcpy,
                      paths=paths, ratios=ratios, bare_wire_ms=bare)
    if args.json:
        print(msgspec.json.encode(figures).decode())
    else:
        print(f"{parameters / 1e6:.2f}M parameters, {num_bytes / 1e6:.1f} MB float32, "
              f"{args.bucket_mb} MiB buckets; memcpy {memcpy:.0f} MB/s (1 thread); "
              f"{args.updates} versions per path and engine count (ABC CBA)")
        print("path        engines  wire ms  delivery ms  load ms  paused ms  delivered MB/s"
              " (x memcpy)  per link MB/s (x memcpy)")
        for p in paths:
            print(f"{p.path:<11} {p.engines:>7} {p.wire_ms:>8.2f} {p.delivery_ms:>12.1f} "
                  f"{p.load_ms:>8.1f} {p.engine_paused_ms:>10.1f} {p.delivered_mb_s:>9.0f} "
                  f"({p.delivered_vs_memcpy:.3f}) {p.link_mb_s:>13.0f} ({p.link_vs_memcpy:.3f})")
        for way, by_count in bare.items():
            print(f"wire alone, {way} (bare processes on the same cores, no engine): "
                  + ", ".join(f"{count} engines {ms:.2f} ms" for count, ms in by_count.items()))
        print(f"chain (no shared memory) {counts[-1]}/{counts[0]} engines "
              f"{ratios['chain']:.2f}")
    print(f"weight_broadcast: collective {counts[-1]}/{counts[0]} engines "
          f"{ratios['collective']:.2f}, pairwise {counts[-1]}/{counts[0]} engines "
          f"{ratios['pairwise']:.2f}")


if __name__ == "__main__":
    main()
