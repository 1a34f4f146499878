"""The fused Triton TTM lookup against the PyTorch gather path (ops.ttm_lookup: merged
half tables, gather, batched GEMM) and nn.Embedding, side by side in one process, forward
+ backward, eager and inside a CUDA graph, at the paper's word embedding.

    python experiments/bench_kernels_ttm.py            # on a CUDA GPU
    TRITON_INTERPRET=1 python experiments/bench_kernels_ttm.py --device cpu --tokens 37 \\
        --rows 5 4 3 --cols 2 3 2 --rank 5 --reps 1 --rounds 1   # a smoke run (no timing value)

The three variants look up the same ids (``--tokens`` of them, no dedup: the form a
captured step uses); the half tables are merged from the cores inside each step, as a
training step does. Prints a table and writes experiments/results/bench_kernels_ttm_<device>.json.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))
from benchlib import fused_bench_dtype, fused_bench_parser, median_fwd_bwd_ms, report_fused  # noqa: E402

from comera_engine.kernels.ttm_lookup import ttm_lookup_fused  # noqa: E402
from comera_engine.ops.ttm_lookup import merge_tables, split_point  # noqa: E402
from comera_engine.tensor.tt import TTMCores  # noqa: E402


def _variants(rows: list[int], cols: list[int], rank: int, device: str,
              dtype: torch.dtype) -> dict:
    tt = TTMCores(rows, cols, rank).to(device)
    cores = [c.detach().to(dtype).requires_grad_() for c in tt.cores]
    h = split_point(rows, cols, tt.ranks)
    Vb = math.prod(rows[h:])
    dense = torch.nn.Embedding(math.prod(rows), math.prod(cols)).to(device, dtype)

    def fused(ids: torch.Tensor) -> torch.Tensor:
        A, Bt = merge_tables(cores, h)
        return ttm_lookup_fused(ids, A, Bt)

    def gather(ids: torch.Tensor) -> torch.Tensor:
        A, Bt = merge_tables(cores, h)
        a, b = torch.div(ids, Vb, rounding_mode="floor"), torch.remainder(ids, Vb)
        return torch.bmm(A[a], Bt[b]).reshape(ids.shape[0], -1)

    return {"fused": fused, "gather": gather, "nn.Embedding": dense}


def main(argv: list[str] | None = None) -> int:
    p = fused_bench_parser(__doc__.splitlines()[0], rank=32)
    p.add_argument("--rows", nargs="+", type=int, default=[16, 20, 10, 10])
    p.add_argument("--cols", nargs="+", type=int, default=[4, 4, 8, 6])
    args = p.parse_args(argv)
    cuda, dtype = fused_bench_dtype(p, args)
    if len(args.rows) != len(args.cols):
        p.error("--rows and --cols: give as many factors each")
    V = math.prod(args.rows)
    ids = torch.randint(0, V, (args.tokens,), device=args.device,
                        generator=torch.Generator(args.device).manual_seed(0))
    out_rows = []
    for graph in ((False, True) if cuda else (False,)):
        variants = _variants(args.rows, args.cols, args.rank, args.device, dtype)
        dy = torch.randn(args.tokens, math.prod(args.cols), device=args.device, dtype=dtype)
        med = median_fwd_bwd_ms(variants, ids, dy, graph, args.rounds, args.reps, cuda)
        out_rows.append({"rows": args.rows, "cols": args.cols, "rank": args.rank,
                         "tokens": args.tokens, "graph": graph, "dtype": str(dtype),
                         "ms": med, "fused_vs_gather": med["gather"] / med["fused"],
                         "fused_vs_embedding": med["nn.Embedding"] / med["fused"]})
    print(f"{args.device}, {dtype}, V {V}, rank {args.rank}, {args.tokens} ids, fwd+bwd medians")
    report_fused(f"bench_kernels_ttm_{args.device.split(':')[0]}", out_rows, ["graph"],
                 {"fused_vs_gather": "fused vs gather",
                  "fused_vs_embedding": "fused vs nn.Embedding"}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
