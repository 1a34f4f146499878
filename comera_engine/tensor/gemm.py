"""The halves path's batch-sized GEMMs on CPU, each run the faster of two ways on this
machine.

A TT-linear step on the halves path (:class:`~.contract.TTLinearHalves`) runs six
products whose size grows with the batch: ``X·L`` and ``XL·R`` forward, ``dY·Rᵀ``,
``XLᵀ·dY``, ``dXL·Lᵀ`` and ``Xᵀ·dXL`` backward. Each can reach the CPU's BLAS in two
ways that compute the same product:

* ``a·b`` (:func:`nn`) and ``a·wᵀ`` (:func:`nt`): MKL (``torch.mm``) or oneDNN (PyTorch's
  own oneDNN linear op, :func:`onednn_linear`);
* ``aᵀ·b`` (:func:`tn`, a reduction over the batch): ``aᵀ·b`` or ``(bᵀ·a)ᵀ``, both MKL.

Which way is faster depends on the CPU as much as on the shape: at ``4096×768``, rank
30, oneDNN ran the expanding products (``k`` = 32) 1.1-1.4× faster than MKL on a Zen 4
VM (AVX2) and 1.7× slower on a Xeon VM with AVX-512, where ``(bᵀ·a)ᵀ`` beat ``aᵀ·b``
by 1.4× for ``Xᵀ·dXL`` (docs/BENCHMARKS.md). A fixed rule is right on one machine and
wrong on the next, so with :data:`CPU_GEMM` ``"auto"`` (the default) the first product
of a kind and shape (from :data:`TUNE_MIN_ROWS` rows) times both ways on its own
operands, alternating, three calls each, and keeps the faster for the rest of the
process. The choice is saved per machine (CPU model, ISA, torch version, threads) in a
small JSON file (:func:`choices_path`), so later processes make the same choice without
timing: the two ways round differently in the last bits, and seeded runs stay
identical across processes on one machine. Two processes tuning one shape for the first
time at the same moment may each keep their own choice; the file keeps one of them.

:func:`choose` makes the same kind of choice for a whole step: the halves Function's
batch GEMMs one by one through this module (way 0) or row-blocked in C++ (way 1,
``csrc/tt_halves_batch.cpp``), keyed by :func:`step_key`.

Below :data:`TUNE_MIN_ROWS` rows, for other dtypes and devices, under autocast, with
``COMERA_GEMM_TUNE=0`` or ``CPU_GEMM`` set to ``"mkl"``/``"onednn"``, a fixed rule
applies: the backend asked for (MKL below 1024 rows, where oneDNN's per-call cost
shows) and the caller's default form for ``aᵀ·b``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import time
import warnings
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import TypeVar

import torch
from torch import Tensor

__all__ = ["CPU_GEMM", "TUNE_MIN_ROWS", "choices", "choices_path", "choose", "nn", "nt",
           "onednn_linear", "step_key", "step_tunable", "tn", "tuning_enabled", "way_for"]

T = TypeVar("T")

CPU_GEMM = "auto"
"""How the halves path's batch GEMMs reach the CPU's BLAS: ``"auto"`` (the default: the
faster of two ways per kind and shape, measured once per machine), ``"onednn"`` (oneDNN
for ``a·b`` and ``a·wᵀ`` from 1024 rows) or ``"mkl"`` (``torch.mm`` throughout). The
benchmarks switch it to compare."""

TUNE_MIN_ROWS = 1024
"""Products with fewer rows (batch rows; for :func:`tn`, the reduced batch axis) are not
timed: they take microseconds, and oneDNN's per-call cost made it 1.1-2.4× slower than
MKL at 128-512 rows on both machines measured."""

_KINDS = {"nn": ("mkl", "onednn"), "nt": ("mkl", "onednn"), "tn": ("ab", "ba"),
          # a whole halves step's batch GEMMs: one by one through nn/nt/tn, or row-blocked
          # in C++ (native tt_halves_batch.cpp)
          "halves-fwd": ("gemms", "blocked"), "halves-bwd": ("gemms", "blocked")}
_ROUNDS = 3
_ENV_TUNE = "COMERA_GEMM_TUNE"
_ENV_DIR = "COMERA_CACHE_DIR"


@lru_cache(maxsize=1)
def onednn_linear():  # noqa: ANN201
    """oneDNN's fp32 matmul as PyTorch ships it (``a·wᵀ + b``), or None where this build
    lacks it or it fails a first exact check on small integers (looked up once, lazily,
    so importing the package costs nothing)."""
    try:
        op = torch.ops.mkldnn._linear_pointwise
        a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
        if torch.equal(op(a, w, None, "none", [], ""), a @ w.t()):
            return op
    except Exception:  # noqa: BLE001 (absent op, unsupported CPU: fall back to torch.mm)
        pass
    return None


def tuning_enabled() -> bool:
    """False when ``COMERA_GEMM_TUNE=0`` (then the fixed rule applies everywhere)."""
    return os.environ.get(_ENV_TUNE, "1").strip().lower() not in ("0", "false", "no", "off")


# ------------------------------------------------------------------ the two ways
def _run(kind: str, way: int, a: Tensor, b: Tensor) -> Tensor:
    """``kind`` ``"nn"``: ``a·b`` (``b``: ``(k, n)``); ``"nt"``: ``a·bᵀ`` (``b``:
    ``(n, k)``); ``"tn"``: ``aᵀ·b`` (``a``: ``(r, m)``, ``b``: ``(r, n)``). ``way`` 0:
    MKL / ``aᵀ·b``; 1: oneDNN / ``(bᵀ·a)ᵀ``."""
    if kind == "tn":
        return a.t() @ b if way == 0 else (b.t() @ a).t()
    if way == 0:
        return a @ b if kind == "nn" else a @ b.t()
    w = b.t().contiguous() if kind == "nn" else b.contiguous()  # oneDNN wants w = (n, k)
    return onednn_linear()(a, w, None, "none", [], "")


def _large_cpu_fp32(a: Tensor) -> bool:
    """Whether ``a`` is a batch operand worth a choice: from :data:`TUNE_MIN_ROWS` rows,
    fp32 on the CPU, outside autocast (rows first: the common small case returns at
    once)."""
    return (a.shape[0] >= TUNE_MIN_ROWS and a.device.type == "cpu"
            and a.dtype == torch.float32 and not torch.is_autocast_enabled("cpu"))


def _eligible(kind: str, a: Tensor, b: Tensor) -> bool:
    """Whether both ways can run this product (contiguous ``a`` and the op present for
    oneDNN) and it is large enough to be worth a choice."""
    if not _large_cpu_fp32(a) or b.dtype != torch.float32:
        return False
    return kind == "tn" or (a.is_contiguous() and onednn_linear() is not None)


def _fixed(kind: str, a: Tensor, b: Tensor, default: int) -> int:
    """The way the fixed rule takes (see the module docstring)."""
    if kind == "tn":
        return default
    return int(CPU_GEMM == "onednn" and _eligible(kind, a, b))


# ------------------------------------------------------------------ choices on disk
_choices: dict[str, str] | None = None  # this process's choices, loaded lazily
_warned = False


@lru_cache(maxsize=1)
def _machine_id() -> str:
    """What a choice depends on besides the shape: CPU model, the ISA torch dispatches
    to, torch's version and the machine's architecture."""
    model = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    cap = torch.backends.cpu.get_cpu_capability()
    return f"{model} | {platform.machine()} | {cap} | torch {torch.__version__}"


def choices_path() -> Path:
    """This machine's choices file: ``$COMERA_CACHE_DIR`` (else ``$XDG_CACHE_HOME/comera``,
    else ``~/.cache/comera``) / ``gemm-choices-<hash of the machine id>.json``."""
    base = os.environ.get(_ENV_DIR)
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = str(Path(xdg) / "comera") if xdg else str(Path.home() / ".cache" / "comera")
    digest = hashlib.sha256(_machine_id().encode()).hexdigest()[:12]
    return Path(base) / f"gemm-choices-{digest}.json"


def _read(path: Path) -> dict[str, str]:
    """The choices saved in ``path`` for this machine; {} when absent, unreadable, for
    another machine or not this file's format (it is then rewritten on the next save)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("machine") != _machine_id():
        return {}
    got = data.get("choices")
    if not isinstance(got, dict):
        return {}
    return {k: v for k, v in got.items()
            if isinstance(v, str) and v in _KINDS.get(k.split("|", 1)[0], ())}


