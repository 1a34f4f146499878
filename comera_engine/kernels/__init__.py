"""GPU kernels in Triton, one module per kernel (kernel, launcher, ``autograd.Function``
and the PyTorch reference it is tested against).

* :mod:`.tt_linear` - the fused TT-linear forward ``(X·L)·R + b`` and backward.

Nothing here is imported by the CPU path: CPU tensors never touch Triton, and the package
imports without it. :func:`enabled` says whether the kernels may be used
(``COMERA_KERNELS=0`` switches them off). What has run on a real GPU and what has only
been interpreted and compiled ahead is listed in README.md.
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["enabled"]


def enabled() -> bool:
    """True where Triton is installed and ``COMERA_KERNELS`` is not ``0``."""
    if os.environ.get("COMERA_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return importlib.util.find_spec("triton") is not None
