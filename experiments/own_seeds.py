"""The worked example's accuracy over seeds: trains experiments/own/breast_cancer.toml as
``comera train`` does (its own settings, only ``train.seed`` changed), once per seed, and
prints each run's eval accuracy, compression and time, then the spread (mean, std, min,
max); writes experiments/results/own_breast_cancer_seeds.json. The browser test holds a
run launched from the dashboard's form to this spread (tests/test_browser.py).

    python experiments/own_seeds.py [--seeds 0 1 2 3 4]

The data is written first when experiments/own/data/ lacks it (experiments/own/make_data.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine, print_table, write_json  # noqa: E402
from target_check import run_one  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "experiments" / "own" / "breast_cancer.toml"
DATA = ROOT / "experiments" / "own" / "data"
NAME = "own_breast_cancer_seeds"


def spread(values: list[float]) -> dict[str, float | None]:
    """``{"mean", "std", "min", "max"}`` of ``values`` (std: the sample's, ``None`` for
    one value)."""
    return {"mean": statistics.mean(values),
            "std": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--out", type=Path, default=None, help="JSON folder (experiments/results)")
    args = ap.parse_args(argv)
    if not (DATA / "train.csv").exists() or not (DATA / "eval.csv").exists():
        sys.path.insert(0, str(CONFIG.parent))
        from make_data import write_csvs

        write_csvs(DATA)
    rows = [run_one(CONFIG, seed) for seed in args.seeds]
    print_table(rows, [("seed", "seed", ""), ("steps", "steps", ""),
                       ("target", "target x", ".1f"), ("reached", "reached x", ".2f"),
                       ("eval_acc", "eval acc", ".4f"), ("seconds", "s", ".1f")])
    acc = spread([r["eval_acc"] for r in rows])
    print(f"eval accuracy over {len(rows)} seeds: mean {100 * acc['mean']:.2f} %, "
          f"min {100 * acc['min']:.2f} %, max {100 * acc['max']:.2f} %")
    out = write_json(NAME, {"config": str(CONFIG.relative_to(ROOT)), "machine": machine(),
                            "seeds": args.seeds, "rows": rows, "eval_acc": acc,
                            "reached": spread([r["reached"] for r in rows])}, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