def _save(key: str, way: str) -> None:
    """Add one choice to the file: read, merge and replace it atomically under an
    exclusive lock, so concurrent processes never leave a half-written file and keep
    each other's other choices. A folder that cannot be written keeps the choice in this
    process only (one warning)."""
    global _warned
    path = choices_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a+") as lock:
            try:
                import fcntl
                fcntl.flock(lock, fcntl.LOCK_EX)
            except ImportError:  # not POSIX: the atomic replace alone
                pass
            merged = {**_read(path), key: way}
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"machine": _machine_id(), "choices": merged},
                                      indent=1, sort_keys=True))
            os.replace(tmp, path)
    except OSError as exc:
        if not _warned:
            _warned = True
            warnings.warn(f"comera_engine: cannot save GEMM choices to {path} ({exc}); "
                          f"they hold for this process only (set {_ENV_DIR} to a writable "
                          "folder)", RuntimeWarning, stacklevel=3)


def choices() -> dict[str, str]:
    """This process's choices so far (loaded from :func:`choices_path` on first use):
    ``"<kind>|<m>x<k>x<n>|<threads>"`` → way (``"mkl"``/``"onednn"``, ``"ab"``/``"ba"``)."""
    global _choices
    if _choices is None:
        _choices = _read(choices_path())
    return _choices


