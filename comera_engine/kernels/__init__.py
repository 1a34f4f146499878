"""GPU kernels in Triton, one module per kernel (kernel, launcher, ``autograd.Function``
and the PyTorch reference it is tested against).

* :mod:`.tt_linear` - the fused TT-linear forward ``(X·L)·R + b`` and backward: the
  planner's ``fused`` path of a TT linear (``tensor.planner.tt_linear``).
* :mod:`.ttm_lookup` - the fused TTM embedding lookup (rows from the two half tables;
  backward by sorted segments, deterministic and graph-safe): the ``fused`` path of a
  TTM lookup.
* :mod:`.configs` - the launch configurations (tiles, warps) per shape: the defaults, or
  what the tuning script measured best on the device (its profile installs them).

Nothing here is imported by the CPU path: CPU tensors never touch Triton, and the package
imports without it. :func:`enabled` says whether the kernels may be used: **opt-in**
(``COMERA_KERNELS=1``): Triton compiles a kernel on its first launch, and nothing may
compile inside a run unasked. Where they may, the planner runs them where the device's
profile measured them fastest (docs/BENCHMARKS.md, "On a GPU").
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

__all__ = ["enabled", "runs_on", "runs_on_device"]


def enabled() -> bool:
    """True where Triton is installed and ``COMERA_KERNELS`` is ``1`` (or ``interpret``:
    CPU tensors too when ``TRITON_INTERPRET=1``, the tests' way). Off by default."""
    if os.environ.get("COMERA_KERNELS", "0").strip().lower() not in ("1", "true", "yes", "on",
                                                                     "interpret"):
        return False
    return importlib.util.find_spec("triton") is not None


def runs_on_device(device_type: str) -> bool:
    """The kernels take tensors of this device type (``"cuda"``, ``"cpu"``, …): they are
    :func:`enabled` and it is CUDA, or ``COMERA_KERNELS=interpret`` with
    ``TRITON_INTERPRET=1`` (CPU tensors through the interpreter: the tests' way)."""
    if not enabled():
        return False
    if device_type == "cuda":
        return True
    return (os.environ.get("COMERA_KERNELS", "").strip().lower() == "interpret"
            and os.environ.get("TRITON_INTERPRET") == "1")


def runs_on(t: Any) -> bool:
    """The kernels take this tensor (:func:`runs_on_device` of its device). Otherwise CPU
    tensors never touch Triton."""
    return runs_on_device("cuda" if getattr(t, "is_cuda", False) else "cpu")
