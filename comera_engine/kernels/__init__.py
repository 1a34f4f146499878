"""GPU kernels in Triton, one module per kernel (kernel, launcher, ``autograd.Function``
and the PyTorch reference it is tested against).

* :mod:`.tt_linear` - the fused TT-linear forward ``(X·L)·R + b`` and backward; on CUDA
  the planner's ``halves`` path runs on it (``tensor.planner.tt_linear``).
* :mod:`.ttm_lookup` - the fused TTM embedding lookup (rows from the two half tables;
  backward by sorted segments, deterministic and graph-safe).

Nothing here is imported by the CPU path: CPU tensors never touch Triton, and the package
imports without it. :func:`enabled` says whether the kernels may be used: **opt-in**
(``COMERA_KERNELS=1``). They pass their tests compiled on a GPU, but inside the CUDA graph
the trainer uses the fused TT-linear is slower than the PyTorch halves path it replaces
(docs/BENCHMARKS.md, "On a GPU"), and Triton compiles a kernel on its first launch, while
nothing may compile inside a run.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

__all__ = ["enabled", "runs_on"]


def enabled() -> bool:
    """True where Triton is installed and ``COMERA_KERNELS`` is ``1`` (or ``interpret``:
    CPU tensors too when ``TRITON_INTERPRET=1``, the tests' way). Off by default."""
    if os.environ.get("COMERA_KERNELS", "0").strip().lower() not in ("1", "true", "yes", "on",
                                                                     "interpret"):
        return False
    return importlib.util.find_spec("triton") is not None


def runs_on(t: Any) -> bool:
    """The kernels take this tensor: they are :func:`enabled` and ``t`` is on a CUDA
    device, or ``COMERA_KERNELS=interpret`` with ``TRITON_INTERPRET=1`` (CPU tensors
    through the interpreter: the tests' way). Otherwise CPU tensors never touch Triton."""
    if not enabled():
        return False
    if getattr(t, "is_cuda", False):
        return True
    return (os.environ.get("COMERA_KERNELS", "").strip().lower() == "interpret"
            and os.environ.get("TRITON_INTERPRET") == "1")
