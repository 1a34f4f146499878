"""Build the CPU backend ahead of any run, atomically (``make install`` calls this).

:func:`build` compiles ``csrc/`` with ``torch.utils.cpp_extension`` (a C++ compiler and
ninja; about a minute on two cores) into a fresh temporary folder beside the backend's
``ready`` folder, times the GEMM ways there (:mod:`.tune`), writes ``manifest.json``
last, and renames the folder to ``ready``. torch's build lock lives in that temporary
folder, so a build killed at any moment leaves a stray ``.build-*`` folder (removed by
the next build) and nothing a run would load or wait on. Concurrent builds of one folder
take turns on ``.build.lock``; runs never wait on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from . import CHOICES, CSRC, LOCK, MANIFEST, NAME, READY, SOURCES, ready_dir, sources_digest

__all__ = ["build"]

# -fno-math-errno: a loop calling sqrt vectorizes (no errno to set for a negative
# argument; adamw.cpp). OpenMP for at::parallel_for (tt_halves_batch.cpp, adamw.cpp):
# without it the header's parallel_for runs serially in an extension. On Linux the
# extension then shares torch's libgomp (same soname, already loaded), so BLAS calls
# inside a parallel region run single-threaded.
_OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []


@contextlib.contextmanager
def _exclusive(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s build lock (waits for another build of the same folder)."""
    with open(folder / LOCK, "a+") as f:
        try:
            import fcntl
        except ImportError:  # not POSIX: builds are not serialised
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(into: Path, verbose: bool):  # noqa: ANN202
    """Compile the module into ``into``; returns it, loaded."""
    from torch.utils.cpp_extension import load

    return load(name=NAME, sources=[str(CSRC / f) for f in SOURCES],
                extra_cflags=["-O3", "-fno-math-errno", *_OPENMP], extra_ldflags=_OPENMP,
                build_directory=str(into), verbose=verbose)


def _swap_in(tmp: Path, folder: Path) -> None:
    """Make ``tmp`` the ready build: the old one moved aside, ``tmp`` renamed into place
    (each a single rename), the old one removed."""
    ready = ready_dir(folder)
    old = folder / f".old-{os.getpid()}"
    if ready.exists():
        os.replace(ready, old)
    os.replace(tmp, ready)
    shutil.rmtree(old, ignore_errors=True)


def build(folder: Path, tune: bool = True, verbose: bool = False) -> Path:
    """Build the backend into ``folder`` (created if needed) and return its ready
    folder. ``tune``: time the GEMM ways now (else the fixed rule everywhere). Raises
    what the compiler raises; the previous build, if any, stays in place then."""
    folder.mkdir(parents=True, exist_ok=True)
    with _exclusive(folder):
        for stray in [*folder.glob(".build-*"), *folder.glob(".old-*")]:
            shutil.rmtree(stray, ignore_errors=True)  # left by killed builds
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=folder))
        try:
            mod = _compile(tmp, verbose)
            so = Path(mod.__file__)
            if tune:
                from .tune import tune_ways

                ways = tune_ways(mod)
                (tmp / CHOICES).write_text(json.dumps(ways, indent=1, sort_keys=True))
            manifest = {"file": so.name, "torch": torch.__version__,
                        "sources": sources_digest(), "python": sys.version.split()[0],
                        "tuned": tune}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            _swap_in(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return folder / READY
