"""The TTM embedding lookup's paths side by side with nn.Embedding, at the paper's word
embedding: the fused Triton lookup, the PyTorch gather path (merged half tables, gather,
batched GEMM) and the reconstructed table, forward + backward, eager and inside a CUDA
graph, each with its % of the roofline.

    python experiments/bench_kernels_ttm.py            # on a CUDA GPU
    TRITON_INTERPRET=1 python experiments/bench_kernels_ttm.py --device cpu --tokens 37 \\
        --rows 5 4 3 --cols 2 3 2 --rank 5 --reps 1 --rounds 1   # a smoke run (no timing value)

The variants look up the same ids (``--tokens`` of them) as a layer does
(``tensor.lookup.lookup_rows`` with its path forced: the gates absorbed and the tables
merged inside each step; inside a graph no dedup, the form a captured step uses). ``%
roofline``: the least time the lookup's work can take on this GPU's datasheet peaks (the
rows' products, the rows and their gradient moved once) over the time measured. Prints a
table and writes experiments/results/bench_kernels_ttm_<device>.json.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))
import benchlib as bl  # noqa: E402

from comera_engine.ops.ttm_lookup import split_point  # noqa: E402
from comera_engine.tensor.lookup import lookup_rows  # noqa: E402
from comera_engine.tensor.roofline import lookup_traffic  # noqa: E402
from comera_engine.tensor.tt import TTMCores  # noqa: E402


def _variants(rows: list[int], cols: list[int], rank: int, device: str,
              dtype: torch.dtype) -> tuple[dict, TTMCores]:
    tt = TTMCores(rows, cols, rank).to(device)
    cores = [c.detach().to(dtype).requires_grad_() for c in tt.cores]
    gates = [g.detach().to(dtype).requires_grad_() for g in tt.gates]
    alive = tt.bond_alive()
    h = split_point(rows, cols, tt.ranks)
    dense = torch.nn.Embedding(math.prod(rows), math.prod(cols)).to(device, dtype)

    def path(p: str):  # noqa: ANN202
        return lambda ids: lookup_rows(ids, cores, gates, alive, tt.tau, p, h)

    return {"fused": path("fused"), "gather": path("gather"), "dense": path("dense"),
            "nn.Embedding": dense}, tt


def main(argv: list[str] | None = None) -> int:
    p = bl.fused_bench_parser(__doc__.splitlines()[0], rank=32)
    p.add_argument("--rows", nargs="+", type=int, default=[16, 20, 10, 10])
    p.add_argument("--cols", nargs="+", type=int, default=[4, 4, 8, 6])
    args = p.parse_args(argv)
    cuda, dtype = bl.fused_bench_dtype(p, args)
    if len(args.rows) != len(args.cols):
        p.error("--rows and --cols: give as many factors each")
    V, D = math.prod(args.rows), math.prod(args.cols)
    ids = torch.randint(0, V, (args.tokens,), device=args.device,
                        generator=torch.Generator(args.device).manual_seed(0))
    out_rows = []
    for graph in ((False, True) if cuda else (False,)):
        variants, tt = _variants(args.rows, args.cols, args.rank, args.device, dtype)
        dy = torch.randn(args.tokens, D, device=args.device, dtype=dtype)
        med = bl.median_fwd_bwd_ms(variants, ids, dy, graph, args.rounds, args.reps, cuda)
        h = split_point(args.rows, args.cols, tt.ranks)
        ea, eb = math.prod(args.cols[:h]), math.prod(args.cols[h:])
        elt = torch.empty((), dtype=dtype).element_size()
        work = {k: lookup_traffic(args.tokens, D, args.tokens * ea * tt.ranks[h] * eb,
                                  sum(c.numel() for c in tt.cores), elt)
                for k in ("fused", "gather", "dense")}
        work["nn.Embedding"] = lookup_traffic(args.tokens, D, 0, V * D, elt)
        out_rows.append({"rows": args.rows, "cols": args.cols, "rank": args.rank,
                         "tokens": args.tokens, "graph": graph, "dtype": str(dtype),
                         "ms": med, "roofline": bl.roofline_cells(med, work, args.device, dtype),
                         "fused_vs_gather": med["gather"] / med["fused"],
                         "fused_vs_embedding": med["nn.Embedding"] / med["fused"],
                         "best_tt_vs_embedding": med["nn.Embedding"] / min(
                             med[k] for k in ("fused", "gather", "dense"))})
    print(f"{args.device}, {dtype}, V {V}, rank {args.rank}, {args.tokens} ids, fwd+bwd medians")
    bl.report_fused(f"bench_kernels_ttm_{args.device.split(':')[0]}", out_rows, ["graph"],
                 {"fused_vs_gather": "fused vs gather",
                  "fused_vs_embedding": "fused vs nn.Embedding",
                  "best_tt_vs_embedding": "best TT vs nn.Embedding"}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
