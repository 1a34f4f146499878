"""Benchmark: TTM embedding lookup, forward+backward.

30522×768 table with the paper's factors ([16,20,10,10] × [4,4,8,6], rank 32); batches
of 4k, 20k and 40k ids drawn Zipf-like (p(k) ∝ 1/k^1.1). Compares the optimised lookup
(unique ids, two merged half-tables, one batched GEMM) against
(a) the per-token core-by-core TTM lookup, same cores (time and peak step memory), and
(b) ``nn.Embedding`` trained with Adam (training memory: weights, grads, Adam state).
Prints a table and writes experiments/results/bench_tt_embedding_<device>.json.

    python experiments/bench_tt_embedding.py [--device cuda] [--batches 4096 20480 40960]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    keep_freed_memory_as_training_does,
    machine,
    print_table,
    time_fn,
    training_bytes,
    write_json,
)

from comera_engine import TTEmbedding  # noqa: E402
from comera_engine.tensor.lookup import ttm_lookup_naive  # noqa: E402

V, D = 30522, 768


def zipf_ids(n: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = 1.0 / torch.arange(1, V + 1, dtype=torch.float64) ** 1.1
    ranks = torch.multinomial(w, n, replacement=True, generator=g)
    perm = torch.randperm(V, generator=g)  # frequent ids spread over the table
    return perm[ranks].to(device)


def adam_state_bytes(params: list[torch.Tensor]) -> int:
    """Weights + grads + Adam's two moments, measured after a real Adam step."""
    opt = torch.optim.Adam(params, lr=1e-3)
    opt.step()
    total = 0
    for p in params:
        total += 2 * p.numel() * p.element_size()  # weight + grad
        for v in opt.state[p].values():
            if torch.is_tensor(v) and v.numel() > 1:
                total += v.numel() * v.element_size()
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[4096, 20480, 40960])
    args = ap.parse_args(argv)
    keep_freed_memory_as_training_does()
    device = torch.device(args.device)
    torch.manual_seed(0)
    emb = TTEmbedding(V, D, rank=32, vocab_factors=[16, 20, 10, 10], dim_factors=[4, 4, 8, 6],
                      device=device)
    dense = nn.Embedding(V, D, device=device)
    rows = []
    for B in args.batches:
        ids = zipf_ids(B, device)

        def opt_step(ids: torch.Tensor = ids) -> torch.Tensor:
            y = emb(ids)
            y.backward(torch.ones_like(y))
            return y

        def naive_fwd(ids: torch.Tensor = ids) -> torch.Tensor:
            return ttm_lookup_naive(ids, emb.tt.gated_cores())

        def naive_step() -> torch.Tensor:
            y = naive_fwd()
            y.backward(torch.ones_like(y))
            return y

        t_opt = time_fn(opt_step, device)
        t_naive = time_fn(naive_step, device, min_time=0.1, warmup=1)
        params = list(emb.parameters())
        m_opt = training_bytes(lambda ids=ids: emb(ids), params, device)
        m_naive = training_bytes(naive_fwd, params, device)
        m_tt_adam = adam_state_bytes(params)
        dense.weight.grad = torch.zeros_like(dense.weight)
        m_dense_adam = adam_state_bytes([dense.weight])
        rows.append({
            "batch": B, "unique": int(torch.unique(ids).numel()),
            "naive_ms": t_naive * 1e3, "opt_ms": t_opt * 1e3, "speedup_vs_naive": t_naive / t_opt,
            "naive_step_mb": m_naive / 2**20, "opt_step_mb": m_opt / 2**20,
            "mem_ratio_vs_naive": m_naive / m_opt,
            "dense_adam_mb": m_dense_adam / 2**20, "tt_adam_mb": m_tt_adam / 2**20,
            "train_mem_ratio_vs_dense": m_dense_adam / m_tt_adam,
        })
        print(f"  batch {B}: {t_naive / t_opt:.2f}x vs naive", file=sys.stderr)
    print(f"\nTTM embedding {V}x{D}, rank 32, forward+backward, fp32, device={device.type}")
    print_table(rows, [("batch", "ids", ""), ("unique", "unique", ""),
                       ("naive_ms", "naive ms", ".2f"), ("opt_ms", "optimised ms", ".2f"),
                       ("speedup_vs_naive", "speed-up", ".2f"),
                       ("naive_step_mb", "naive step MB", ".1f"),
                       ("opt_step_mb", "opt step MB", ".1f"),
                       ("mem_ratio_vs_naive", "mem ratio", ".2f"),
                       ("dense_adam_mb", "nn.Embedding+Adam MB", ".1f"),
                       ("tt_adam_mb", "TT+Adam MB", ".2f"),
                       ("train_mem_ratio_vs_dense", "train mem ratio", ".1f")])
    out = write_json(f"bench_tt_embedding_{device.type}", {"machine": machine(), "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
