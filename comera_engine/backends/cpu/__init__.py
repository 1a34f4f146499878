"""The CPU backend: C++ TT ops, per-install GEMM ways and heap settings, all optional.

At small batches a TT-linear step is bound by per-op cost, not arithmetic; ``csrc/``
runs the pure-PyTorch ops' work (:mod:`comera_engine.ops`) in the same order from C++:
the sweep path whole (``tt_sweep.cpp``), the halves path's gates, merges and core
gradients (``tt_halves.cpp``), its batch GEMMs row-blocked (``tt_halves_batch.cpp``), gate
helpers shared by all (``tt_common.cpp``), a gated TT matrix's ``W`` as one autograd node
with the training step's gradient clipping (``ttm_matrix.cpp``), and AdamW over every
parameter group in one call (``adamw.cpp``). :mod:`.gemm` runs the halves step's batch
products the faster of two ways on this machine, and :mod:`.heap` keeps freed memory in
the process between steps.

It is built ahead, never inside a run: ``make install`` runs ``python -m
comera_engine.backends.cpu build`` (:mod:`.build`), which compiles the module into a
temporary folder, times the GEMM ways there (:mod:`.tune`), then moves the folder into
place in one rename, so a build killed at any moment leaves nothing half-loadable. The
folder belongs to the virtualenv: ``<sys.prefix>/share/comera_engine/cpu_backend``, or
``$COMERA_CPU_BACKEND_DIR``. At run time :func:`load` only loads a complete build;
:func:`comera_engine.backends.cpu_backend` (the one hook the core calls) turns any failure into
one line on stderr and the PyTorch path. ``COMERA_NATIVE=0`` switches it off.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from . import step
from .gemm import Ways
from .heap import keep_freed_memory

__all__ = ["NAME", "BackendUnavailable", "CPUBackend", "backend_dir", "build_lock_held",
           "load", "ready_dir", "sources_digest"]

NAME = "comera_tt_native"
"""The compiled module's name (its ``PyInit_`` symbol)."""

ENV_DIR = "COMERA_CPU_BACKEND_DIR"
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("tt_common.cpp", "tt_sweep.cpp", "tt_halves.cpp", "tt_halves_batch.cpp",
           "ttm_matrix.cpp", "adamw.cpp", "module.cpp")
READY = "ready"  # the complete build, moved into place in one rename
MANIFEST = "manifest.json"  # written last inside a build
CHOICES = "choices.json"  # the install's GEMM ways (.tune)
LOCK = ".build.lock"


class BackendUnavailable(RuntimeError):
    """The backend cannot be used here; the message says why, in a few words."""


def backend_dir() -> Path:
    """This environment's backend folder: ``$COMERA_CPU_BACKEND_DIR``, else
    ``<sys.prefix>/share/comera_engine/cpu_backend`` (owned by the virtualenv)."""
    env = os.environ.get(ENV_DIR, "").strip()
    return Path(env) if env else Path(sys.prefix) / "share" / "comera_engine" / "cpu_backend"


def ready_dir(folder: Path | None = None) -> Path:
    """Where the complete build lives inside ``folder`` (default :func:`backend_dir`)."""
    return (folder or backend_dir()) / READY


@lru_cache(maxsize=1)
def sources_digest() -> str:
    """SHA-256 (16 hex digits) of the C++ sources: a build from other sources is stale."""
    h = hashlib.sha256()
    for f in sorted(CSRC.iterdir()):
        if f.suffix in (".cpp", ".h"):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def build_lock_held(folder: Path) -> bool:
    """Whether a build holds ``folder``'s lock now (asked without waiting; False where
    locks are not supported)."""
    lock = folder / LOCK
    if not lock.exists():
        return False
    try:
        import fcntl
    except ImportError:
        return False
    try:
        with open(lock, "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
    except OSError:
        return False
    return False


@dataclass(frozen=True)
class CPUBackend:
    """A loaded backend: ``ops`` (the compiled module), ``ways`` (the install's GEMM
    choices) and ``folder`` (its build)."""

    ops: ModuleType
    ways: Ways
    folder: Path

    def batch_forward(self, x: Tensor, Lp: Tensor, Rp: Tensor, ones_col: int
                      ) -> tuple[Tensor, Tensor]:
        """The halves forward's batch GEMMs (:func:`.step.batch_forward`)."""
        return step.batch_forward(self.ops, self.ways, x, Lp, Rp, ones_col)

    def batch_backward(self, dy: Tensor, x: Tensor, XL: Tensor, Lp: Tensor, Rp: Tensor,
                       need_x: bool, need_w: bool
                       ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The halves backward's batch GEMMs (:func:`.step.batch_backward`)."""
        return step.batch_backward(self.ops, self.ways, dy, x, XL, Lp, Rp, need_x, need_w)

    @staticmethod
    def keep_freed_memory() -> int:
        """The heap settings for a CPU run (:func:`.heap.keep_freed_memory`)."""
        return keep_freed_memory()


def _load_module(path: Path) -> ModuleType:
    """Load the prebuilt extension at ``path`` (no compiler, no lock)."""
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_file_location(NAME, str(path), loader=loader)
    if spec is None:
        raise ImportError(f"no module spec for {path}")
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def load(folder: Path | None = None) -> CPUBackend:
    """The complete build in ``folder`` (default :func:`backend_dir`), loaded; raises
    :class:`BackendUnavailable` naming why not (not built, a build in progress, built
    for another torch or from other sources, or the load failing). Never builds and
    never waits."""
    folder = folder or backend_dir()
    ready = ready_dir(folder)
    try:
        manifest = json.loads((ready / MANIFEST).read_text())
    except (OSError, ValueError):
        why = "a build is in progress" if build_lock_held(folder) else "not built"
        raise BackendUnavailable(f"{why} in {folder}") from None
    if manifest.get("torch") != torch.__version__:
        raise BackendUnavailable(f"built for torch {manifest.get('torch')}, this is "
                                 f"torch {torch.__version__}")
    if manifest.get("sources") != sources_digest():
        raise BackendUnavailable("built from other C++ sources than this checkout's")
    try:
        ops = _load_module(ready / str(manifest["file"]))
    except (ImportError, OSError, KeyError) as exc:
        raise BackendUnavailable(f"load failed: {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    return CPUBackend(ops, Ways.read(ready / CHOICES), ready)
