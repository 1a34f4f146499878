"""Benchmark: the gated TT-matrix's W (comera_engine/ops/ttm_matrix.py), forward and
backward with the gates trained, against its PyTorch reference (ttm_matrix_reference),
with the CPU backend on and off. Prints a table and writes
experiments/results/bench_op_ttm_matrix.json.

    python experiments/bench_op_ttm_matrix.py [--rounds 7] [--threads N]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import bench_op  # noqa: E402

from comera_engine.ops.ttm_matrix import ttm_matrix, ttm_matrix_reference  # noqa: E402
from comera_engine.tensor import TTMCores  # noqa: E402

# (label, row factors, column factors, rank): the digits MLP's two layers, a BERT-size one
CASES = [("64x256 r6 (digits)", [4, 4, 4], [4, 8, 8], 6),
         ("256x256 r6 (digits)", [8, 8, 4], [4, 8, 8], 6),
         ("768x768 r16", [12, 8, 8], [8, 8, 12], 16)]


def step(op: Callable, rows: list[int], cols: list[int], rank: int) -> Callable[[], object]:
    tt = TTMCores(rows, cols, rank)

    def run() -> object:
        for p in tt.parameters():
            p.grad = None
        cores, gates, alive = tt.parts()  # the gates: views of the one gate tensor
        W = op(cores, gates, alive, tt.tau)
        W.sum().backward()
        return W

    return run


if __name__ == "__main__":
    sys.exit(bench_op("ttm_matrix", [(label, step(ttm_matrix, *case),
                                      step(ttm_matrix_reference, *case))
                                     for label, *case in CASES]))
