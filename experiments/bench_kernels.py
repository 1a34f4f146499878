"""The TT-linear's paths side by side with nn.Linear, at the paper's shapes: the fused
Triton chain, the PyTorch halves path and the reconstructed W, forward + backward, eager
and inside a CUDA graph, each with its % of the roofline.

    python experiments/bench_kernels.py                 # on a CUDA GPU
    TRITON_INTERPRET=1 python experiments/bench_kernels.py --device cpu --shapes 64x48 \\
        --tokens 37 --reps 1                            # a smoke run of the code (no timing value)

Every variant runs as a layer does (``tensor.planner.tt_linear`` with its path forced:
the cores and gates merged inside each step; the fused path with the Triton kernels on,
their launch configurations from the device's profile where it has one). ``% roofline``:
the least time the layer's work can take on this GPU's datasheet peaks (the TT layer's
batch products and ``X``, ``Y``, ``dY``, ``dX`` moved once, ``tensor.roofline``) over the
time measured; nn.Linear against its own work. Prints a table and writes
experiments/results/bench_kernels_<device>.json. Ratios are medians of alternating rounds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))
import benchlib as bl  # noqa: E402

from comera_engine import TTLinear  # noqa: E402
from comera_engine.tensor.planner import tt_linear  # noqa: E402
from comera_engine.tensor.roofline import linear_traffic, tt_linear_traffic  # noqa: E402

#: the paper's shapes and factors (others: factors chosen automatically)
PAPER = {"768x768": ([12, 8, 8], [8, 8, 12]), "768x3072": ([12, 8, 8], [12, 16, 16]),
         "3072x768": ([16, 16, 12], [8, 8, 12])}


def _variants(n: int, m: int, rank: int, device: str) -> tuple[dict, TTLinear]:
    """Forward of each path of one TT layer (fp32 parameters: autocast runs them in the
    bench's dtype) and of a dense nn.Linear of the same size."""
    ins, outs = PAPER.get(f"{n}x{m}", (None, None))
    tt = TTLinear(n, m, rank=rank, in_factors=ins, out_factors=outs).to(device)
    dense = torch.nn.Linear(n, m).to(device)
    d = len(tt.in_factors)

    def path(p: str):  # noqa: ANN202
        def forward(x: torch.Tensor) -> torch.Tensor:
            # the gates as the layer passes them: the one gate vector (the fused path
            # splits it into per-bond views inside the step: views made once outside, on
            # the default stream, would leave their gradient's accumulator on that stream
            # and a CUDA graph's capture of the backward would fail)
            cores, gate, alive = tt.tt.flat_parts()
            return tt_linear(x, cores, d, p, tt.bias, gate, tt.tt.tau, alive)

        return forward

    return {"fused": path("fused"), "halves": path("halves"), "dense": path("dense"),
            "nn.Linear": dense}, tt


def main(argv: list[str] | None = None) -> int:
    p = bl.fused_bench_parser(__doc__.splitlines()[0], rank=30)
    p.add_argument("--shapes", nargs="+", default=list(PAPER))
    args = p.parse_args(argv)
    cuda, dtype = bl.fused_bench_dtype(p, args)
    rows = []
    for shape in args.shapes:
        n, m = (int(v) for v in shape.split("x"))
        for graph in ((False, True) if cuda else (False,)):
            variants, tt = _variants(n, m, args.rank, args.device)
            x = torch.randn(args.tokens, n, device=args.device, dtype=dtype,
                            requires_grad=True)
            dy = torch.randn(args.tokens, m, device=args.device, dtype=dtype)
            # no cast cache (as the trainer's step): casts cached while warming up would
            # be read inside the CUDA graph's capture
            with torch.autocast(args.device.split(":")[0], dtype=dtype, enabled=cuda,
                                cache_enabled=False):
                med = bl.median_fwd_bwd_ms(variants, x, dy, graph, args.rounds, args.reps, cuda)
            elt = torch.empty((), dtype=dtype).element_size()
            tt_work = tt_linear_traffic(args.tokens, n, m, args.rank,
                                        sum(c.numel() for c in tt.tt.cores), elt)
            work = {k: tt_work for k in ("fused", "halves", "dense")}
            work["nn.Linear"] = linear_traffic(args.tokens, n, m, elt)
            rows.append({"shape": shape, "rank": args.rank, "tokens": args.tokens,
                         "graph": graph, "dtype": str(dtype), "ms": med,
                         "roofline": bl.roofline_cells(med, work, args.device, dtype),
                         "fused_vs_halves": med["halves"] / med["fused"],
                         "fused_vs_linear": med["nn.Linear"] / med["fused"],
                         "best_tt_vs_linear": med["nn.Linear"] / min(
                             med[k] for k in ("fused", "halves", "dense")),
                         "macs_ratio": n * m / (args.rank * (n + m))})
    print(f"{args.device}, {dtype}, rank {args.rank}, {args.tokens} tokens, fwd+bwd medians")
    bl.report_fused(f"bench_kernels_{args.device.split(':')[0]}", rows, ["shape", "graph"],
                 {"fused_vs_halves": "fused vs halves", "fused_vs_linear": "fused vs nn.Linear",
                  "best_tt_vs_linear": "best TT vs nn.Linear"}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
