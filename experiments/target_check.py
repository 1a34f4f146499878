"""Does every shipped config end at the size it asks for? Trains each config in
experiments/configs/ that sets comera.target_compression, at its own step count, and
prints target, reached, error and accuracy; writes experiments/results/target_check.json.

    python experiments/target_check.py                 # the CPU-size configs
    python experiments/target_check.py --all           # also the paper (GPU-size) ones
    python experiments/target_check.py --only snli_transformer_tiny --seeds 0 1 2 --dense
    python experiments/target_check.py --only digits_tt_mlp --target 10 --seeds 0 1 2 --dense
    python experiments/target_check.py --schedule comera --tolerance 0.10   # no pace

``--schedule`` (and ``--set section.key=value``, repeatable) train another method than
the config's (docs/METHODS.md, "Schedules"); the table says how many rank entries the
objective's gates removed and how many the pace did.

--dense also trains the dense model of the same architecture with the same steps and
seeds, and prints mean ± std of the accuracy of both (CoMERA at the target vs dense).

A config whose data is missing (e.g. ../shared/data) is listed with the reason, not run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine, print_table, write_json  # noqa: E402

from comera_engine.config import config_from_dict  # noqa: E402
from comera_engine.errors import ConfigError  # noqa: E402
from comera_engine.metrics import TARGET_TOLERANCE, NullSink  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "experiments" / "configs"


def targeted() -> list[Path]:
    """Shipped configs that ask for a compression target."""
    out = []
    for path in sorted(CONFIGS.glob("*.toml")):
        raw = tomllib.loads(path.read_text())
        if raw.get("comera", {}).get("target_compression") is not None:
            out.append(path)
    return out


def run_one(path: Path, seed: int, steps: int | None = None, target: float | None = None,
            dense: bool = False, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """Train ``path`` (seed ``seed``; optionally another target, ``--set`` style
    ``overrides``, or its dense model) in a temporary folder; the final metrics."""
    from comera_engine.config import apply_override
    from comera_engine.rank.schedule import method_label
    from comera_engine.train import train

    raw = tomllib.loads(path.read_text())
    for item in overrides:
        apply_override(raw, item)
    raw.setdefault("train", {})["seed"] = seed
    if steps is not None:
        raw["train"]["steps"] = steps
    if target is not None:
        raw["comera"]["target_compression"] = target
    if dense:
        raw["model"]["dense"] = True
    cfg = config_from_dict(raw)
    cfg.base_dir = str(ROOT)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = train(cfg, tmp, NullSink(), stop_flag=threading.Event(), progress=False)
    if result.status == "stopped":  # a signal stopped it gracefully: no result to record
        raise SystemExit(f"{path.stem} seed {seed}: stopped at step {result.step} (by a "
                         "signal?); nothing written")
    m = result.metrics
    scope = cfg.comera.target_scope
    if dense:
        return {"config": path.stem, "seed": seed, "steps": result.step, "dense": True,
                "eval_acc": m.get("eval/acc"), "seconds": time.perf_counter() - t0}
    reached = m.get(f"compression/{scope}")
    target = cfg.comera.target_compression
    return {"config": path.stem, "seed": seed, "steps": result.step, "scope": scope,
            "method": method_label(cfg), "target": target, "reached": reached,
            "error": reached / target - 1, "within": abs(reached / target - 1) <= TARGET_TOLERANCE,
            "eval_acc": m.get("eval/acc"),
            "by_objective": int(m.get("ranks/removed_by_objective", 0)),
            "by_pace": int(m.get("ranks/removed_by_pace", 0)),
            "seconds": time.perf_counter() - t0, "outcome": result.target}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="also the paper (GPU-size) configs")
    ap.add_argument("--only", nargs="*", default=None, help="config names (file stems)")
    ap.add_argument("--seeds", nargs="*", type=int, default=[0])
    ap.add_argument("--target", type=float, default=None, help="another target than the config's")
    ap.add_argument("--dense", action="store_true",
                    help="also the dense model (same steps, seeds): accuracy side by side")
    ap.add_argument("--schedule", choices=["paper", "comera", "paced"], default=None,
                    help="train this comera.schedule instead of the config's")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="SECTION.KEY=VALUE", help="a config override (repeatable)")
    ap.add_argument("--tolerance", type=float, default=TARGET_TOLERANCE,
                    help="the band around the target a run must end in (default 0.05)")
    ap.add_argument("--out", type=Path, default=None, help="JSON folder (experiments/results)")
    args = ap.parse_args(argv)
    if not 0 < args.tolerance < 1:
        ap.error("--tolerance: must be a fraction in (0, 1)")
    overrides = [*args.overrides, *([f'comera.schedule="{args.schedule}"']
                                    if args.schedule else [])]
    rows, dense, skipped = [], [], []
    for path in targeted():
        if args.only is not None and path.stem not in args.only:
            continue
        if "paper" in path.stem and not (args.all or args.only):
            skipped.append({"config": path.stem, "why": "GPU-size (use --all)"})
            continue
        for seed in args.seeds:
            try:
                rows.append(run_one(path, seed, target=args.target, overrides=overrides))
                rows[-1]["within"] = abs(rows[-1]["error"]) <= args.tolerance
                if args.dense:
                    dense.append(run_one(path, seed, dense=True))
            except (ConfigError, FileNotFoundError) as exc:
                skipped.append({"config": path.stem, "why": str(exc).splitlines()[0]})
                break
    print_table(rows, [("config", "config", ""), ("seed", "seed", ""), ("steps", "steps", ""),
                       ("target", "target x", ".1f"), ("reached", "reached x", ".2f"),
                       ("error", "error", "+.1%"), ("eval_acc", "eval acc", ".3f"),
                       ("by_objective", "removed by objective", ""),
                       ("by_pace", "by pace", ""), ("seconds", "s", ".0f")])
    if rows:
        print("method:", ", ".join(dict.fromkeys(r["method"] for r in rows)))
    for s in skipped:
        print(f"not run: {s['config']}: {s['why']}")
    summary = []
    for name in dict.fromkeys(r["config"] for r in rows):
        tt = [r["eval_acc"] for r in rows if r["config"] == name]
        dn = [r["eval_acc"] for r in dense if r["config"] == name]
        summary.append({"config": name, "target": rows[[r["config"] for r in rows].index(
            name)]["target"], "seeds": len(tt), "comera_acc": _ms(tt),
            "dense_acc": _ms(dn) if dn else "-",
            "gap_points": (100 * (statistics.mean(dn) - statistics.mean(tt)) if dn else
                           float("nan"))})
    if dense:
        print_table(summary, [("config", "config", ""), ("target", "target x", ".1f"),
                              ("seeds", "seeds", ""), ("comera_acc", "CoMERA acc", ""),
                              ("dense_acc", "dense acc", ""),
                              ("gap_points", "dense - CoMERA (points)", ".1f")])
    out = write_json("target_check", {"machine": machine(), "rows": rows, "dense": dense,
                                      "summary": summary, "skipped": skipped}, args.out)
    print(f"wrote {out}")
    return 0 if all(r["within"] for r in rows) else 1


def _ms(values: list[float]) -> str:
    """``mean ± std`` in percent."""
    if len(values) < 2:
        return f"{100 * values[0]:.1f} %"
    return f"{100 * statistics.mean(values):.1f} ± {100 * statistics.stdev(values):.1f} %"


if __name__ == "__main__":
    sys.exit(main())
