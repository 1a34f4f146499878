"""The fused Triton TT-linear against the PyTorch halves path and nn.Linear, side by side in
one process, forward + backward, eager and inside a CUDA graph, at the paper's shapes.

    python experiments/bench_kernels.py                 # on a CUDA GPU
    TRITON_INTERPRET=1 python experiments/bench_kernels.py --device cpu --shapes 64x48 \\
        --tokens 37 --reps 1                            # a smoke run of the code (no timing value)

Prints a table and writes experiments/results/bench_kernels_<device>.json. Targets (issue
16): fused >= 1.3x the halves path at 4096 tokens, rank 30, 768x768, and >= 5x nn.Linear at
768x3072. Ratios are medians of alternating rounds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))
from benchlib import fused_bench_dtype, fused_bench_parser, median_fwd_bwd_ms, report_fused  # noqa: E402

from comera_engine import TTLinear  # noqa: E402
from comera_engine.kernels.tt_linear import tt_linear_chain  # noqa: E402
from comera_engine.ops.tt_linear_halves import tt_linear_halves  # noqa: E402

SHAPES = ("768x768", "768x3072", "3072x768")


def _variants(n: int, m: int, rank: int, device: str, dtype: torch.dtype) -> dict:
    """Three steps (forward + backward) of the same layer: fused kernels, the PyTorch
    halves Function, a dense nn.Linear of the same size."""
    tt = TTLinear(n, m, rank=rank).to(device)
    dense = torch.nn.Linear(n, m).to(device)
    cores, gates, alive = tt.tt.parts()
    d = len(tt.in_factors)

    def halves(x: torch.Tensor) -> torch.Tensor:
        return tt_linear_halves(x, cores, d, tt.bias, gates, tt.tt.tau, alive)

    L = torch.randn(n, rank, device=device, dtype=dtype, requires_grad=True)
    R = torch.randn(rank, m, device=device, dtype=dtype, requires_grad=True)
    b = torch.zeros(m, device=device, dtype=dtype, requires_grad=True)
    return {"fused": lambda x: tt_linear_chain(x, L, R, b), "halves": halves,
            "nn.Linear": dense}


def main(argv: list[str] | None = None) -> int:
    p = fused_bench_parser(__doc__.splitlines()[0], rank=30)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = p.parse_args(argv)
    cuda, dtype = fused_bench_dtype(p, args)
    rows = []
    for shape in args.shapes:
        n, m = (int(v) for v in shape.split("x"))
        for graph in ((False, True) if cuda else (False,)):
            variants = _variants(n, m, args.rank, args.device, dtype)
            x = torch.randn(args.tokens, n, device=args.device, dtype=dtype,
                            requires_grad=True)
            dy = torch.randn(args.tokens, m, device=args.device, dtype=dtype)
            with torch.autocast(args.device.split(":")[0], dtype=dtype, enabled=cuda):
                med = median_fwd_bwd_ms(variants, x, dy, graph, args.rounds, args.reps, cuda)
            rows.append({"shape": shape, "rank": args.rank, "tokens": args.tokens,
                         "graph": graph, "dtype": str(dtype), "ms": med,
                         "fused_vs_halves": med["halves"] / med["fused"],
                         "fused_vs_linear": med["nn.Linear"] / med["fused"]})
    print(f"{args.device}, {dtype}, rank {args.rank}, {args.tokens} tokens, fwd+bwd medians")
    report_fused(f"bench_kernels_{args.device.split(':')[0]}", rows, ["shape", "graph"],
                 {"fused_vs_halves": "fused vs halves", "fused_vs_linear": "fused vs nn.Linear"},
                 args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
