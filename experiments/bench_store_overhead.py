"""Step-time overhead of the run store's StoreSink on a small torch training loop.

Runs the same MLP training step with no sink and with a StoreSink (and a JSONL sink for
reference), in interleaved blocks so machine noise hits every variant alike, and reports
the median per-step time and the overhead. Every step logs the metrics a CoMERA trainer
logs (loss, accuracy, lr, grad norm, size, ...), rank snapshots every 10 steps and an
event every 100.

    .venv/bin/python experiments/bench_store_overhead.py [--steps 1500] [--rounds 5]

Writes ``experiments/results/bench_store_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from comera_engine.metrics import JSONLSink  # noqa: E402
from comera_engine.store import RunStore, StoreSink  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_store_overhead.json"

SIZES = {
    # name: (in, hidden, out, batch)
    "mlp-small": (784, 512, 10, 128),  # a realistic small step (~ms on a CPU core)
    "mlp-tiny": (64, 64, 10, 32),  # a stress case: very short steps, logging dominates
}


def make_loop(size: str, seed: int = 0) -> Any:
    d_in, hidden, d_out, batch = SIZES[size]
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(d_in, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, d_out),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    xs = torch.randn(16, batch, d_in)
    ys = torch.randint(0, d_out, (16, batch))
    n_params = sum(p.numel() for p in model.parameters())

    def step(i: int) -> dict[str, float]:
        x, y = xs[i % 16], ys[i % 16]
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        acc = (logits.argmax(-1) == y).float().mean()
        return {
            "loss/task": loss.item(),
            "loss/total": loss.item() * 1.01,
            "train/acc": acc.item(),
            "grad_norm": float(gn),
            "lr/cores": 1e-3,
            "lr/gates": 1e-3,
            "size/params": float(n_params),
            "size/compression": 12.5,
        }

    return step


def run_block(step: Any, start: int, steps: int, sink: Any) -> tuple[float, float]:
    """``(seconds per step, seconds per step spent inside the sink's log_* calls)``."""
    in_sink = 0.0
    t0 = time.perf_counter()
    for i in range(start, start + steps):
        m = step(i)
        if sink is not None:
            a = time.perf_counter()
            sink.log_metrics(i, m)
            if i % 10 == 0:
                sink.log_ranks(i, {"fc1": [1, 12, 30, 12, 1], "fc2": [1, 8, 20, 8, 1]})
            if i % 100 == 0:
                sink.log_event("info", f"step {i}", i)
            in_sink += time.perf_counter() - a
    return (time.perf_counter() - t0) / steps, in_sink / steps


def bench(size: str, steps: int, rounds: int, tmp: Path) -> dict[str, Any]:
    step = make_loop(size)
    run_block(step, 0, 200, None)  # warm-up
    store = RunStore(tmp / f"{size}.db")
    rid = store.create_run(size, {"bench": size}, status="running")
    sink = StoreSink(store, rid, flush_every=0.5)
    jsonl = JSONLSink(tmp / f"{size}.jsonl")
    times: dict[str, list[float]] = {"none": [], "store": [], "jsonl": []}
    store_steps = 0
    store_call = 0.0
    pos = 200
    for r in range(rounds):
        order = ["none", "store", "jsonl"] if r % 2 == 0 else ["jsonl", "store", "none"]
        for variant in order:
            s = {"none": None, "store": sink, "jsonl": jsonl}[variant]
            per_step, per_call = run_block(step, pos, steps, s)
            times[variant].append(per_step)
            if variant == "store":
                store_steps += steps
                store_call += per_call * steps
            pos += steps
    sink.set_status("finished")
    sink.close()
    jsonl.close()
    rows = store.counts(rid)
    med = {k: statistics.median(v) for k, v in times.items()}
    # paired: each round's blocks ran back to back, so their ratio cancels slow drifts
    paired = {
        k: 100.0 * (statistics.median(a / b for a, b in zip(times[k], times["none"])) - 1.0)
        for k in ("store", "jsonl")
    }
    # the sink's own cost per step, independent of machine noise: time inside log_* calls
    # on the training thread plus CPU time of the background flushes (as if they stole it
    # all from the training step), over the median step time without a sink
    cost_per_step = (store_call + sink.stats["flush_cpu_s"]) / store_steps
    attributed = 100.0 * cost_per_step / med["none"]
    return {
        "size": size,
        "steps_per_block": steps,
        "rounds": rounds,
        "step_ms": {k: v * 1e3 for k, v in med.items()},
        "overhead_pct": paired,
        "overhead_pct_of_medians": {
            "store": 100.0 * (med["store"] / med["none"] - 1.0),
            "jsonl": 100.0 * (med["jsonl"] / med["none"] - 1.0),
        },
        "block_step_ms": {k: [round(x * 1e3, 4) for x in v] for k, v in times.items()},
        "store_cost": {
            "log_calls_us_per_step": 1e6 * store_call / store_steps,
            "flush_cpu_us_per_step": 1e6 * sink.stats["flush_cpu_s"] / store_steps,
            "cost_us_per_step": 1e6 * cost_per_step,
            "flush_cpu_s": sink.stats["flush_cpu_s"],
            "flush_wall_s": sink.stats["flush_wall_s"],
            "flushes": sink.stats["flushes"],
            "attributed_overhead_pct": attributed,
        },
        "rows_written": rows,
        "metrics_per_step": 8,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=150, help="steps per timed block")
    ap.add_argument("--rounds", type=int, default=21, help="interleaved blocks per variant")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as d:
        for size in args.sizes:
            results.append(bench(size, args.steps, args.rounds, Path(d)))
    print(
        f"{'model':<10} {'no sink ms':>11} {'StoreSink ms':>13} {'overhead':>9} "
        f"{'sink cost':>10} {'JSONL ms':>9} {'overhead':>9}"
    )
    for r in results:
        ms, ov = r["step_ms"], r["overhead_pct"]
        cost = r["store_cost"]["attributed_overhead_pct"]
        print(
            f"{r['size']:<10} {ms['none']:>11.3f} {ms['store']:>13.3f} {ov['store']:>8.2f}% "
            f"{cost:>9.2f}% {ms['jsonl']:>9.3f} {ov['jsonl']:>8.2f}%"
        )
    print(
        "overhead: median over rounds of (step time with the sink / without), interleaved "
        "blocks, wall clock;\nsink cost: time inside log_* calls + CPU time of the background "
        "flushes, per step time (noise-free upper bound if the flush thread steals a core)"
    )
    info = {
        "benchmark": "store_overhead",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "flush_every_s": 0.5,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(info, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
