"""Benchmark: TT-linear forward+backward against ``nn.Linear`` at the paper's shapes.

Shapes 768×768 ([12,8,8 | 8,8,12]), 768→3072 ([12,8,8 | 12,16,16]), 3072→768
([16,16,12 | 8,8,12]); ranks {4, 8, 16, 30, 64}; tokens {32, 4096}; fp32. The input
requires grad (a hidden layer). Dense and TT steps are timed in alternating rounds
(``benchlib.time_pair``) so each ratio is measured side by side; the table gives the
ratio of median rounds and of best rounds. Prints a table (MAC ratio, measured time
ratio, path the planner chose, peak-memory ratio) and writes
experiments/results/bench_tt_linear_<device>.json.

    python experiments/bench_tt_linear.py [--device cuda] [--quick] [--cpu-gemm mkl]

On CPU each of the TT layer's batch GEMMs runs the faster of two ways on this machine
(MKL or oneDNN; ``aᵀ·b`` or ``(bᵀ·a)ᵀ``: ``comera_engine.tensor.gemm``, ``--cpu-gemm``
forces one backend). Either way may also beat ``nn.Linear``'s own choice on the dense
shapes, so the summary also times a dense linear whose three GEMMs go through the same
choice (``dense, tuned GEMMs``) and gives the TT speed-up against it, and TT with the
choice against TT on MKL alone and on oneDNN alone.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    halves_step_choices,
    keep_freed_memory_as_training_does,
    machine,
    print_table,
    time_pair,
    training_bytes,
    write_json,
)

from comera_engine import TTLinear  # noqa: E402
from comera_engine.tensor import contract, gemm  # noqa: E402

SHAPES = [
    ("768x768", 768, 768, [12, 8, 8], [8, 8, 12]),
    ("768x3072", 768, 3072, [12, 8, 8], [12, 16, 16]),
    ("3072x768", 3072, 768, [16, 16, 12], [8, 8, 12]),
]


def hidden_step(forward: Callable[[], torch.Tensor], x: torch.Tensor, dy: torch.Tensor,
                params: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A closure running ``forward()`` (which reads ``x``) and its backward as a hidden
    layer in a training step: the upstream gradient ``dy`` is given, ``dX`` is handed on,
    and the gradients of ``x`` and ``params`` start empty as after
    ``optimizer.zero_grad(set_to_none=True)`` (the trainer's call), so they are stored,
    not added into running sums."""

    def step() -> torch.Tensor:
        x.grad = None
        for p in params:
            p.grad = None
        y = forward()
        y.backward(dy)
        return y

    return step


def fwd_bwd(module: nn.Module, x: torch.Tensor, dy: torch.Tensor
            ) -> Callable[[], torch.Tensor]:
    """:func:`hidden_step` of ``module(x)`` over the module's parameters."""
    return hidden_step(lambda: module(x), x, dy, list(module.parameters()))


class _TunedDenseFn(torch.autograd.Function):
    """``y = x·Wᵀ + b`` with its three GEMMs through ``gemm`` (each the faster way on this
    machine, as in the TT layer), for the backend check."""

    @staticmethod
    def forward(ctx, x, w, b):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, w)
        return gemm.nt(x, w) + b

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, w = ctx.saved_tensors
        return gemm.nn(dy, w), gemm.tn(dy, x), dy.sum(0)


