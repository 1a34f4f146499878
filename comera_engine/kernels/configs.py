"""Launch configurations of the Triton kernels: tiles, splits and warps per shape.

Each kernel has a default configuration (:data:`DEFAULTS`: what it ran with before it was
tuned) and a list of candidates (:data:`CANDIDATES`) that the tuning script times at the
shapes a model meets (``comera_engine.tensor.tune``; each candidate is also checked
against float64 by tests/test_kernels.py). The best per shape is written into the
device's profile, and the planner installs the profile's table here (:func:`install`)
when it first plans for that device. A launch asks :func:`config` for its shape: the
tuned configuration of the nearest tuned shape (same kernel and dtype, distance in log
size), else the default. Nothing is timed or compiled here.

Keys of a configuration: the kernel's tile constexprs (``BLOCK_*``), its runtime split
(``SPLIT``: the chain's column groups, ``matmul_tn``'s and ``colsum``'s row groups, whose
partial sums are added after), and Triton's ``num_warps`` / ``num_stages`` (absent: Triton's
own default).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

__all__ = ["CANDIDATES", "DEFAULTS", "config", "forced", "install", "installed",
           "launch_options", "reset"]

DEFAULTS: dict[str, dict[str, int]] = {
    "chain": {"BLOCK_B": 32, "BLOCK_K": 32, "BLOCK_M": 64, "SPLIT": 1},
    "matmul_tn": {"BLOCK_I": 32, "BLOCK_J": 64, "BLOCK_ROWS": 32, "SPLIT": 1},
    "colsum": {"BLOCK_ROWS": 32, "BLOCK_M": 64, "SPLIT": 1},
    "lookup": {},
    "segment_grad": {},
}



def _table(keys: str, *rows: tuple[int, ...]) -> list[dict[str, int]]:
    """Configurations from rows of values for the space-separated ``keys`` (a 0 leaves
    Triton's own default for that key)."""
    return [{k: v for k, v in zip(keys.split(), row) if v} for row in rows]


#: What a tuning sweep tries per kernel (the default first).
CANDIDATES: dict[str, list[dict[str, int]]] = {
    "chain": [DEFAULTS["chain"], *_table(
        "BLOCK_B BLOCK_K BLOCK_M SPLIT num_warps num_stages",
        (64, 32, 64, 1, 4, 0), (32, 64, 64, 4, 4, 0), (64, 64, 128, 4, 8, 0),
        (64, 32, 64, 8, 4, 0), (128, 32, 64, 4, 8, 0), (128, 64, 128, 2, 8, 3),
        (16, 64, 128, 8, 4, 0))],
    "matmul_tn": [DEFAULTS["matmul_tn"], *_table(
        "BLOCK_I BLOCK_J BLOCK_ROWS SPLIT num_warps",
        (32, 64, 64, 8, 4), (64, 64, 64, 16, 4), (64, 32, 64, 32, 4), (32, 128, 32, 16, 8),
        (128, 32, 32, 8, 8))],
    "colsum": [DEFAULTS["colsum"], *_table(
        "BLOCK_ROWS BLOCK_M SPLIT num_warps", (64, 128, 8, 4), (32, 256, 16, 4))],
    "lookup": [DEFAULTS["lookup"], *_table("num_warps", (1,), (2,), (8,))],
    "segment_grad": [DEFAULTS["segment_grad"], *_table("num_warps", (1,), (2,), (8,))],
}

#: kernel -> [(shape, dtype, configuration)], from the device profile
_TUNED: dict[str, list[tuple[tuple[int, ...], str, dict[str, int]]]] = {}
#: kernel -> the configuration every launch takes inside :func:`forced`
_FORCED: dict[str, dict[str, int]] = {}


def install(table: dict[str, list[dict]]) -> None:
    """Use the tuned configurations of a profile's ``kernels`` table: per kernel, entries
    ``{"shape": [...], "dtype": "bfloat16", "config": {...}}`` (others ignored)."""
    _TUNED.clear()
    for kernel, entries in (table or {}).items():
        if kernel not in DEFAULTS:
            continue
        rows = []
        for e in entries:
            cfg = {str(k): int(v) for k, v in dict(e["config"]).items()}
            rows.append((tuple(int(s) for s in e["shape"]), str(e["dtype"]), cfg))
        _TUNED[kernel] = rows


def installed() -> dict[str, int]:
    """How many tuned shapes each kernel has (what :func:`install` took)."""
    return {k: len(v) for k, v in _TUNED.items()}


def reset() -> None:
    """Back to the defaults everywhere."""
    _TUNED.clear()


def config(kernel: str, shape: Sequence[int], dtype: str) -> dict[str, int]:
    """The configuration for ``kernel`` at ``shape`` in ``dtype``: the tuned one of the
    nearest tuned shape (``Σ |log a_i - log b_i|``), else :data:`DEFAULTS`."""
    if kernel in _FORCED:
        return _FORCED[kernel]
    rows = [r for r in _TUNED.get(kernel, ()) if r[1] == dtype and len(r[0]) == len(shape)]
    if not rows:
        return DEFAULTS[kernel]

    def dist(r: tuple) -> float:
        return sum(abs(math.log(max(a, 1)) - math.log(max(b, 1))) for a, b in zip(r[0], shape))

    return min(rows, key=dist)[2]


@contextmanager
def forced(kernel: str, cfg: dict[str, int]) -> Iterator[None]:
    """Every launch of ``kernel`` takes ``cfg`` within this block (a tuning sweep's way to
    time a kernel whose launcher picks its own configuration)."""
    before = _FORCED.get(kernel)
    _FORCED[kernel] = cfg
    try:
        yield
    finally:
        if before is None:
            _FORCED.pop(kernel, None)
        else:
            _FORCED[kernel] = before


def launch_options(cfg: dict[str, int]) -> dict[str, int]:
    """The keyword arguments Triton's launcher takes (``num_warps``, ``num_stages``)."""
    return {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
