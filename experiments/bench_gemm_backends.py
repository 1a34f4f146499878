"""The halves path's six batch GEMMs, each both ways it can run, and the way the layer takes.

A TT-linear step on the halves path runs six batch-sized products
(``comera_engine.backends.cpu.gemm``): ``X·L`` and ``dY·Rᵀ`` contract the wide feature axis
(``k`` = 768 or 3072: "reducing"), ``XL·R`` and ``dXL·Lᵀ`` expand the padded middle
rank (``k`` = 32: "expanding"); each runs on MKL or oneDNN. ``XLᵀ·dY`` and ``Xᵀ·dXL``
sum over the batch; each runs as ``aᵀ·b`` or ``(bᵀ·a)ᵀ`` on MKL. This script measures
every product both ways, with the CPU caches evicted before every call (a 64 MiB pass),
as inside a step, where the batch tensors (12.6 MB each at 4096×768) do not stay in
cache from one GEMM to the next, and prints the way the layer takes on this install (the
CPU backend's ways, chosen by its build; the fixed rule without the backend).
Beside them, two floors: *stream*, one pass over the product's batch-sized tensors (read
the inputs, write the output) under the same eviction, and *MAC-bound*, its MACs at the
rate of the dense GEMM of the layer's shape (what ``nn.Linear`` runs at). Calls run in
shuffled rounds so that host load hits all alike.

    python experiments/bench_gemm_backends.py [--shape 768x768] [--rank 30] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

from comera_engine.backends import cpu_backend  # noqa: E402
from comera_engine.backends.cpu import gemm  # noqa: E402
from comera_engine.ops.tt_linear_halves import padded_width  # noqa: E402

SHAPES = {"768x768": (768, 768), "768x3072": (768, 3072), "3072x768": (3072, 768)}


def products(n: int, m: int, rank: int, tokens: int
             ) -> dict[str, tuple[str, torch.Tensor, torch.Tensor, int]]:
    """Per product: ``(role, a, b, default)`` as the halves step passes them to the
    backend's ways (fp32, contiguous; ``default``: the ``aᵀ·b`` form of the fixed rule)."""
    g = torch.Generator().manual_seed(0)
    rp = padded_width(rank, bias=True)
    x, dy = torch.randn(tokens, n, generator=g), torch.randn(tokens, m, generator=g)
    lp, rp_ = torch.randn(n, rp, generator=g) / n**0.5, torch.randn(rp, m, generator=g) / rp**0.5
    xl, dxl = x @ lp, dy @ rp_.t()
    return {
        "X·L (reducing)": ("xl", x, lp, 0),
        "XL·R (expanding)": ("y", xl, rp_, 0),
        "dY·Rᵀ (reducing)": ("dxl", dy, rp_, 0),
        "XLᵀ·dY (batch sum)": ("dr", xl, dy, int(rp % 16 == 0)),  # as TTLinearHalves
        "dXL·Lᵀ (expanding)": ("dx", dxl, lp, 0),
        "Xᵀ·dXL (batch sum)": ("dl", x, dxl, 0),
    }


def stream(reads: list[torch.Tensor], write: torch.Tensor | None) -> None:
    """One pass over a product's batch-sized tensors: read its inputs, write its output
    (a floor for the product itself, whatever its arithmetic)."""
    for t in reads:
        t.sum()
    if write is not None:
        write.fill_(1.0)


