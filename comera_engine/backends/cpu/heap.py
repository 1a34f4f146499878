"""CPU backend, heap settings: keep freed heap memory in the process between steps.

glibc's ``malloc`` serves a block of 128 KiB or more with ``mmap`` (its threshold then
rises, up to 32 MiB, as such blocks are freed) and hands the top of the heap back to the
kernel once more than twice that threshold is free. A training step allocates and frees
its activations and gradients (a 4096×768 fp32 tensor is 12.6 MB), so, depending on
what the process freed before, a step's tensors land on fresh pages, and the kernel
faults in and zeroes every 4 KiB page on first touch: thousands of page faults per
TT-linear step at 768×768 and 4096 tokens, and that step much slower in some processes
than in others (``git show 1127e36:docs/BENCHMARKS.md``, "Freed heap memory kept").

:func:`keep_freed_memory` fixes glibc's thresholds (``mallopt``), so that blocks up to
``mmap_threshold`` come from the heap and freed memory stays with the process for the
next step: the resident set stays at the run's peak instead of shrinking between steps
(what jemalloc or tcmalloc, which PyTorch's CPU tuning guide recommends, do as well).
Part of the CPU backend: ``train`` calls it for CPU runs where the backend is in use
(:func:`comera_engine.backends.cpu_backend`); ``COMERA_KEEP_FREED_MEMORY=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # the largest every glibc accepts on 64-bit hosts


def keep_freed_memory(mmap_threshold: int = 1 << 30, trim_threshold: int = 2**31 - 1
                      ) -> int:
    """Serve blocks below ``mmap_threshold`` bytes from the heap (glibc versions that
    refuse more than 32 MiB get 32 MiB) and give heap memory back to the kernel only
    when more than ``trim_threshold`` bytes are free at its top.

    Returns the mmap threshold set (bytes), or 0 where nothing was changed: other
    platforms and C libraries, or ``COMERA_KEEP_FREED_MEMORY=0``. Raises ValueError for
    a threshold that is not a positive C ``int``."""
    for name, v in (("mmap_threshold", mmap_threshold), ("trim_threshold", trim_threshold)):
        if not 0 < v < 2**31:
            raise ValueError(f"{name}: must be between 1 and 2**31 - 1 bytes, got {v}")
    if os.environ.get("COMERA_KEEP_FREED_MEMORY", "1").strip().lower() in ("0", "false",
                                                                             "no", "off"):
        return 0
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return 0
    for v in dict.fromkeys((mmap_threshold, min(mmap_threshold, _MMAP_THRESHOLD_MAX))):
        if mallopt(_M_MMAP_THRESHOLD, v) == 1:
            mallopt(_M_TRIM_THRESHOLD, trim_threshold)
            return v
    return 0


def _glibc_mallopt():  # noqa: ANN202
    """glibc's ``mallopt`` (``int mallopt(int, int)``), or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version"):  # musl and others: no such knobs
            return None
        fn = libc.mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn
