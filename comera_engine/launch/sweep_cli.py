"""``comera sweep`` and ``comera sweeps``; ``comera stop`` / ``comera resume`` take a sweep
id too (see :mod:`comera_engine.launch.cli`).

``comera sweep CONFIG --grid comera.target_compression=5,10,30,100 --seeds 3
[--max-parallel N] [--set K=V ...] [--name NAME] [--gpus 0,1] [--backend local|ray
[--address ADDR]] [--wait] [--json]`` queues the sweep, starts its first cells and prints
its id (``--wait``: follows it to the end and prints the report). ``comera sweeps`` lists
sweeps; ``comera sweeps SWEEP`` prints one: its cells, mean ± std per grid point and the
Pareto front of score vs compression reached.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from comera_engine.launch.cli import (
    _add_store,
    _fail,
    _fmt_time,
    _no_store_yet,
    _positive_int,
    _said_without_a_table,
    add_override_option,
    housekeeping_if_free,
    print_table,
)
from comera_engine.launch.sweep import create_sweep, parse_grid, sweep_report, wait_sweeps
from comera_engine.metrics import format_metric
from comera_engine.store import RunStore

__all__ = ["add_subparsers", "print_report"]


def add_subparsers(subparsers: Any, check: Callable[[Any], Any] | None = None) -> None:
    """Register ``sweep`` and ``sweeps``. ``check``: run on every cell's config before
    the sweep is written (the top-level CLI passes its device/data/memory check)."""
    p = subparsers.add_parser("sweep", help="run a grid of configs × seeds as runs")
    p.add_argument("config", help="TOML run config (the base of every cell)")
    p.add_argument("--grid", action="append", default=[], metavar="SECTION.KEY=V1,V2,...",
                   help="values to sweep (repeatable; cells are all combinations), e.g. "
                   "--grid comera.target_compression=5,10,30,100")
    p.add_argument("--seeds", type=_positive_int, default=1,
                   help="runs per grid point, with train.seed = seed, seed+1, ... (default 1)")
    add_override_option(p)
    p.add_argument("--max-parallel", type=_positive_int, default=None,
                   help="cells at once (default: one per GPU, else one per 4 CPU cores)")
    p.add_argument("--name", default=None, help="sweep name (default: the config's name)")
    p.add_argument("--gpus", default=None, help="GPUs the cells share, one per cell in turn")
    p.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="local: this machine's launcher; ray: Ray tasks on a cluster")
    p.add_argument("--address", default=None,
                   help="Ray cluster address (with --backend ray; default: a local Ray)")
    p.add_argument("--wait", action="store_true", help="follow the sweep to its end")
    p.add_argument("--json", action="store_true", help="print JSON")
    _add_store(p)
    p.set_defaults(func=cmd_sweep, check=check)

    p = subparsers.add_parser("sweeps", help="list sweeps, or show one with its Pareto front")
    p.add_argument("sweep", nargs="?", default=None, help="sweep id, unique prefix or name")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _add_store(p)
    p.set_defaults(func=cmd_sweeps)


def cmd_sweep(args: argparse.Namespace) -> int:
    if args.address and args.backend != "ray":
        return _fail(ValueError("--address: only with --backend ray"))
    try:
        grid = parse_grid(args.grid)
        sid = create_sweep(args.config, grid, args.seeds, args.overrides, args.store,
                           name=args.name, max_parallel=args.max_parallel,
                           backend=args.backend, address=args.address, gpus=args.gpus,
                           check=args.check)
    except ValueError as e:
        return _fail(e)
    st = RunStore(args.store, create=False)
    if not args.wait:
        sweep = st.get_sweep(sid) or {}
        if args.json:
            print(json.dumps({"sweep_id": sid, "cells": sweep.get("cells"),
                              "max_parallel": sweep.get("max_parallel")}))
        else:
            print(sid)
            print(f"{sweep.get('cells')} cells, {sweep.get('max_parallel')} at once; follow "
                  f"with `comera sweeps {sid}`", file=sys.stderr)
        return 0
    try:
        wait_sweeps(st, [sid], label=f"{sid}: ")
    except KeyboardInterrupt:
        print(f"comera: still running; stop it with `comera stop {sid}`", file=sys.stderr)
        return 130
    return print_report(st, sid, args.json)


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_report(st: RunStore, sid: str, as_json: bool = False) -> int:
    """Print a sweep's report (:func:`~comera_engine.launch.sweep.sweep_report`)."""
    rep = sweep_report(st, sid)
    if as_json:
        print(json.dumps(rep, default=str, indent=1))
        return 0
    sw, metric = rep["sweep"], rep["metric"] or "score"
    print(f"{sw['id']}  {sw['name']}  {sw['status']}  ({sw['cells']} cells, "
          f"{sw.get('max_parallel') or '-'} at once, backend {sw.get('backend')})")
    rows = [("RUN", "CELL", "STATUS", "STEP", metric.upper(), "COMPRESSION", "TARGET")]
    for c in rep["cells"]:
        rows.append((c["run"], c["label"], c["status"], _fmt(c["step"], "d"),
                     format_metric(metric, c["score"]) or "-", _fmt(c["compression"], ".1f"),
                     _fmt(c["target"], "g")))
    print_table(rows)
    print()
    rows = [("GRID POINT", f"{metric.upper()} (MEAN ± STD)", "COMPRESSION", "DONE", "PARETO")]
    for g in rep["groups"]:
        score = format_metric(metric, g["score"], g["score_std"]) or "-"
        comp = "-" if g["compression"] is None else f"{g['compression']:.1f}" + (
            "" if g["compression_std"] is None else f" ± {g['compression_std']:.1f}")
        rows.append((g["label"], score, comp, f"{g['finished']}/{g['cells']}",
                     "*" if g["pareto"] else ""))
    print_table(rows)
    return 0


def cmd_sweeps(args: argparse.Namespace) -> int:
    if _no_store_yet(args, "sweeps"):
        return 0
    try:
        st = RunStore(args.store, create=False)
        housekeeping_if_free(st)
        if args.sweep:
            return print_report(st, st.resolve_sweep(args.sweep), args.json)
        sweeps = st.list_sweeps()
    except ValueError as e:
        return _fail(e)
    if _said_without_a_table(sweeps, args.json, "no sweeps"):
        return 0
    rows = [("ID", "NAME", "STATUS", "CELLS", "AT ONCE", "BACKEND", "CREATED")]
    for s in sweeps:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(s["counts"].items()))
        rows.append((s["id"], s["name"], s["status"], counts or "0",
                     str(s.get("max_parallel") or "-"), s["backend"],
                     _fmt_time(s["created_at"])))
    print_table(rows)
    return 0