def _reset() -> None:
    """Forget this process's choices (the next product reads the file again): tests."""
    global _choices
    _choices = None


def _key(kind: str, a: Tensor, b: Tensor) -> str:
    if kind == "tn":
        m, k, n = a.shape[1], a.shape[0], b.shape[1]
    else:
        m, k = a.shape
        n = b.shape[1] if kind == "nn" else b.shape[0]
    return f"{kind}|{m}x{k}x{n}|{torch.get_num_threads()}"


def _tune(kind: str, key: str, run: Callable[[int], T]) -> T:
    """Time both ways of ``run`` (alternating, :data:`_ROUNDS` calls each, the best call
    kept), record the faster under ``key`` and return its last result. A way 1 that fails
    on these operands (oneDNN refusing a layout, say) is never chosen."""
    best = [float("inf"), float("inf")]
    out: list = [None, None]
    for _ in range(_ROUNDS):
        for way in (0, 1):
            t0 = time.perf_counter()
            try:
                out[way] = run(way)
            except RuntimeError:
                if way == 0:  # the plain way itself: not ours to hide
                    raise
                best[1] = float("inf")
                break
            best[way] = min(best[way], time.perf_counter() - t0)
    way = int(best[1] < best[0])
    choices()[key] = _KINDS[kind][way]
    _save(key, _KINDS[kind][way])
    return out[way]


def choose(kind: str, key: str, run: Callable[[int], T]) -> T:
    """``run(way)`` for the way this machine takes for ``key`` (made by :func:`step_key`
    for a whole step, way 0 its plain form): the saved choice, else both timed now."""
    way = choices().get(key)
    if way is None:
        return _tune(kind, key, run)
    return run(_KINDS[kind].index(way))


def step_tunable(x: Tensor) -> bool:
    """Whether a step on batch input ``x`` takes a per-machine choice between its plain
    and its blocked form (CPU fp32, contiguous, from :data:`TUNE_MIN_ROWS` rows, ``auto``
    and tuning on)."""
    return (_large_cpu_fp32(x) and x.is_contiguous() and CPU_GEMM == "auto"
            and tuning_enabled())


def step_key(kind: str, *dims: object) -> str:
    """The choices-file key of a step of ``kind`` (``"halves-fwd"``, ``"halves-bwd"``)
    with these dimensions and flags, at this thread count."""
    return f"{kind}|{'x'.join(str(d) for d in dims)}|{torch.get_num_threads()}"


def _tuned(kind: str, a: Tensor, b: Tensor) -> bool:
    """Whether this product takes the per-machine choice (else the fixed rule)."""
    return CPU_GEMM == "auto" and _eligible(kind, a, b) and tuning_enabled()


def _product(kind: str, a: Tensor, b: Tensor, default: int = 0) -> Tensor:
    if not _tuned(kind, a, b):
        return _run(kind, _fixed(kind, a, b, default), a, b)
    return choose(kind, _key(kind, a, b), lambda way: _run(kind, way, a, b))


def way_for(kind: str, a: Tensor, b: Tensor, default: int = 0) -> str:
    """The way a product of these operands runs now (``"mkl"``/``"onednn"`` for ``nn`` and
    ``nt``, ``"ab"``/``"ba"`` for ``tn``), or ``"untuned"`` where ``auto`` has not timed
    this shape yet: for the benchmarks' tables."""
    if not _tuned(kind, a, b):
        return _KINDS[kind][_fixed(kind, a, b, default)]
    return choices().get(_key(kind, a, b), "untuned")


def nn(a: Tensor, b: Tensor) -> Tensor:
    """``a·b`` for ``a``: ``(m, k)``, ``b``: ``(k, n)``; returns ``(m, n)``, on MKL or
    oneDNN (see the module docstring)."""
    return _product("nn", a, b)


def nt(a: Tensor, w: Tensor) -> Tensor:
    """``a·wᵀ`` for ``a``: ``(m, k)``, ``w``: ``(n, k)``; returns ``(m, n)``, on MKL or
    oneDNN (see the module docstring)."""
    return _product("nt", a, w)


def tn(a: Tensor, b: Tensor, default: int = 0) -> Tensor:
    """``aᵀ·b`` for ``a``: ``(r, m)``, ``b``: ``(r, n)`` (a sum over the ``r`` rows);
    returns ``(m, n)``, as ``aᵀ·b`` or ``(bᵀ·a)ᵀ`` (``default`` 0 or 1: the fixed rule's
    form)."""
    return _product("tn", a, b, default)