class _TunedDense(nn.Module):
    def __init__(self, dense: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = dense.weight, dense.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _TunedDenseFn.apply(x, self.weight, self.bias)


def backend_check(rounds: int) -> dict:
    """768×768 at rank 30 and 4096 tokens on CPU: ``nn.Linear`` against the dense linear
    with tuned GEMMs, that against the TT layer, and the TT layer with the tuned choice
    against TT on MKL alone and on oneDNN alone, each pair in alternating rounds."""
    dense = nn.Linear(768, 768)
    x = torch.randn(4096, 768, requires_grad=True)
    dy = torch.randn(4096, 768)
    tt = TTLinear(768, 768, rank=30, in_factors=[12, 8, 8], out_factors=[8, 8, 12])
    tuned = _TunedDense(dense)
    cpu = torch.device("cpu")

    def on(backend: str, step):  # noqa: ANN001, ANN202
        def run_step() -> torch.Tensor:
            gemm.CPU_GEMM = backend
            return step()
        return run_step

    t1 = time_pair(fwd_bwd(dense, x, dy), on("auto", fwd_bwd(tuned, x, dy)), cpu,
                   rounds=rounds)
    t2 = time_pair(on("auto", fwd_bwd(tuned, x, dy)), on("auto", fwd_bwd(tt, x, dy)), cpu,
                   rounds=rounds)
    tt_step = fwd_bwd(tt, x, dy)
    t3 = time_pair(on("mkl", tt_step), on("auto", tt_step), cpu, rounds=rounds)
    t4 = time_pair(on("onednn", tt_step), on("auto", tt_step), cpu, rounds=rounds)
    gemm.CPU_GEMM = "auto"
    steps = halves_step_choices(4096, 768, contract._padded_width(30, bias=True), 768)
    return {"steps": steps, "linear_ms": t1.a_median * 1e3, "dense_tuned_ms": t1.b_median * 1e3,
            "dense_tuned_speedup_over_linear": t1.a_median / t1.b_median,
            "tt_ms": t2.b_median * 1e3, "tt_speedup_vs_dense_tuned": t2.a_median / t2.b_median,
            "tt_speedup_vs_dense_tuned_best": t2.a_best / t2.b_best,
            "tt_mkl_ms": t3.a_median * 1e3, "tt_tuned_speedup_over_mkl": t3.a_median / t3.b_median,
            "tt_onednn_ms": t4.a_median * 1e3,
            "tt_tuned_speedup_over_onednn": t4.a_median / t4.b_median}


def run(device: torch.device, ranks: list[int], tokens: list[int], rounds: int = 9
        ) -> list[dict]:
    rows = []
    for name, fin, fout, inf, outf in SHAPES:
        dense = nn.Linear(fin, fout, device=device)
        for B in tokens:
            x = torch.randn(B, fin, device=device, requires_grad=True)
            dy = torch.randn(B, fout, device=device)

            m_dense = training_bytes(partial(dense, x), list(dense.parameters()), device)
            for r in ranks:
                tt = TTLinear(fin, fout, rank=r, in_factors=inf, out_factors=outf,
                              device=device)
                info = tt.explain(B)
                path = info["path"]
                c = info["paths"][path]

                t = time_pair(fwd_bwd(dense, x, dy), fwd_bwd(tt, x, dy), device, rounds=rounds)
                m_tt = training_bytes(partial(tt, x), list(tt.parameters()), device)
                rows.append({
                    "shape": name, "tokens": B, "rank": r, "path": path,
                    "mac_ratio": info["dense_linear_macs_fwd_bwd"] / (c["macs_fwd"]
                                                                      + c["macs_bwd"]),
                    "dense_ms": t.a_median * 1e3, "tt_ms": t.b_median * 1e3,
                    "speedup": t.a_median / t.b_median, "speedup_best": t.a_best / t.b_best,
                    "mem_ratio": m_dense / m_tt,
                    "params_ratio": sum(p.numel() for p in dense.parameters())
                    / tt.num_params(False),
                })
                print(f"  {name} B={B} r={r}: {path} {t.a_median / t.b_median:.2f}x",
                      file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="ranks 8 and 30 only")
    ap.add_argument("--ranks", type=int, nargs="+", help="ranks (default 4 8 16 30 64)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 4096])
    ap.add_argument("--rounds", type=int, default=9, help="alternating timing rounds")
    ap.add_argument("--out", type=Path, default=None, help="JSON folder (experiments/results)")
    ap.add_argument("--cpu-gemm", choices=["auto", "onednn", "mkl"], default="auto",
                    help="how the TT layer's batch GEMMs reach BLAS on CPU: the faster of "
                    "two ways per product on this machine (auto, the default), or one "
                    "backend for all")
    args = ap.parse_args(argv)
    keep_freed_memory_as_training_does()
    device = torch.device(args.device)
    if args.cpu_gemm == "onednn" and gemm.onednn_linear() is None:
        ap.error("--cpu-gemm: this PyTorch build has no oneDNN linear op; use --cpu-gemm mkl")
    gemm.CPU_GEMM = args.cpu_gemm
    ranks = args.ranks or ([8, 30] if args.quick else [4, 8, 16, 30, 64])
    rows = run(device, ranks, args.tokens, args.rounds)
    print(f"\nTT-linear vs nn.Linear, forward+backward, fp32, device={device.type}")
    print_table(rows, [("shape", "shape", ""), ("tokens", "tokens", ""), ("rank", "rank", ""),
                       ("path", "path", ""), ("mac_ratio", "MAC ratio", ".1f"),
                       ("dense_ms", "dense ms", ".3f"), ("tt_ms", "TT ms", ".3f"),
                       ("speedup", "speed-up", ".2f"), ("speedup_best", "best-round", ".2f"),
                       ("mem_ratio", "mem ratio", ".2f"),
                       ("params_ratio", "params ratio", ".1f")])
    key = [r for r in rows if r["shape"] == "768x768" and r["tokens"] == 4096
           and r["rank"] == 30]
    summary = {
        "worst_speedup": min(r["speedup"] for r in rows),
        "worst_speedup_best": min(r["speedup_best"] for r in rows),
        "speedup_768_r30_4096": key[0]["speedup"] if key else None,
        "speedup_best_768_r30_4096": key[0]["speedup_best"] if key else None,
    }
    print(f"\nworst speed-up {summary['worst_speedup']:.2f}x median rounds, "
          f"{summary['worst_speedup_best']:.2f}x best rounds (target >= 1/1.1 = 0.91x)")
    if key:
        print(f"768x768 r30 4096 tokens: {key[0]['speedup']:.2f}x median rounds, "
              f"{key[0]['speedup_best']:.2f}x best rounds (target >= 8x)")
    summary["cpu_gemm"] = args.cpu_gemm if device.type == "cpu" else None
    if (device.type == "cpu" and args.cpu_gemm == "auto" and key
            and gemm.onednn_linear() is not None):
        chk = backend_check(args.rounds)
        summary["backend_check"] = chk
        print(f"backend check (768x768 r30 4096 tokens): nn.Linear {chk['linear_ms']:.1f} ms, "
              f"dense with tuned GEMMs {chk['dense_tuned_ms']:.1f} ms "
              f"({chk['dense_tuned_speedup_over_linear']:.2f}x); TT {chk['tt_ms']:.2f} ms = "
              f"{chk['tt_speedup_vs_dense_tuned']:.2f}x median, "
              f"{chk['tt_speedup_vs_dense_tuned_best']:.2f}x best vs the tuned dense; "
              f"TT tuned vs on MKL alone {chk['tt_tuned_speedup_over_mkl']:.2f}x "
              f"({chk['tt_mkl_ms']:.2f} ms), vs on oneDNN alone "
              f"{chk['tt_tuned_speedup_over_onednn']:.2f}x ({chk['tt_onednn_ms']:.2f} ms); "
              "the step's batch GEMMs on this machine: "
              + ", ".join(f"{k} {v}" for k, v in chk["steps"].items()))
    out = write_json(f"bench_tt_linear_{device.type}", {"machine": machine(), "rows": rows,
                                                        "summary": summary}, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
