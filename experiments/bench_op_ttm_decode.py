"""Benchmark: the tied MLM decoder on a TTM word table (comera_engine/ops/ttm_decode.py),
forward and backward, against the path it replaced (build the V x d table from the cores,
then a matmul). Memory: on CUDA the peak allocated over the step; on CPU the bytes held
between forward and backward (tensors saved for backward, the output, the cores and their
gradients) plus the largest transient each path makes (the table's gradient, or two
chunks of T). Prints a table and writes experiments/results/bench_op_ttm_decode.json.

    python experiments/bench_op_ttm_decode.py [--rounds 5] [--threads N] [--device cuda]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    add_threads_arg,
    check_args,
    machine,
    print_table,
    time_pair,
    training_bytes,
    write_json,
)

from comera_engine.ops.ttm_decode import (  # noqa: E402
    CHUNK_ELEMENTS,
    decode_path,
    ttm_decode,
    ttm_decode_reference,
)
from comera_engine.ops.ttm_lookup import split_point  # noqa: E402
from comera_engine.tensor import TTMCores  # noqa: E402

# (label, vocabulary rows, row factors, column factors, d, rank, tokens scored)
CASES = [
    ("code-MLM tiny: V 2000, d 64, r 8, 307 masked", 2000, [10, 10, 20], [4, 4, 4], 64, 8, 307),
    ("paper: V 30522, d 768, r 32, 614 masked", 30522, [16, 20, 10, 10], [4, 4, 8, 6], 768,
     32, 614),
    ("paper: V 30522, d 768, r 32, 2048 tokens", 30522, [16, 20, 10, 10], [4, 4, 8, 6], 768,
     32, 2048),
]


def make(op: Callable, rows: list[int], cols: list[int], rank: int, V: int, d: int, n: int,
         device: torch.device) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor], int]:
    torch.manual_seed(0)
    tt = TTMCores(rows, cols, rank, device=device)
    cores = [c.detach().requires_grad_() for c in tt.cores]
    h = torch.randn(n, d, device=device, requires_grad=True)
    split = split_point(rows, cols, tt.ranks)

    def fwd() -> torch.Tensor:
        if op is ttm_decode:
            return op(h, cores, split, V, 0, path="tt")
        return op(h, cores, split, V, 0)

    def step() -> torch.Tensor:
        for p in (*cores, h):
            p.grad = None
        y = fwd()
        y.sum().backward()
        return y

    Vb = math.prod(rows[split:])
    Ea = math.prod(cols[:split])
    r = tt.ranks[split]
    if op is ttm_decode:  # two chunks of T (the forward's and the backward's gradient)
        chunk = max(1, CHUNK_ELEMENTS // (Ea * r * Vb))
        transient = 2 * min(n, chunk) * Ea * r * Vb * 4
    else:  # the table's gradient
        transient = V * d * 4
    return step, [*cores, h], transient, fwd


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating timing rounds")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--out", type=Path, default=None, help="JSON folder (experiments/results)")
    add_threads_arg(ap)
    args = ap.parse_args(argv)
    check_args(ap, args, ("rounds",))
    device = torch.device(args.device)
    rows = []
    for label, V, rf, cf, d, rank, n in CASES:
        tt_step, tt_params, tt_tr, tt_fwd = make(ttm_decode, rf, cf, rank, V, d, n, device)
        ref_step, ref_params, ref_tr, ref_fwd = make(ttm_decode_reference, rf, cf, rank, V, d,
                                                     n, device)
        t = time_pair(ref_step, tt_step, device, rounds=args.rounds)
        mem_tt = training_bytes(tt_fwd, tt_params, device)
        mem_ref = training_bytes(ref_fwd, ref_params, device)
        if device.type == "cpu":
            mem_tt, mem_ref = mem_tt + tt_tr, mem_ref + ref_tr
        ranks = TTMCores(rf, cf, rank, device="meta").ranks
        sp = split_point(rf, cf, ranks)
        auto = decode_path(n, math.prod(rf[:sp]), math.prod(cf[:sp]), ranks[sp],
                           math.prod(rf[sp:]), math.prod(cf[sp:]))
        rows.append({"case": label, "auto": auto, "table_ms": t.a_median * 1e3,
                     "tt_ms": t.b_median * 1e3,
                     "speedup": t.a_median / t.b_median,
                     "table_mib": mem_ref / 2**20, "tt_mib": mem_tt / 2**20,
                     "memory_ratio": mem_ref / mem_tt})
    print(f"\nttm_decode: tied decoder forward+backward, fp32, {device}, "
          f"{torch.get_num_threads()} threads")
    print_table(rows, [("case", "case", ""), ("table_ms", "table path ms", ".2f"),
                       ("tt_ms", "TT contraction ms", ".2f"), ("speedup", "speed-up", ".2f"),
                       ("table_mib", "table path MiB", ".1f"), ("tt_mib", "TT MiB", ".1f"),
                       ("memory_ratio", "memory table/TT", ".2f"),
                       ("auto", "path=auto picks", "")])
    out = write_json("bench_op_ttm_decode", {"machine": machine(), "device": str(device),
                                             "rows": rows}, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
