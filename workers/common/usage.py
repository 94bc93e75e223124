"""Device usage as the operating system and the driver see it, to cross-check the spans.

Owns: reading a worker's process-tree CPU time (psutil; the vLLM engine runs in child
processes, so children count) and, on CUDA, sampling NVML utilisation of the worker's
GPU in a background thread, found by its UUID (``cuda_uuid``). Knows nothing about spans
or what the worker does.
"""

from __future__ import annotations

import threading
import time

import psutil

from buffers.common.reports import UsageReading


def _tree_cpu_seconds(process: psutil.Process) -> float:
    total = 0.0
    for proc in [process, *process.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # a child may exit between listing and reading
            continue
        total += times.user + times.system
    return total


def cuda_uuid(ordinal: int = 0) -> str:
    """NVML's name (``GPU-<uuid>``) of this process's CUDA device ``ordinal``.

    NVML numbers the GPUs physically and ignores ``CUDA_VISIBLE_DEVICES``, so in a worker
    that Ray gave physical GPU 3, CUDA's device 0 is NVML's index 3: an index would
    sample the wrong GPU (GPU 0, for every worker). The UUID names the same device in
    both. Reading it does not create a CUDA context.
    """
    import torch

    return f"GPU-{torch.cuda.get_device_properties(ordinal).uuid}"


class UsageMeter:
    """Reads this process tree's CPU time; on CUDA also samples NVML for one GPU
    (``gpu_uuid``, from ``cuda_uuid``)."""

    def __init__(self, gpu_uuid: str | None = None, period_s: float = 0.1) -> None:
        self.process = psutil.Process()
        self._gpu_sum = 0.0
        self._gpu_samples = 0
        self._stop = threading.Event()
        if gpu_uuid is not None:
            threading.Thread(target=self._sample_nvml, args=(gpu_uuid, period_s),
                             daemon=True).start()

    def _sample_nvml(self, uuid: str, period_s: float) -> None:
        try:
            import pynvml
        except ImportError:  # the gpu extra brings nvidia-ml-py; without it, no cross-check
            return
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        while not self._stop.wait(period_s):
            self._gpu_sum += pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
            self._gpu_samples += 1

    def read(self) -> UsageReading:
        return UsageReading(wall=time.time(), cpu_s=_tree_cpu_seconds(self.process),
                            gpu_util_sum=self._gpu_sum, gpu_samples=self._gpu_samples)

    def close(self) -> None:
        self._stop.set()
