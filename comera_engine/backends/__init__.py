"""Optional backends, registered through one hook: :func:`cpu_backend`.

The core (:mod:`comera_engine.ops`, the trainer) is pure PyTorch. Where the CPU backend
(:mod:`comera_engine.backends.cpu`: C++ TT ops, the install's GEMM ways, heap settings)
is built and loads, :func:`cpu_backend` returns it and the core hands it the work it speeds up;
else the core runs its PyTorch path. The hook never builds, never waits and never
times anything: a backend that is not built, being built, stale or failing to load gives
one line on stderr (once per process) and None. ``COMERA_NATIVE=0`` switches it off.
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .cpu import CPUBackend

__all__ = ["cpu_backend", "enabled", "keep_freed_memory"]

_OFF = ("0", "false", "no", "off")


def enabled() -> bool:
    """False when ``COMERA_NATIVE=0`` (then :func:`cpu_backend` is None and loads nothing)."""
    return os.environ.get("COMERA_NATIVE", "1").strip().lower() not in _OFF


def cpu_backend(x: torch.Tensor | None = None, like: torch.Tensor | None = None
                ) -> CPUBackend | None:
    """The loaded CPU backend, or None: switched off, not usable here (one line on
    stderr, once), given ``x``, not a call it runs (``x`` not a float32/float64 CPU
    tensor, ``like`` — the weights ``x`` meets — of another dtype, which the PyTorch path
    refuses in torch's own words, or under CPU autocast), or inside ``torch.compile``'s
    tracing (a graph takes the PyTorch path: Dynamo cannot see into the backend's C++
    nodes)."""
    if torch.compiler.is_compiling():
        return None
    if x is not None and (x.device.type != "cpu" or x.dtype not in (torch.float32,
                                                                     torch.float64)
                          or torch.is_autocast_enabled("cpu")
                          or (like is not None and like.dtype != x.dtype)):
        return None
    if not enabled():
        return None
    return _load_once()


def keep_freed_memory() -> int:
    """The CPU backend's heap settings for a CPU run, where the backend is in use
    (:func:`comera_engine.backends.cpu.heap.keep_freed_memory`); else 0, nothing set."""
    backend = cpu_backend()
    return backend.keep_freed_memory() if backend is not None else 0


@lru_cache(maxsize=1)
def _load_once() -> CPUBackend | None:
    from .cpu import BackendUnavailable, load

    try:
        return load()
    except BackendUnavailable as exc:
        print(f"comera_engine: CPU backend not in use ({exc}); running on the PyTorch "
              "path. Build it with `make install` (or `python -m comera_engine.backends.cpu"
              " build`)", file=sys.stderr, flush=True)
        return None
