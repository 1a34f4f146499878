"""Benchmark: the TT-linear sweep op (comera_engine/ops/tt_linear_sweep.py) at the small
batches it is planned for, forward and backward with gates and bias, against its plain
PyTorch reference, with the CPU backend on and off. Table on stdout, JSON in
experiments/results/bench_op_tt_linear_sweep.json. Usage:
``python experiments/bench_op_tt_linear_sweep.py [--rounds 7] [--threads N]``."""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from benchlib import bench_tt_linear_op

    # (label, input factors, output factors, rank, rows): rank 64 at 32 rows, the paper's
    # worst sweep row, and rank 30 at 8 rows, where per-op cost is all there is
    sys.exit(bench_tt_linear_op("sweep", [
        ("768x768 r64, 32 rows", [12, 8, 8], [8, 8, 12], 64, 32),
        ("768x768 r30, 8 rows", [12, 8, 8], [8, 8, 12], 30, 8)]))
