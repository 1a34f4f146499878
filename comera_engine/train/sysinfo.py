"""Memory readings for the per-step metrics.

GPU: ``torch.cuda`` peak allocated / reserved bytes of this process, and the device's
used / total memory from NVML (``pynvml``), with the NVML device found by its UUID (NVML
indices ignore ``CUDA_VISIBLE_DEVICES``, which the launcher sets). Without NVML, or when
the UUID does not match, the CUDA runtime's ``mem_get_info`` gives used / total instead.
CPU: the process resident set. All values are MiB.
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
                self._nvml = (pynvml, _nvml_handle(pynvml, device))
            except Exception:  # NVML missing, not permitted, or no match: CUDA runtime
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
            used = total = None
            if self._nvml is not None:
                pynvml, handle = self._nvml
                try:
                    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
                    used, total = info.used, info.total
                except Exception:  # noqa: BLE001 - a metric must never end the run
                    pass
            if used is None:
                free, total = torch.cuda.mem_get_info(self.device)
                used = total - free
            out["mem/gpu_used_mb"] = used / _MIB
            out["mem/gpu_total_mb"] = total / _MIB
            return out
        return {"mem/rss_mb": self._process.memory_info().rss / _MIB}


def _nvml_handle(pynvml: object, device: torch.device) -> object:
    """The NVML handle of ``device``, found by the UUID the CUDA runtime reports."""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    for name in (uuid, f"GPU-{uuid}"):
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(name)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - try the other spelling
            continue
    raise RuntimeError(f"no NVML device with UUID {uuid}")
