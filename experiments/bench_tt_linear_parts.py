"""Where a TT-linear step's time goes: the layer against its own parts, side by side.

One row per variant, each a forward+backward as a hidden layer (given upstream gradient,
``dX`` handed on, gradients starting empty), all timed in alternating rounds of repeated
steps, in a new random order each round, so the differences are measured side by side:

* ``nn.Linear``: the dense reference;
* ``layer``: ``TTLinear`` as the trainer calls it (planner, gates and their masks, bias);
* ``function, gates given``: the planner's contraction Function with the gates (masks
  computed inside) and the bias, its argument lists built once outside the loop (drops
  the layer wrapper);
* ``function, no gates``: the same on the raw cores, with the bias (drops the gates);
* ``function, no gates, no bias``: the bare contraction.

Consecutive differences are the cost of that part. ``--shape 8x8`` (cores
``[2,2,2 | 2,2,2]``, arithmetic negligible) measures the fixed cost of a step: Python,
dispatch and autograd per op, what bounds small batches. With ``--ref REV``, a row
``layer @ REV`` adds the same layer (same initial values, outputs checked equal) built
from ``comera_engine`` as it was at git revision ``REV``: a before/after comparison
timed side by side in one process, where separate runs on a shared machine differ by
more than most changes. Prints a table and writes
experiments/results/bench_tt_linear_parts_<device>.json.

    python experiments/bench_tt_linear_parts.py [--rank 64] [--tokens 32] [--shape 768x768]
        [--path sweep] [--threads 1] [--ref HEAD~1]
"""

from __future__ import annotations

import argparse
import importlib
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tt_linear import SHAPES, fwd_bwd, hidden_step  # noqa: E402
from benchlib import (  # noqa: E402
    add_threads_arg,
    check_args,
    keep_freed_memory_as_training_does,
    machine,
    print_table,
    time_rounds,
    write_json,
)

from comera_engine import TTLinear  # noqa: E402
from comera_engine.tensor.contract import tt_linear  # noqa: E402


def layer_class_at(rev: str, folder: Path) -> type:
    """``TTLinear`` as it was at git revision ``rev``: ``comera_engine`` from
    ``git archive`` unpacked into ``folder`` as the package ``comera_at_ref`` (its
    layers and tensor modules import each other relatively)."""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", rev,
                          "comera_engine"], capture_output=True, check=False)
    if out.returncode != 0:
        msg = out.stderr.decode(errors="replace").strip().splitlines()
        raise SystemExit(f"--ref: git archive {rev!r} failed ({msg[-1] if msg else 'no git'});"
                         " give a commit of this repository, e.g. HEAD~1")
    with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tar:
        tar.extractall(folder, filter="data")
    (folder / "comera_engine").rename(folder / "comera_at_ref")
    sys.path.insert(0, str(folder))
    return importlib.import_module("comera_at_ref.layers.tt_linear").TTLinear


# the paper's shapes, and one whose arithmetic is negligible: the fixed cost of a step
PART_SHAPES = [*SHAPES, ("8x8", 8, 8, [2, 2, 2], [2, 2, 2])]


def run(shape: str, rank: int, tokens: int, rounds: int, reps: int,
        device: torch.device, ref: str | None = None, ref_dir: Path | None = None,
        path: str | None = None) -> list[dict]:
    _, fin, fout, inf, outf = next(s for s in PART_SHAPES if s[0] == shape)
    torch.manual_seed(0)
    x = torch.randn(tokens, fin, device=device, requires_grad=True)
    dy = torch.randn(tokens, fout, device=device)
    dense = nn.Linear(fin, fout, device=device)

    def build(cls: type) -> nn.Module:
        torch.manual_seed(1)
        return cls(fin, fout, rank=rank, in_factors=inf, out_factors=outf, device=device)

    layer = build(TTLinear)
    tt = layer.tt
    layer.path = path  # None: the planner's choice
    path = path or layer.explain(tokens)["path"]
    cores = [c.detach().clone().requires_grad_() for c in tt.cores]
    bias = layer.bias.detach().clone().requires_grad_()
    t_cores, t_gates, t_alive = tt.parts()
    paths = {"nn.Linear": "dense"}
    variants = {
        "nn.Linear": fwd_bwd(dense, x, dy),
        "layer": fwd_bwd(layer, x, dy),
    }
    if ref is not None:
        old = build(layer_class_at(ref, ref_dir))
        old.path = layer.path
        with torch.no_grad():
            y, y_old = layer(x), old(x)
        if not torch.allclose(y, y_old, rtol=1e-4, atol=1e-5):
            raise SystemExit(f"--ref: the layer at {ref} computes another function "
                             f"(max difference {float((y - y_old).abs().max()):.3g})")
        variants[f"layer @ {ref}"] = fwd_bwd(old, x, dy)
        paths[f"layer @ {ref}"] = old.path or old.explain(tokens)["path"]
    variants |= {
        "function, gates given": hidden_step(
            lambda: tt_linear(x, t_cores, tt.d, path, bias=layer.bias, gates=t_gates,
                              tau=tt.tau, alive=t_alive),
            x, dy, list(layer.parameters())),
        "function, no gates": hidden_step(lambda: tt_linear(x, cores, tt.d, path, bias=bias),
                                    x, dy, [*cores, bias]),
        "function, no gates, no bias": hidden_step(lambda: tt_linear(x, cores, tt.d, path),
                                             x, dy, cores),
    }
    times = time_rounds(variants, device, rounds, reps, warmup=3)
    ref_med = statistics.median(times["nn.Linear"])
    ref_best = min(times["nn.Linear"])
    rows = []
    for k, ts in times.items():
        med, best = statistics.median(ts), min(ts)
        rows.append({"variant": k, "path": paths.get(k, path),
                     "ms": med * 1e3, "best_ms": best * 1e3,
                     "speedup": ref_med / med, "speedup_best": ref_best / best})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="768x768", choices=[s[0] for s in PART_SHAPES])
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=15, help="alternating timing rounds")
    ap.add_argument("--reps", type=int, default=20, help="steps per round and variant")
    ap.add_argument("--path", default=None, choices=["halves", "sweep"],
                    help="contraction path (default: the planner's)")
    add_threads_arg(ap)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=None, help="JSON folder (experiments/results)")
    ap.add_argument("--ref", default=None, metavar="REV",
                    help="also time the layer as it was at this git revision (e.g. HEAD~1)")
    args = ap.parse_args(argv)
    keep_freed_memory_as_training_does()
    check_args(ap, args, ("rank", "tokens", "rounds", "reps"))
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(args.shape, args.rank, args.tokens, args.rounds, args.reps, device,
                   args.ref, Path(tmp), args.path)
    print(f"\n{args.shape}, rank {args.rank}, {args.tokens} tokens, fp32, "
          f"device={device.type}, {torch.get_num_threads()} threads: the TT step "
          "against its parts")
    print_table(rows, [("variant", "variant", ""), ("path", "path", ""),
                       ("ms", "median ms", ".3f"), ("best_ms", "best ms", ".3f"),
                       ("speedup", "vs nn.Linear (median)", ".2f"),
                       ("speedup_best", "vs nn.Linear (best)", ".2f")])
    out = write_json(f"bench_tt_linear_parts_{device.type}",
                     {"machine": machine(), "shape": args.shape, "rank": args.rank,
                      "tokens": args.tokens, "ref": args.ref, "path": args.path,
                      "threads": torch.get_num_threads(), "rows": rows}, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
