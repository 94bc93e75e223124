"""Benchmark: replay-queue throughput through the async API, and memory per queued group.

Throughput: a producer task ``await put(g)`` one group at a time while a consumer task
``await take(B, version)`` batches of B, on a bounded queue (so both sides wait on each
other), for several B, with and without token buckets and bucket-homogeneous takes.
The figure is groups per second through the queue: each counts one put and one take.
A second block runs put-all-then-take-all in one task (no task switches): the queue's
own cost. Memory: bytes the queue itself holds per queued group (tracemalloc), not
counting the group objects, which belong to the caller.

    python -m bench.data.replay_queue            # table
    python -m bench.data.replay_queue --json     # one JSON object
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
from typing import Any

import anyio
import msgspec
from rich.console import Console
from rich.table import Table

from buffers import ReplayQueue

EDGES = (512, 1024, 2048, 4096)


class Group(msgspec.Struct, frozen=True, kw_only=True):
    """What the queue reads from ``buffers.common.records.Group``; the rest is the caller's."""

    prompt_id: str
    min_version: int
    num_tokens: int


def make_groups(n: int) -> list[Group]:
    # Versions advance every 4096 groups, lengths cycle over all buckets.
    return [
        Group(prompt_id=f"p{i}", min_version=i // 4096, num_tokens=64 + (i * 7919) % 8000)
        for i in range(n)
    ]


def new_queue(capacity: int, edges: tuple[int, ...]) -> ReplayQueue[Group]:
    return ReplayQueue(
        max_groups=capacity, max_tokens=10**12, max_staleness=10**6, bucket_edges=edges
    )


async def pipelined(
    groups: list[Group], batch: int, capacity: int, edges: tuple[int, ...], homogeneous: bool
) -> float:
    queue = new_queue(capacity, edges)
    n = len(groups) - len(groups) % batch

    async def producer() -> None:
        for group in groups[:n]:
            await queue.put(group)

    async def consumer() -> None:
        version = groups[n - 1].min_version
        for _ in range(n // batch):
            await queue.take(batch, version, homogeneous=homogeneous)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(producer)
        tg.start_soon(consumer)
    return n / (time.perf_counter() - t0)


async def single_task(groups: list[Group], batch: int, edges: tuple[int, ...]) -> float:
    n = len(groups) - len(groups) % batch
    queue = new_queue(n, edges)
    version = groups[n - 1].min_version
    t0 = time.perf_counter()
    for group in groups[:n]:
        await queue.put(group)
    for _ in range(n // batch):
        await queue.take(batch, version)
    return n / (time.perf_counter() - t0)


def memory_per_group(groups: list[Group], edges: tuple[int, ...]) -> float:
    queue = new_queue(len(groups), edges)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for group in groups:
        queue.put_nowait(group)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / len(groups)


def best_of(repeat: int, fn: Any, *args: Any) -> float:
    return max(anyio.run(fn, *args) for _ in range(repeat))


def run(args: argparse.Namespace) -> dict[str, Any]:
    groups = make_groups(args.groups)
    rows = []
    for edges in ((), EDGES):
        for batch in args.batch:
            for homogeneous in (False, True) if edges else (False,):
                rate = best_of(
                    args.repeat, pipelined, groups, batch, args.capacity, edges, homogeneous
                )
                rows.append(
                    {
                        "mode": "producer+consumer tasks",
                        "buckets": len(edges) + 1,
                        "batch": batch,
                        "homogeneous": homogeneous,
                        "groups_per_s": rate,
                    }
                )
    for edges in ((), EDGES):
        for batch in (1, 64):
            rate = best_of(args.repeat, single_task, groups, batch, edges)
            rows.append(
                {
                    "mode": "one task, put all then take all",
                    "buckets": len(edges) + 1,
                    "batch": batch,
                    "homogeneous": False,
                    "groups_per_s": rate,
                }
            )
    memory = {
        str(len(e) + 1): memory_per_group(groups[: args.memory_groups], e) for e in ((), EDGES)
    }
    group_bytes = len(msgspec.msgpack.encode(groups[0]))
    return {
        "benchmark": "replay_queue",
        "groups": args.groups,
        "capacity": args.capacity,
        "repeat": args.repeat,
        "throughput": rows,
        "queue_bytes_per_group_by_buckets": memory,
        "memory_groups": args.memory_groups,
        "test_group_msgpack_bytes": group_bytes,
    }


def show(result: dict[str, Any]) -> None:
    table = Table(
        title=f"ReplayQueue throughput: {result['groups']} groups, capacity "
        f"{result['capacity']}, best of {result['repeat']} (groups/s = put+take pairs/s)"
    )
    for col in ("mode", "buckets", "take batch", "homogeneous", "groups/s"):
        table.add_column(col, justify="right")
    for r in result["throughput"]:
        table.add_row(
            r["mode"],
            str(r["buckets"]),
            str(r["batch"]),
            "yes" if r["homogeneous"] else "no",
            f"{r['groups_per_s']:,.0f}",
        )
    console = Console()
    console.print(table)
    memory = Table(
        title=f"Queue memory per group ({result['memory_groups']} groups queued, "
        "group objects not counted)"
    )
    memory.add_column("buckets", justify="right")
    memory.add_column("bytes / group", justify="right")
    for buckets, size in result["queue_bytes_per_group_by_buckets"].items():
        memory.add_row(buckets, f"{size:.0f}")
    console.print(memory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--groups", type=int, default=200_000)
    parser.add_argument("--capacity", type=int, default=1024, help="max_groups")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--memory-groups", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        show(result)


if __name__ == "__main__":
    main()
