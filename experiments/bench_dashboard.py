"""What the Live page's charts cost the dashboard's server: one refresh's eight charts.

While a run trains, the Live page (``app/views/live_run.py``) redraws eight charts every
second: five line charts (loss, accuracy, compression, throughput, memory; the system's
readings make six), the rank heatmap and the rank bars, each with up to
``MAX_POINTS`` points per curve, a stage marker and, for the compression, the target
line. This script builds the same charts over a synthetic run of ``--points`` logged
points (the page's caps), and times, per chart and for the whole refresh:

* ``spec``: the page's way: a plain Plotly spec (:mod:`app.lib.plots`'s ``*_spec``) and
  its JSON (``app.lib.livechart.spec_of``), what the chart component is sent;
* ``go.Figure``: the same spec built as a validated ``go.Figure`` and its JSON (the way
  every chart was built before; the other pages still do, once per page load).

Milliseconds per chart, the median of alternating rounds (``benchlib.median_rounds_ms``),
on the CPU this runs on; the browser's own cost (Plotly drawing in Chromium) is not
counted. Prints a table and writes experiments/results/bench_dashboard.json.

    python experiments/bench_dashboard.py [--points 800] [--rounds 5] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import add_rounds_args, apply_rounds_args, machine, median_rounds_ms, print_and_write  # noqa: E402


def charts(points: int) -> dict[str, Callable[[], dict]]:
    """The Live page's eight chart specs over a run of ``points`` logged points per metric
    (every 25 steps; three layers of two bonds whose ranks fall over 40 snapshots)."""
    from app.lib import plots

    steps = list(range(0, 25 * points, 25))
    falling = [2.3 * math.exp(-s / (10 * points)) + 0.05 * math.sin(s) for s in steps]
    rising = [1 - v / 2.5 for v in falling]
    stages = [(steps[points // 3], "late stage")]
    history = [{"step": s, "layer": f"layers.{k}", "ranks": [max(1, 16 - s // (points * 2)), 8]}
               for s in steps[:: max(1, points // 40)] for k in range(3)]
    latest = {f"layers.{k}": [4 + k, 8] for k in range(3)}
    return {
        "loss": lambda: plots.lines_spec(
            [("task loss", steps, falling), ("total (objective)", steps, falling)], "Loss",
            "loss", stages=stages, smooth=0.1, dashes=[None, "dash"]),
        "accuracy": lambda: plots.lines_spec(
            [("train", steps, rising), ("eval", steps[::4], rising[::4])], "Accuracy",
            "accuracy", stages=stages, smooth=0.1, percent=True),
        "compression": lambda: plots.lines_spec(
            [("tensorized layers", steps, [1 + 20 * r for r in rising]),
             ("whole model (other scope)", steps, [1 + 5 * r for r in rising])],
            "Compression vs dense", "× smaller", stages=stages, dashes=[None, "dot"],
            hline=(20.0, "target 20×")),
        "throughput": lambda: plots.lines_spec(
            [("samples/s", steps, [3000 + 10 * v for v in falling])], "Throughput",
            "samples/s", stages=stages),
        "rank heatmap": lambda: plots.rank_heatmap_spec(history, stages=stages,
                                                        until=steps[-1]),
        "rank bars": lambda: plots.rank_bars_spec(latest),
        "memory": lambda: plots.lines_spec(
            [("process RSS", steps, [400.0 + v for v in falling])], "Memory", "MiB",
            stages=stages, from_zero=True),
        "system": lambda: plots.lines_spec(
            [("process CPU %", steps, [95.0 + v for v in falling]),
             ("system RAM used %", steps, [25.0] * points)], "System", "%", stages=stages,
            from_zero=True),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=800,
                    help="logged points per metric (the Live page draws at most 800)")
    add_rounds_args(ap, rounds=5, reps=5, reps_help="refreshes per round")
    args = ap.parse_args(argv)
    if args.points < 2:
        ap.error("--points: must be an integer of at least 2")
    apply_rounds_args(ap, args)
    import plotly.graph_objects as go

    from app.lib.livechart import spec_of

    specs = charts(args.points)
    for make in specs.values():  # valid Plotly, as sent
        go.Figure(json.loads(spec_of(make())))
    fns: dict[str, Callable[[], object]] = {}
    for name, make in specs.items():
        fns[f"{name}|spec"] = lambda make=make: spec_of(make())
        fns[f"{name}|go.Figure"] = lambda make=make: spec_of(go.Figure(make()))
    ms = median_rounds_ms(fns, args.rounds, args.reps)
    rows = [{"chart": name, "spec_ms": ms[f"{name}|spec"], "figure_ms": ms[f"{name}|go.Figure"],
             "ratio": ms[f"{name}|go.Figure"] / ms[f"{name}|spec"]} for name in specs]
    total = {"chart": "one refresh (all eight)", "spec_ms": sum(r["spec_ms"] for r in rows),
             "figure_ms": sum(r["figure_ms"] for r in rows)}
    total["ratio"] = total["figure_ms"] / total["spec_ms"]
    rows.append(total)
    print(f"\nLive page charts, {args.points} points per metric, ms per chart (CPU, "
          f"{args.threads} thread(s))")
    print_and_write(rows, [("chart", "chart", ""), ("spec_ms", "spec + JSON", ".2f"),
                           ("figure_ms", "go.Figure + JSON", ".2f"),
                           ("ratio", "go.Figure / spec", ".1f")],
                    "bench_dashboard", {"machine": machine(), "points": args.points,
                                        "rounds": args.rounds, "reps": args.reps,
                                        "rows": rows}, args.out)
    print(f"one refresh: {total['spec_ms']:.1f} ms as specs, {total['figure_ms']:.1f} ms "
          "as go.Figures")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
