"""Benchmark: the TT-linear halves op (comera_engine/ops/tt_linear_halves.py), forward and
backward with gates and bias, against its plain PyTorch reference, with the CPU backend
on and off; prints a table and writes experiments/results/bench_op_tt_linear_halves.json.

    python experiments/bench_op_tt_linear_halves.py [--rounds 7] [--threads N]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import bench_tt_linear_op  # noqa: E402

# (label, input factors, output factors, rank, rows)
CASES = [("768x768 r30, 4096 rows", [12, 8, 8], [8, 8, 12], 30, 4096),
         ("768x768 r8, 512 rows", [12, 8, 8], [8, 8, 12], 8, 512)]

if __name__ == "__main__":
    sys.exit(bench_tt_linear_op("halves", CASES))
