"""Benchmark: the gated TT-matrix's W (comera_engine/ops/ttm_matrix.py), forward and
backward with the gates trained, against its PyTorch reference (ttm_matrix_reference),
with the CPU backend on and off; and W with the layer's size surrogate from the same node
(ttm_matrix_sized, a loss in both) against the reference and the surrogate's expression
(rank.size.layer_size_surrogate). Prints a table and writes
experiments/results/bench_op_ttm_matrix.json.

    python experiments/bench_op_ttm_matrix.py [--rounds 7] [--threads N]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import bench_op  # noqa: E402

from comera_engine.ops.ttm_matrix import (  # noqa: E402
    ttm_matrix,
    ttm_matrix_reference,
    ttm_matrix_sized,
)
from comera_engine.rank.size import layer_size_surrogate  # noqa: E402
from comera_engine.tensor import TTMCores  # noqa: E402

# (label, row factors, column factors, rank): the digits MLP's two layers, a BERT-size one
CASES = [("64x256 r6 (digits)", [4, 4, 4], [4, 8, 8], 6),
         ("256x256 r6 (digits)", [8, 8, 4], [4, 8, 8], 6),
         ("768x768 r16", [12, 8, 8], [8, 8, 12], 16)]


def step(op: Callable, rows: list[int], cols: list[int], rank: int) -> Callable[[], object]:
    tt = TTMCores(rows, cols, rank)
    cores, gates, alive = tt.parts()

    def run() -> object:
        for p in (*cores, *gates):
            p.grad = None
        W = op(cores, gates, alive, tt.tau)
        W.sum().backward()
        return W

    return run


def sized_step(reference: bool, rows: list[int], cols: list[int], rank: int
               ) -> Callable[[], object]:
    """W and the layer's size surrogate, a loss in both (the CoMERA objective's use)."""
    tt = TTMCores(rows, cols, rank)
    cores, gates, alive = tt.parts()
    layer = SimpleNamespace(tt=tt)

    def run() -> object:
        for p in (*cores, *gates):
            p.grad = None
        if reference:
            W = ttm_matrix_reference(cores, gates, alive, tt.tau)
            s_hat = layer_size_surrogate(layer)
        else:
            W, sized = ttm_matrix_sized(cores, gates, alive, tt.tau)  # no pair on PyTorch:
            s_hat = layer_size_surrogate(layer) if sized is None else sized[0]  # its own
        (W.sum() + 1e-3 * s_hat).backward()
        return W

    return run


if __name__ == "__main__":
    sys.exit(bench_op("ttm_matrix", [(label, step(ttm_matrix, *case),
                                      step(ttm_matrix_reference, *case))
                                     for label, *case in CASES]
                      + [(f"{label}, with Ŝ", sized_step(False, *case),
                          sized_step(True, *case)) for label, *case in CASES[:2]]))
