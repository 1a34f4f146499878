"""GPUs of this machine through NVML (``pynvml``); empty on a machine without one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    memory_total_mb: float

    @property
    def label(self) -> str:
        return f"GPU {self.index}: {self.name} ({self.memory_total_mb / 1024:.0f} GiB)"


def _nvml() -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # no driver, no library, no permission: no GPUs
        return None


def list_gpus() -> list[GPU]:
    """Every GPU NVML can see, by index."""
    nv = _nvml()
    if nv is None:
        return []
    out = []
    try:
        for i in range(int(nv.nvmlDeviceGetCount())):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            name = nv.nvmlDeviceGetName(h)
            if isinstance(name, bytes):
                name = name.decode("utf-8", "replace")
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            out.append(GPU(i, str(name), mem.total / 2**20))
    except Exception:
        return out
    return out

