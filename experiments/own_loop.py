"""CoMERA in your own training loop: a network defined in this file (not a preset),
trained with the public API, against the same network trained dense in the same loop.

The network reads scikit-learn's 8×8 digits as 64 tokens (pixel position × intensity
0–16) through an embedding table, flattens them and classifies with two hidden layers;
every layer but the 10-way head becomes TT (``tensorize(rank="auto")``: initial ranks
from the target), and ``CoMERA`` takes it to the size asked while it trains. Accuracy is
measured on 300 digits that neither training nor the choice of any setting saw. Prints a
table and writes experiments/results/own_loop.json.

    python experiments/own_loop.py [--target 30] [--steps 1500] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import comera_engine as ce
from comera_engine.store.layout import write_atomic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class DigitNet(nn.Module):
    """Per-position intensity embeddings (64 positions × 17 levels, 16 wide), flattened,
    through two hidden layers of 256 to a 10-way head."""

    def __init__(self, dim: int = 16, hidden: int = 256) -> None:
        super().__init__()
        self.pixels = nn.Embedding(64 * 17, dim)
        self.fc1 = nn.Linear(64 * dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 10)
        self.register_buffer("offset", torch.arange(64) * 17)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pixels(x + self.offset).flatten(1)
        return self.head(F.relu(self.fc2(F.relu(self.fc1(h)))))


def load_digits_split(seed: int = 0) -> dict[str, torch.Tensor]:
    """Digits as intensity ids: 1,497 to train on, the last 300 of a fixed shuffle held
    out (the same for every run)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x = torch.as_tensor(x, dtype=torch.long)[order]
    y = torch.as_tensor(y, dtype=torch.long)[order]
    return {"x": x[:-300], "y": y[:-300], "x_test": x[-300:], "y_test": y[-300:]}


def train(data: dict[str, torch.Tensor], seed: int, steps: int, target: float | None,
          batch: int = 64) -> dict:
    """One run: CoMERA at ``target`` (``None``: the dense network), the loop of the
    README's "Your own model and training loop"."""
    torch.manual_seed(seed)
    model = DigitNet()
    if target is not None:
        ce.tensorize(model, rank="auto", target_compression=target, exclude=["head"])
    comera = ce.CoMERA(model, target_compression=target, total_steps=steps, lr_cores=3e-3,
                       lr_embedding=1e-2, lr_gates=1e-2, lr_dense=1e-3, weight_decay=0.0)
    opt = torch.optim.AdamW(comera.param_groups())
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    for _ in range(steps):
        i = torch.randint(0, len(data["y"]), (batch,), generator=g)
        loss = comera.loss(F.cross_entropy(model(data["x"][i]), data["y"][i]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        comera.step(opt)
    seconds = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        acc = float((model(data["x_test"]).argmax(1) == data["y_test"]).float().mean())
    rep = comera.report()
    params = sum(p.numel() for p in model.parameters())
    return {"seed": seed, "method": "dense" if target is None else "CoMERA",
            "target": target, "compression": rep["compression"] if target else 1.0,
            "scope": rep["scope"], "params": rep["params"] if target else params,
            "test_acc": acc, "seconds": seconds, "message": rep["message"],
            "ranks": rep["ranks"]}


def summarize(rows: list[dict], methods: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per method of ``methods``: its rows' held-out accuracy, mean and std over the
    seeds (std 0 for one), and the least and most compression reached."""
    summary = {}
    for method in methods:
        accs = [r["test_acc"] for r in rows if r["method"] == method]
        comp = [r["compression"] for r in rows if r["method"] == method]
        summary[method] = {"test_acc_mean": statistics.mean(accs),
                           "test_acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                           "compression_min": min(comp), "compression_max": max(comp)}
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=float, default=30.0, help="compression asked (TT layers)")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--out", type=Path, default=RESULTS / "own_loop.json")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.threads < 1:
        ap.error("--steps, --threads: must be positive integers")
    if not args.target > 1:
        ap.error("--target: must be a ratio above 1 (e.g. 30 for 30x smaller)")
    torch.set_num_threads(args.threads)
    data = load_digits_split()
    rows = []
    for seed in args.seeds:
        for target in (None, args.target):
            row = train(data, seed, args.steps, target)
            rows.append(row)
            print(f"seed {seed} {row['method']:6s} test acc {row['test_acc']:.3f}  "
                  f"{row['params']:>7,} params  {row['seconds']:.1f} s  {row['message']}")
    summary = summarize(rows, ("dense", "CoMERA"))
    c, d = summary["CoMERA"], summary["dense"]
    print(f"\ntarget {args.target:g}x (TT layers): reached {c['compression_min']:.1f}x to "
          f"{c['compression_max']:.1f}x; held-out accuracy CoMERA "
          f"{c['test_acc_mean'] * 100:.1f} ± {c['test_acc_std'] * 100:.1f} % against dense "
          f"{d['test_acc_mean'] * 100:.1f} ± {d['test_acc_std'] * 100:.1f} % "
          f"({len(args.seeds)} seeds, {args.steps} steps)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps({"target": args.target, "steps": args.steps,
                                       "threads": args.threads, "machine": machine(),
                                       "summary": summary, "runs": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
