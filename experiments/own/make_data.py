"""Writes the worked example's data: scikit-learn's breast-cancer table (569 tumours, 30
numeric measurements, malignant or benign; shipped inside the scikit-learn wheel) as two
CSV files, a seeded stratified 80/20 split. Generated here, never committed.

    python experiments/own/make_data.py            # -> experiments/own/data/{train,eval}.csv
    python experiments/own/make_data.py --out DIR
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

HERE = Path(__file__).resolve().parent
LABEL = "diagnosis"


def column_names() -> list[str]:
    """The feature columns: scikit-learn's names in snake case (``mean_radius``, ...)."""
    from sklearn.datasets import load_breast_cancer

    return [n.replace(" ", "_") for n in load_breast_cancer().feature_names]


def write_csvs(out: str | Path = HERE / "data", seed: int = 0,
               eval_fraction: float = 0.2) -> tuple[Path, Path]:
    """``(train.csv, eval.csv)`` in ``out``: every feature column, then ``diagnosis``
    (``malignant`` / ``benign``); each class split ``eval_fraction`` into eval."""
    import numpy as np
    from sklearn.datasets import load_breast_cancer

    bundle = load_breast_cancer()
    names = column_names()
    classes = [str(c) for c in bundle.target_names]
    rng = np.random.default_rng(seed)
    eval_rows: list[int] = []
    for label in np.unique(bundle.target):
        members = rng.permutation(np.flatnonzero(bundle.target == label))
        eval_rows += members[: int(round(len(members) * eval_fraction))].tolist()
    is_eval = np.zeros(len(bundle.target), dtype=bool)
    is_eval[eval_rows] = True
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.csv", out / "eval.csv"
    for path, keep in zip(paths, (~is_eval, is_eval)):
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow([*names, LABEL])
            for row, y in zip(bundle.data[keep], bundle.target[keep]):
                writer.writerow([*(f"{v:.6g}" for v in row), classes[int(y)]])
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "data"), help="folder for the CSV files")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for path in write_csvs(args.out, args.seed):
        print(path)


if __name__ == "__main__":
    main()
