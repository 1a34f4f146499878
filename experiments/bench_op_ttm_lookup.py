"""Benchmark: the TTM lookup op (comera_engine/ops/ttm_lookup.py), forward and backward,
against its reference (the per-token contraction, ttm_lookup_naive); prints a table and
writes experiments/results/bench_op_ttm_lookup.json (the op has no backend part: the
two op columns differ by noise only).

    python experiments/bench_op_ttm_lookup.py [--rounds 7] [--threads N]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import bench_op  # noqa: E402

from comera_engine.ops.ttm_lookup import ttm_lookup, ttm_lookup_naive  # noqa: E402
from comera_engine.tensor import TTMCores  # noqa: E402

# (label, row factors, column factors, rank, tokens)
CASES = [("30522x768 r30, 4096 tokens", [18, 39, 44], [8, 8, 12], 30, 4096),
         ("1024x256 r16, 512 tokens", [8, 8, 16], [4, 8, 8], 16, 512)]


def step(op: Callable, rows: list[int], cols: list[int], rank: int, tokens: int
         ) -> Callable[[], object]:
    cores = [c.detach().requires_grad_() for c in TTMCores(rows, cols, rank).cores]
    V = 1
    for v in rows:
        V *= v
    ids = torch.randint(0, V, (tokens,), generator=torch.Generator().manual_seed(0))

    def run() -> object:
        for c in cores:
            c.grad = None
        y = op(ids, cores)
        y.sum().backward()
        return y

    return run


if __name__ == "__main__":
    sys.exit(bench_op("ttm_lookup", [(label, step(ttm_lookup, *case), step(ttm_lookup_naive, *case))
                                     for label, *case in CASES]))
