"""Install-time choice of the GEMM ways (called by :mod:`.build` only, never in a run).

On representative operands (a 768→768 layer, middle width 32 (rank 30 plus the bias row),
4096 rows: the halves step's shape in the paper's benchmarks), each product role
(:data:`.gemm.ROLES`) is timed both ways, alternating, best of :data:`ROUNDS` calls;
then each whole step, the products one by one (in the ways just chosen) against the
row-blocked C++ step. The result (ways, seconds, machine, threads) goes to the build's
``choices.json``; runs read it through :class:`.gemm.Ways`.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from . import step
from .gemm import KINDS, ROLES, Ways, onednn_linear, run

__all__ = ["ROUNDS", "best", "operands", "tune_ways"]

ROUNDS = 7
TOKENS, N, WIDTH, M = 4096, 768, 32, 768


def best(fns: list[Callable[[], object]], rounds: int = ROUNDS) -> list[float]:
    """Best-of-``rounds`` seconds of each of ``fns``, timed alternating (one warm-up call
    each first)."""
    for f in fns:
        f()
    out = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            out[i] = min(out[i], time.perf_counter() - t0)
    return out


def operands(tokens: int = TOKENS, n: int = N, width: int = WIDTH, m: int = M
             ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per product role, its operands for ``tokens`` rows of an ``n``→``m`` layer of
    padded middle width ``width`` (default: the representative shape)."""
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(tokens, n, generator=g), torch.randn(tokens, m, generator=g)
    Lp, Rp = torch.randn(n, width, generator=g), torch.randn(width, m, generator=g)
    XL, dXL = x @ Lp, dy @ Rp.t()
    return {"xl": (x, Lp), "y": (XL, Rp), "dxl": (dy, Rp), "dx": (dXL, Lp),
            "dr": (XL, dy), "dl": (x, dXL)}


def _machine() -> str:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} | {platform.machine()} | {torch.backends.cpu.get_cpu_capability()}"


def tune_ways(ops: ModuleType) -> dict:
    """Time every role both ways on this machine; returns the ``choices.json`` content:
    ``{"ways": {role: name}, "seconds": {role: [way 0, way 1]}, "machine", "threads",
    "shape"}``."""
    chosen: dict[str, int] = {}
    seconds: dict[str, list[float]] = {}
    for role, (a, b) in operands().items():
        kind = ROLES[role]
        if kind != "tn" and onednn_linear() is None:
            continue  # one way only
        t = best([lambda k=kind, w=w, a=a, b=b: run(k, w, a, b) for w in (0, 1)])
        seconds[role], chosen[role] = t, int(t[1] < t[0])
    ops_ = operands()
    x, Lp = ops_["xl"]
    dy, Rp = ops_["dxl"]
    XL = ops_["y"][0]

    def whole(role: str, blocked: int) -> Callable[[], object]:
        ways = Ways({**chosen, role: blocked})
        if role == "halves-fwd":
            return lambda: step.batch_forward(ops, ways, x, Lp, Rp, 30)
        return lambda: step.batch_backward(ops, ways, dy, x, XL, Lp, Rp, True, True)

    for role in ("halves-fwd", "halves-bwd"):
        t = best([whole(role, 0), whole(role, 1)])
        seconds[role], chosen[role] = t, int(t[1] < t[0])
    return {"ways": {r: KINDS[ROLES[r]][w] for r, w in chosen.items()},
            "seconds": seconds, "machine": _machine(), "threads": torch.get_num_threads(),
            "shape": {"tokens": TOKENS, "n": N, "width": WIDTH, "m": M}}
