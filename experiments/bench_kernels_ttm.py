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

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))
from benchlib import graph_or_eager, machine, median_ms, print_table, write_json  # noqa: E402

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


def _timer(fn, ids: torch.Tensor, dy: torch.Tensor, graph: bool):  # noqa: ANN001, ANN202
    def step() -> None:
        fn(ids).backward(dy)

    return graph_or_eager(step, graph)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", nargs="+", type=int, default=[16, 20, 10, 10])
    p.add_argument("--cols", nargs="+", type=int, default=[4, 4, 8, 6])
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu with TRITON_INTERPRET=1)")
    if len(args.rows) != len(args.cols):
        p.error("--rows and --cols: give as many factors each")
    dtype = torch.bfloat16 if args.dtype == "bf16" and cuda else torch.float32
    V = math.prod(args.rows)
    ids = torch.randint(0, V, (args.tokens,), device=args.device,
                        generator=torch.Generator(args.device).manual_seed(0))
    out_rows = []
    for graph in ((False, True) if cuda else (False,)):
        variants = _variants(args.rows, args.cols, args.rank, args.device, dtype)
        dy = torch.randn(args.tokens, math.prod(args.cols), device=args.device, dtype=dtype)
        steps = {k: _timer(f, ids, dy, graph) for k, f in variants.items()}
        med = median_ms(steps, args.rounds, args.reps, cuda)
        out_rows.append({"rows": args.rows, "cols": args.cols, "rank": args.rank,
                         "tokens": args.tokens, "graph": graph, "dtype": str(dtype),
                         "ms": med, "fused_vs_gather": med["gather"] / med["fused"],
                         "fused_vs_embedding": med["nn.Embedding"] / med["fused"]})
    print(f"{args.device}, {dtype}, V {V}, rank {args.rank}, {args.tokens} ids, fwd+bwd medians")
    flat = [{"graph": r["graph"], **{f"{k} ms": v for k, v in r["ms"].items()},
             "vs gather": r["fused_vs_gather"], "vs embedding": r["fused_vs_embedding"]}
            for r in out_rows]
    print_table(flat, [("graph", "graph", ""), ("fused ms", "fused ms", ".3f"),
                       ("gather ms", "gather ms", ".3f"),
                       ("nn.Embedding ms", "nn.Embedding ms", ".3f"),
                       ("vs gather", "fused vs gather", ".2f"),
                       ("vs embedding", "fused vs nn.Embedding", ".2f")])
    payload = {"machine": machine(), "command": " ".join(["python", *sys.argv]), "rows": out_rows}
    path = write_json(f"bench_kernels_ttm_{args.device.split(':')[0]}", payload,
                      Path(args.out))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
