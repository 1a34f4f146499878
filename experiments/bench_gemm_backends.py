"""The halves path's four batch GEMMs on the two CPU GEMM backends: MKL against oneDNN.

A TT-linear step on the halves path runs four batch-sized ``a·wᵀ`` products (plus two
reductions over the batch, which stay on MKL): ``X·L`` and ``dY·Rᵀ`` contract the wide
feature axis (``k`` = 768 or 3072: "reducing"), ``XL·R`` and ``dXL·Lᵀ`` expand the
padded middle rank (``k`` = 32: "expanding"). ``contract._onednn_for`` picks the backend
per product; this script measures each product on both, with the CPU caches evicted
before every call (a 64 MiB pass), as inside a step, where the batch tensors (12.6 MB
each at 4096×768) do not stay in cache from one GEMM to the next. Calls run in shuffled
rounds so that host load hits both backends alike.

    python experiments/bench_gemm_backends.py [--shape 768x768] [--rank 30] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    add_threads_arg,
    check_args,
    keep_freed_memory_as_training_does,
    machine,
    print_table,
    write_json,
)

from comera_engine.tensor import contract  # noqa: E402

SHAPES = {"768x768": (768, 768), "768x3072": (768, 3072), "3072x768": (3072, 768)}


def products(n: int, m: int, rank: int, tokens: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per product ``a·wᵀ``: ``(a, w)`` as the halves step has them (fp32, contiguous)."""
    g = torch.Generator().manual_seed(0)
    rp = contract._padded_width(rank, bias=True)
    x, dy = torch.randn(tokens, n, generator=g), torch.randn(tokens, m, generator=g)
    lp, rp_ = torch.randn(n, rp, generator=g) / n**0.5, torch.randn(rp, m, generator=g) / rp**0.5
    xl, dxl = x @ lp, dy @ rp_.t()
    return {
        "X·L (reducing)": (x, lp.t().contiguous()),
        "dY·Rᵀ (reducing)": (dy, rp_),
        "XL·R (expanding)": (xl, rp_.t().contiguous()),
        "dXL·Lᵀ (expanding)": (dxl, lp),
    }


def run(shape: str, rank: int, tokens: int, rounds: int) -> list[dict]:
    op = contract.onednn_linear()
    if op is None:
        raise SystemExit("this PyTorch build has no oneDNN linear op: nothing to compare")
    n, m = SHAPES[shape]
    evict = torch.ones(16 * 2**20)  # 64 MiB, twice this CPU's L3

    calls, prods = {}, products(n, m, rank, tokens)
    for name, (a, w) in prods.items():
        calls[(name, "mkl")] = lambda a=a, w=w: torch.mm(a, w.t())
        calls[(name, "onednn")] = lambda a=a, w=w: op(a, w, None, "none", [], "")
    for fn in calls.values():  # warm-up: oneDNN builds its primitives on first use
        fn()
    times: dict[tuple[str, str], list[float]] = {k: [] for k in calls}
    order, shuffle = list(calls), random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for key in order:
            evict.sum()  # reads: evicts without leaving dirty lines to write back
            t0 = time.perf_counter()
            calls[key]()
            times[key].append(time.perf_counter() - t0)
    rows = []
    for name, (a, w) in prods.items():
        mk, dn = times[(name, "mkl")], times[(name, "onednn")]
        rows.append({
            "product": name, "m": a.shape[0], "k": a.shape[1], "n": w.shape[0],
            "mkl_ms": statistics.median(mk) * 1e3, "onednn_ms": statistics.median(dn) * 1e3,
            "mkl_best_ms": min(mk) * 1e3, "onednn_best_ms": min(dn) * 1e3,
            "onednn_speedup": statistics.median(mk) / statistics.median(dn),
            "chosen": "onednn" if contract._onednn_for(a, w) is not None else "mkl",
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="768x768", choices=list(SHAPES))
    ap.add_argument("--rank", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=31, help="shuffled rounds, one call each")
    add_threads_arg(ap)
    ap.add_argument("--out", type=Path, default=None, help="JSON folder (experiments/results)")
    args = ap.parse_args(argv)
    keep_freed_memory_as_training_does()
    check_args(ap, args, ("rank", "tokens", "rounds"))
    rows = run(args.shape, args.rank, args.tokens, args.rounds)
    width = contract._padded_width(args.rank, bias=True)
    print(f"\n{args.shape}, rank {args.rank} (padded {width}), "
          f"{args.tokens} tokens, fp32, {torch.get_num_threads()} threads, caches evicted "
          "before each call: the halves step's batch GEMMs on MKL and oneDNN")
    print_table(rows, [("product", "product a·wᵀ", ""), ("m", "m", ""), ("k", "k", ""),
                       ("n", "n", ""), ("mkl_ms", "MKL ms", ".3f"),
                       ("onednn_ms", "oneDNN ms", ".3f"), ("mkl_best_ms", "MKL best", ".3f"),
                       ("onednn_best_ms", "oneDNN best", ".3f"),
                       ("onednn_speedup", "oneDNN speed-up", ".2f"),
                       ("chosen", "layer uses", "")])
    out = write_json("bench_gemm_backends_cpu",
                     {"machine": machine(), "shape": args.shape, "rank": args.rank,
                      "tokens": args.tokens, "rounds": args.rounds,
                      "threads": torch.get_num_threads(), "rows": rows}, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
