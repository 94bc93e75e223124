"""Device usage as the operating system and the driver see it, to cross-check the spans.

Owns: reading a worker's process-tree CPU time (psutil; the vLLM engine runs in child
processes, so children count) and, on CUDA, sampling NVML utilisation of the worker's
GPU in a background thread. Knows nothing about spans or what the worker does.
"""

from __future__ import annotations

import threading
import time

import psutil

from buffers.records import UsageReading


def _tree_cpu_seconds(process: psutil.Process) -> float:
    total = 0.0
    for proc in [process, *process.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # a child may exit between listing and reading
            continue
        total += times.user + times.system
    return total


class UsageMeter:
    """Reads this process tree's CPU time; on CUDA also samples NVML for one GPU."""

    def __init__(self, gpu_index: int | None = None, period_s: float = 0.1) -> None:
        self.process = psutil.Process()
        self._gpu_sum = 0.0
        self._gpu_samples = 0
        self._stop = threading.Event()
        if gpu_index is not None:
            threading.Thread(target=self._sample_nvml, args=(gpu_index, period_s),
                             daemon=True).start()

    def _sample_nvml(self, index: int, period_s: float) -> None:
        try:
            import pynvml
        except ImportError:  # the gpu extra brings nvidia-ml-py; without it, no cross-check
            return
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        while not self._stop.wait(period_s):
            self._gpu_sum += pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
            self._gpu_samples += 1

    def read(self) -> UsageReading:
        return UsageReading(wall=time.time(), cpu_s=_tree_cpu_seconds(self.process),
                            gpu_util_sum=self._gpu_sum, gpu_samples=self._gpu_samples)

    def close(self) -> None:
        self._stop.set()