def mac_rate(tokens: int, n: int, m: int) -> float:
    """MACs per second of the dense ``(tokens×n)·(n×m)`` GEMM (hot, best of 5): the rate
    the TT products would run at if they were compute-bound like ``nn.Linear``."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(tokens, n, generator=g), torch.randn(n, m, generator=g)
    best = float("inf")
    for _ in range(6):
        t0 = time.perf_counter()
        torch.mm(x, w)
        best = min(best, time.perf_counter() - t0)
    return tokens * n * m / best


def run(shape: str, rank: int, tokens: int, rounds: int) -> list[dict]:
    if gemm.onednn_linear() is None:
        raise SystemExit("this PyTorch build has no oneDNN linear op: nothing to compare")
    n, m = SHAPES[shape]
    evict = torch.ones(16 * 2**20)  # 64 MiB
    backend = cpu_backend()
    ways = backend.ways if backend is not None else gemm.Ways()

    calls, prods = {}, products(n, m, rank, tokens)
    wide = tokens * min(n, m)  # a batch-sized tensor (the rank-wide ones are 24x smaller)
    for name, (role, a, b, default) in prods.items():
        for way in (0, 1):
            calls[(name, way)] = partial(gemm.run, gemm.ROLES[role], way, a, b)
        out = ways.product(role, a, b, default)
        calls[(name, "stream")] = partial(
            stream, [t for t in (a, b) if t.numel() >= wide],
            torch.empty_like(out) if out.numel() >= wide else None)
    for fn in calls.values():  # warm-up: oneDNN builds its primitives on first use
        fn()
    rate = mac_rate(tokens, n, m)
    times: dict[tuple[str, int | str], list[float]] = {k: [] for k in calls}
    order, shuffle = list(calls), random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for key in order:
            evict.sum()  # reads: evicts without leaving dirty lines to write back
            t0 = time.perf_counter()
            calls[key]()
            times[key].append(time.perf_counter() - t0)
    rows = []
    for name, (role, a, b, default) in prods.items():
        kind = gemm.ROLES[role]
        t0, t1 = times[(name, 0)], times[(name, 1)]
        dims = (a.shape[1] if kind == "tn" else a.shape[0],
                a.shape[0] if kind == "tn" else a.shape[1],
                b.shape[0] if kind == "nt" else b.shape[1])
        rows.append({
            "product": name, "kind": kind, "m": dims[0], "k": dims[1], "n": dims[2],
            "stream_ms": statistics.median(times[(name, "stream")]) * 1e3,
            "mac_bound_ms": dims[0] * dims[1] * dims[2] / rate * 1e3,
            "way0": gemm.KINDS[kind][0], "way1": gemm.KINDS[kind][1],
            "way0_ms": statistics.median(t0) * 1e3, "way1_ms": statistics.median(t1) * 1e3,
            "way0_best_ms": min(t0) * 1e3, "way1_best_ms": min(t1) * 1e3,
            "way1_speedup": statistics.median(t0) / statistics.median(t1),
            "chosen": gemm.KINDS[kind][ways.way(role, a, b, default)],
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="768x768", choices=list(SHAPES))
    ap.add_argument("--rank", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=31, help="shuffled rounds, one call each")
    bl.add_threads_arg(ap)
    ap.add_argument("--out", type=Path, default=None, help="JSON folder (experiments/results)")
    args = ap.parse_args(argv)
    bl.keep_freed_memory_as_training_does()
    bl.check_args(ap, args, ("rank", "tokens", "rounds"))
    rows = run(args.shape, args.rank, args.tokens, args.rounds)
    width = padded_width(args.rank, bias=True)
    print(f"\n{args.shape}, rank {args.rank} (padded {width}), "
          f"{args.tokens} tokens, fp32, {torch.get_num_threads()} threads, caches evicted "
          "before each call: the halves step's batch GEMMs both ways (MKL | oneDNN; "
          "ab = aᵀ·b | ba = (bᵀ·a)ᵀ)")
    bl.print_table(rows, [("product", "product", ""), ("m", "m", ""), ("k", "k", ""),
                       ("n", "n", ""), ("way0", "way 0", ""), ("way0_ms", "ms", ".3f"),
                       ("way0_best_ms", "best", ".3f"), ("way1", "way 1", ""),
                       ("way1_ms", "ms", ".3f"), ("way1_best_ms", "best", ".3f"),
                       ("way1_speedup", "way 1 speed-up", ".2f"),
                       ("chosen", "layer uses", ""), ("stream_ms", "stream ms", ".3f"),
                       ("mac_bound_ms", "MAC-bound ms", ".3f")])
    print("stream: reading the product's batch-sized inputs and writing its batch-sized "
          "output once, caches evicted (sum / fill_); MAC-bound: its MACs at the dense "
          f"{args.tokens}x{SHAPES[args.shape][0]}x{SHAPES[args.shape][1]} GEMM's rate")
    backend = cpu_backend()
    if backend is None:
        print("the CPU backend is not in use: the layer takes the fixed rule (way 0)")
    else:
        names = backend.ways.names()
        print("the layer's whole step on this install (row-blocked in C++, or the products "
              f"above one by one): halves-fwd {names['halves-fwd']}, halves-bwd "
              f"{names['halves-bwd']} (chosen by the build, in {backend.folder})")
    out = bl.write_json("bench_gemm_backends_cpu",
                     {"machine": bl.machine(), "shape": args.shape, "rank": args.rank,
                      "tokens": args.tokens, "rounds": args.rounds,
                      "threads": torch.get_num_threads(), "rows": rows}, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
