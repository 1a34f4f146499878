"""The parts of a CoMERA training step that are not the model: optimizer and bookkeeping.

For the six-encoder transformer (``--preset``), CoMERA and dense, one thread by default:

* ``AdamW step``: per-parameter loop (torch's CPU default), ``foreach`` and ``fused``
  kernels, on random gradients; a TT model has hundreds of small parameter tensors
  (cores and gates of every layer), where the per-parameter loop costs most;
* ``size surrogate``: ``tensor.size.surrogate`` over all layers at once (one quadratic
  form) against its sum layer by layer;
* ``gate refresh``: ``rank.optim.refresh_gates`` after an optimizer step.

Each row is the median of alternating rounds (the variants of a group take turns, in a
new random order each round), in milliseconds per call. Prints a table and writes
experiments/results/bench_step_overheads_<device>.json.

    python experiments/bench_step_overheads.py [--preset paper] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train_step import build_transformer  # noqa: E402
from benchlib import add_rounds_args, apply_rounds_args, machine, median_rounds_ms, print_and_write  # noqa: E402


def _bookkeeping(model: torch.nn.Module, rounds: int, reps: int) -> list[dict]:
    """Size surrogate (one pass against the per-layer sum) and gate refresh."""
    from comera_engine.layers import tt_layers
    from comera_engine.rank.optim import refresh_gates
    from comera_engine.tensor.size import surrogate

    layers = [m for _, m in tt_layers(model)]
    trains = [m.tt for m in layers]
    times = median_rounds_ms({
        "one pass": lambda: surrogate(trains),
        "per-layer sum": lambda: torch.stack([surrogate([t]) for t in trains]).sum(),
    }, rounds, reps)
    times |= median_rounds_ms({"refresh_gates": lambda: refresh_gates(model)}, rounds, reps)
    return [{"part": "gate refresh" if name == "refresh_gates" else "size surrogate",
             "model": "comera", "variant": name, "ms": ms, "tensors": len(layers),
             "params": None} for name, ms in times.items()]


def run(preset: str, rounds: int, reps: int) -> list[dict]:
    from comera_engine.rank import CoMERA

    rows = []
    for variant in ("comera", "dense"):
        torch.manual_seed(0)
        model = build_transformer(preset, dense=variant == "dense")
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.randn_like(p)
        groups = CoMERA(model).make_optimizer().param_groups
        opts = {}
        for impl in ("per-parameter", "foreach", "fused"):
            opt = torch.optim.AdamW([{k: v for k, v in g.items()
                                      if k not in ("foreach", "fused")} for g in groups],
                                    foreach=impl == "foreach", fused=impl == "fused")
            opts[impl] = opt.step
        for impl, ms in median_rounds_ms(opts, rounds, reps).items():
            rows.append({"part": "AdamW step", "model": variant, "variant": impl, "ms": ms,
                         "tensors": len(params), "params": sum(p.numel() for p in params)})
        if variant == "comera":
            rows += _bookkeeping(model, rounds, reps)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="paper", choices=["paper", "small", "tiny"])
    add_rounds_args(ap, rounds=7, reps=5, reps_help="calls per round and variant")
    args = ap.parse_args(argv)
    apply_rounds_args(ap, args)
    rows = run(args.preset, args.rounds, args.reps)
    print(f"\nstep overheads, transformer preset {args.preset}, CPU, {args.threads} thread(s)")
    print_and_write(rows, [("part", "part", ""), ("model", "model", ""),
                           ("variant", "variant", ""), ("ms", "ms per call", ".2f"),
                           ("tensors", "tensors / TT layers", "")],
                    "bench_step_overheads_cpu",
                    {"machine": machine(), "preset": args.preset, "threads": args.threads,
                     "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
