"""Native (C++) TT-linear ops for the CPU: built once per machine, optional.

At small batches a TT-linear step is bound by per-op cost, not arithmetic: the sweep
path runs ~70 small ATen ops a step, and the Python between them cost more than its
GEMMs (docs/BENCHMARKS.md). ``csrc/`` runs the same ops in the same order from C++:
the sweep path whole (``tt_sweep.cpp``), the halves path's gates, merges and core
gradients (``tt_halves.cpp``), its batch GEMMs row-blocked (``tt_halves_batch.cpp``,
used where :mod:`.gemm` finds it faster than the products one by one), gate helpers
shared by all (``tt_common.cpp``). It is compiled with
``torch.utils.cpp_extension`` (a C++ compiler and ninja) the first time it is needed,
about a minute, and cached per machine under ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``); ``make install`` builds it ahead. Without a compiler,
or with ``COMERA_NATIVE=0``, everything runs on the PyTorch Functions in
``contract.py``, which are the reference the tests compare it with.

    python -c "from comera_engine.tensor.native import main; main()"   # build now
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["enabled", "load", "usable"]

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = ("tt_common.cpp", "tt_sweep.cpp", "tt_halves.cpp", "tt_halves_batch.cpp",
            "module.cpp")
# OpenMP for at::parallel_for in tt_halves_batch.cpp: without it the header's parallel_for
# runs serially in an extension. On Linux the extension then shares torch's libgomp (same
# soname, already loaded), so BLAS calls inside a parallel region run single-threaded.
_OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []
_NAME = "comera_tt_native"


def enabled() -> bool:
    """False when ``COMERA_NATIVE=0`` (then :func:`load` builds nothing)."""
    return os.environ.get("COMERA_NATIVE", "1").strip() not in ("0", "false", "no", "off")


@lru_cache(maxsize=1)
def load() -> ModuleType | None:
    """The compiled module, building it on first use; None (with one warning) where it
    cannot be built, or when disabled."""
    if not enabled():
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory
        from torch.utils.cpp_extension import load as build

        folder = Path(_get_build_directory(_NAME, verbose=False))
        _clear_stale_lock(folder)
        if not any(folder.glob("*.so")) and not any(folder.glob("*.pyd")):
            print("comera_engine: building the native TT ops (once per machine, about a "
                  f"minute; cached in {folder})", file=sys.stderr, flush=True)
        return build(name=_NAME, sources=[str(_CSRC / f) for f in _SOURCES],
                     extra_cflags=["-O3", *_OPENMP], extra_ldflags=_OPENMP, verbose=False)
    except Exception as exc:  # noqa: BLE001 (no compiler or ninja, build error: fall back)
        first = str(exc).strip().splitlines()[:1]
        warnings.warn(f"comera_engine: native TT ops unavailable ({type(exc).__name__}: "
                      f"{first[0] if first else ''}); using the PyTorch path "
                      "(set COMERA_NATIVE=0 to skip the build)", RuntimeWarning,
                      stacklevel=2)
        return None


def _clear_stale_lock(folder: Path, max_age_s: float = 600.0) -> None:
    """Remove a build lock older than ``max_age_s``: a build killed half-way leaves its
    lock file behind, and torch then waits for it forever (a build takes ~1 minute)."""
    lock = folder / "lock"
    try:
        if time.time() - lock.stat().st_mtime > max_age_s:
            lock.unlink()
    except OSError:  # no lock (the usual case), or removed meanwhile
        pass


def usable(x: torch.Tensor) -> ModuleType | None:
    """The native module where it runs a call on input ``x``: CPU, float32/float64, no
    autocast; else None (the PyTorch path)."""
    if (x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64)
            or torch.is_autocast_enabled("cpu") or not enabled()):
        return None
    return load()


def main() -> int:
    """Build (or find) the module and say whether it is in use; 0 either way: the
    PyTorch path works without it."""
    mod = load()
    if mod is None:
        print("native TT ops: not in use, the PyTorch path runs instead"
              + (" (COMERA_NATIVE=0)" if not enabled() else " (build failed; see above)"),
              file=sys.stderr)
    else:
        print(f"native TT ops: built and in use ({mod.__file__})")
    return 0
