"""Memory readings for the per-step metrics.

GPU: ``torch.cuda`` peak allocated / reserved bytes of this process, and the device's
used / total memory from NVML (``pynvml``), with the NVML device found by its UUID (NVML
indices ignore ``CUDA_VISIBLE_DEVICES``, which the launcher sets). Without NVML, or when
the UUID does not match, the CUDA runtime's ``mem_get_info`` gives used / total instead.
CPU: the process resident set. All values are MiB.

:class:`SystemMeter`: the machine while the run trains (``sys/*``), read at most once a
second: the process's CPU use (percent of one core, so up to 100 × its threads), the
system's used and total RAM, the process RSS, and on a GPU its utilisation (NVML).

Both take ``nvml``: ``"auto"`` (the default) opens NVML for a CUDA device with
:func:`open_nvml`; a ``(pynvml, handle)`` pair is used as given (a test's fake); ``None``
reads no NVML.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import torch

_MIB = 1024.0 * 1024.0

#: ``(pynvml module, device handle)``: what the meters read NVML through.
Nvml = tuple[Any, Any]


def open_nvml(device: torch.device) -> Nvml | None:
    """NVML for ``device``: ``(pynvml, handle)`` when it is a CUDA device that NVML
    finds by its UUID, else ``None`` (a CPU device, no ``pynvml``, no driver, no match)."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, _nvml_handle(pynvml, device)
    except Exception:  # noqa: BLE001 - NVML missing, not permitted, or no match
        return None


class MemoryMeter:
    """``meter.read() -> {"mem/...": MiB}`` for ``device``."""

    def __init__(self, device: torch.device,
                 nvml: Nvml | None | Literal["auto"] = "auto") -> None:
        self.device = device
        self._process = None
        # without NVML (or when it fails) the CUDA runtime gives used / total
        self._nvml = open_nvml(device) if nvml == "auto" else nvml
        if device.type != "cuda":
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


class SystemMeter:
    """``meter.read() -> {"sys/...": value}``: new readings at most every ``every``
    seconds (a step of a tiny model takes a millisecond), the last ones in between.
    ``sys/gpu_util_percent`` (the share of the last sample period in which a kernel ran,
    0-100) is read when NVML is there; the device's memory is
    :class:`MemoryMeter`'s ``mem/gpu_used_mb`` / ``mem/gpu_total_mb``, read every step."""

    def __init__(self, device: torch.device, every: float = 1.0,
                 nvml: Nvml | None | Literal["auto"] = "auto") -> None:
        import psutil

        self._psutil = psutil
        self._process = psutil.Process()
        self._process.cpu_percent(None)  # the first call starts the interval
        self._every = every
        self._last = -float("inf")
        self._values: dict[str, float] = {}
        self._gpu = open_nvml(device) if nvml == "auto" else nvml  # None: no utilisation

    def read(self) -> dict[str, float]:
        now = time.monotonic()
        if now - self._last < self._every:
            return dict(self._values)
        self._last = now
        try:
            vm = self._psutil.virtual_memory()
            values = {"sys/cpu_percent": float(self._process.cpu_percent(None)),
                      "sys/ram_used_mb": (vm.total - vm.available) / _MIB,
                      "sys/ram_total_mb": vm.total / _MIB,
                      "sys/rss_mb": self._process.memory_info().rss / _MIB}
        except Exception:  # noqa: BLE001 - a metric must never end the run
            return dict(self._values)
        if self._gpu is not None:
            pynvml, handle = self._gpu
            try:
                values["sys/gpu_util_percent"] = float(
                    pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception:  # noqa: BLE001 - this reading goes, the others stay
                pass
        self._values = values
        return dict(values)


def _nvml_handle(pynvml: object, device: torch.device) -> object:
    """The NVML handle of ``device``, found by the UUID the CUDA runtime reports."""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    for name in (uuid, f"GPU-{uuid}"):
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(name)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - try the other spelling
            continue
    raise RuntimeError(f"no NVML device with UUID {uuid}")
