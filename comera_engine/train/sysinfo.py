"""Memory readings for the per-step metrics.

GPU: ``torch.cuda`` peak allocated / reserved bytes of this process, and the device's
used / total memory from NVML (``pynvml``, if it loads). CPU: the process resident set.
All values are MiB.
"""

from __future__ import annotations

import torch

_MIB = 1024.0 * 1024.0


class MemoryMeter:
    """``meter.read() -> {"mem/...": MiB}`` for ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._nvml = None
        self._process = None
        if device.type == "cuda":
            try:
                import pynvml

                pynvml.nvmlInit()
                index = device.index if device.index is not None else torch.cuda.current_device()
                self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(index))
            except Exception:  # NVML missing or not permitted: torch numbers only
                self._nvml = None
        else:
            import psutil

            self._process = psutil.Process()

    def read(self) -> dict[str, float]:
        if self.device.type == "cuda":
            out = {
                "mem/cuda_max_allocated_mb": torch.cuda.max_memory_allocated(self.device) / _MIB,
                "mem/cuda_max_reserved_mb": torch.cuda.max_memory_reserved(self.device) / _MIB,
            }
            if self._nvml is not None:
                pynvml, handle = self._nvml
                info = pynvml.nvmlDeviceGetMemoryInfo(handle)
                out["mem/gpu_used_mb"] = info.used / _MIB
                out["mem/gpu_total_mb"] = info.total / _MIB
            return out
        return {"mem/rss_mb": self._process.memory_info().rss / _MIB}
