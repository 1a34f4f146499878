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

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))
from benchlib import graph_or_eager, machine, median_ms, print_table, write_json  # noqa: E402

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


def _timer(fn, x: torch.Tensor, dy: torch.Tensor, graph: bool):  # noqa: ANN001, ANN202
    def step() -> None:
        fn(x).backward(dy)

    return graph_or_eager(step, graph)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--rank", type=int, default=30)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu with TRITON_INTERPRET=1)")
    dtype = torch.bfloat16 if args.dtype == "bf16" and cuda else torch.float32
    rows = []
    for shape in args.shapes:
        n, m = (int(v) for v in shape.split("x"))
        for graph in ((False, True) if cuda else (False,)):
            variants = _variants(n, m, args.rank, args.device, dtype)
            x = torch.randn(args.tokens, n, device=args.device, dtype=dtype,
                            requires_grad=True)
            dy = torch.randn(args.tokens, m, device=args.device, dtype=dtype)
            with torch.autocast(args.device.split(":")[0], dtype=dtype, enabled=cuda):
                steps = {k: _timer(f, x, dy, graph) for k, f in variants.items()}
                med = median_ms(steps, args.rounds, args.reps, cuda)
            rows.append({"shape": shape, "rank": args.rank, "tokens": args.tokens,
                         "graph": graph, "dtype": str(dtype), "ms": med,
                         "fused_vs_halves": med["halves"] / med["fused"],
                         "fused_vs_linear": med["nn.Linear"] / med["fused"]})
    print(f"{args.device}, {dtype}, rank {args.rank}, {args.tokens} tokens, fwd+bwd medians")
    flat = [{"shape": r["shape"], "graph": r["graph"],
             **{f"{k} ms": v for k, v in r["ms"].items()},
             "vs halves": r["fused_vs_halves"], "vs linear": r["fused_vs_linear"]}
            for r in rows]
    print_table(flat, [("shape", "shape", ""), ("graph", "graph", ""),
                       ("fused ms", "fused ms", ".3f"), ("halves ms", "halves ms", ".3f"),
                       ("nn.Linear ms", "nn.Linear ms", ".3f"),
                       ("vs halves", "fused vs halves", ".2f"),
                       ("vs linear", "fused vs nn.Linear", ".2f")])
    payload = {"machine": machine(), "command": " ".join(["python", *sys.argv]), "rows": rows}
    path = write_json(f"bench_kernels_{args.device.split(':')[0]}", payload,
                      Path(args.out))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
