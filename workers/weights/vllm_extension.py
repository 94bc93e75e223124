"""What this project adds to vLLM's worker process.

Owns: ``WorkerExtension``, the mix-in vLLM grafts onto its worker class when the engine
is built with ``worker_extension_cls="workers.weights.vllm_extension.WorkerExtension"``, and
through its import the "gloo" weight-transfer backend: vLLM imports this module in the
worker process before it builds the worker's weight-transfer engine, and importing
``workers.weights.gloo_transfer`` registers the backend with vLLM's factory there.

The mix-in owns the worker process's LoRA adapter (``serve_adapter``: with model.lora on,
each weight version arrives as adapter tensors and replaces the one adapter the engine
serves, in place) and its idle wait: ``watch_idle_reads`` (once, after the
engine is built) and ``stop_spinning`` (whenever the rollout worker has nothing in
flight); see ``stop_spinning`` for why vLLM spins and what these change.

It runs in the engine's worker process, imported by dotted path, so it imports only
torch-side libraries that the worker has anyway.
"""

from __future__ import annotations

import gc
import math
import os
from typing import Any

# Imported for its registration of the "gloo" backend (see the module docstring).
import workers.weights.gloo_transfer  # noqa: F401


class WorkerExtension:
    """Mixed into vLLM's worker class."""

    # Set by watch_idle_reads: this process's shared-memory queue readers.
    _idle_readers: list[Any]

    def watch_idle_reads(self, recheck_ms: int) -> int:
        """Finds this process's shared-memory queue readers for ``stop_spinning`` and caps
        their blocking wait at ``recheck_ms``; returns how many readers it found.

        Raises RuntimeError when vLLM's ``shm_broadcast`` no longer looks as this code
        expects (fail at engine start rather than spin unnoticed).
        """
        from vllm.distributed.device_communicators import shm_broadcast

        spin_cls = getattr(shm_broadcast, "SpinCondition", None)
        recheck = getattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", None)
        # The worker's reader of the engine core's scheduler outputs (its rpc_broadcast_mq)
        # is a SpinCondition that the worker holds no reference to; find it by type.
        readers = [obj for obj in gc.get_objects()
                   if spin_cls is not None and type(obj) is spin_cls
                   and getattr(obj, "is_reader", False)]
        if (not isinstance(recheck, int) or not readers
                or not all(hasattr(r, "last_read") and hasattr(r, "busy_loop_s")
                           for r in readers)):
            raise RuntimeError(
                "vLLM's shm_broadcast internals changed (SpinCondition readers with "
                "last_read/busy_loop_s, SHM_READER_RECHECK_INTERVAL_MS): update "
                f"workers/weights/vllm_extension.py (found {len(readers)} readers, "
                f"recheck {recheck!r})")
        # Read at every wait (ReadTimeoutWithWarnings.timeout_ms), so this takes effect now.
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = recheck_ms
        self._idle_readers = readers
        return len(readers)

    def serve_adapter(self, adapter_dir: str) -> None:
        """Makes the gloo backend hand adapter versions to ``_load_adapter``: written
        into ``adapter_dir`` (the folder every request's ``LoRARequest`` names) and
        loaded in place, under the same adapter id, so requests in flight go on with the
        new adapter from their next token, as they do with new weights. (vLLM's worker
        then drops its adapters after any weight update, ``reset_lora_state``, and the
        next step loads the adapter again from the folder: the new version either way.)"""
        engine: Any = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "adapter_loader"):
            raise RuntimeError("LoRA versions need the gloo weight-transfer backend "
                               f"(found {type(engine).__name__})")
        engine.adapter_loader = lambda staged: self._load_adapter(adapter_dir, staged)

    def _load_adapter(self, adapter_dir: str, staged: list[tuple[str, Any]]) -> None:
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        from workers.weights.adapter import WEIGHTS_FILE, policy_lora_request

        path = os.path.join(adapter_dir, WEIGHTS_FILE)
        # Copies: the staged tensors are views of the transfer's buckets.
        save_file({name: t.clone() for name, t in staged}, path + ".tmp")
        os.replace(path + ".tmp", path)
        request: LoRARequest = policy_lora_request(adapter_dir, reload=True)
        self.add_lora(request)  # type: ignore[attr-defined]  # the worker's own method

    def stop_spinning(self) -> None:
        """Makes this process's queue readers block now instead of spinning.

        vLLM's reader of the scheduler-output queue spins (``sched_yield()`` in a loop,
        a full core) for ``busy_loop_s`` = 1 s after every read before it blocks on a zmq
        notification (``SpinCondition.wait``); no setting changes that. Steps and weight
        loads come more often than once a second, so an idle rollout worker never blocks.
        The spin itself is worth keeping while generating: the next scheduler output
        arrives within a step, and both a shorter ``busy_loop_s`` (shorter than a step,
        so every step blocks) and blocking cost generation time on a busy core. So the
        rollout worker calls this only once it has nothing in flight: the reader's last
        read is moved to the far past, so its next wait blocks; the next read (work
        arriving) restarts the spin. vLLM's notifications can be dropped (the writer's
        PUB socket has a high-water mark of 1), which is why its blocking wait re-checks
        the queue every ``SHM_READER_RECHECK_INTERVAL_MS`` (5 s there; ``watch_idle_reads``
        lowers it, bounding what a dropped notification costs the first step after idle).
        """
        for reader in self._idle_readers:
            reader.last_read = -math.inf
