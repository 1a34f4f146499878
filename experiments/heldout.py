"""A held-out SNLI test set that neither training nor tuning touched.

The project has no SNLI test split: the SNLI configs train on the ``data.split_fraction``
part of ``../shared/data/snli/dev.jsonl`` and evaluate on the rest, and their settings
were tuned on that evaluation part. This takes the configs' own split (the same reader,
fraction and data seed as the trainer), leaves the evaluation part out altogether, and
holds ``n_test`` examples of the training part out as the test set:

* ``train.jsonl``: the training part less the test set (what the runs train on);
* ``test.jsonl``: the test set (what the runs are scored on, as their eval split).

No run trains on the test set, and nothing in a run is decided from its eval split (the
stage switch and the pace read the training loss; the last step's model is the one
scored), so its score is on data the run never saw. The folder is generated, never
committed: ``python experiments/heldout.py [--folder DIR]`` writes it, and
``experiments/reproduce.py`` (task ``snli_heldout``) writes it before its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "../shared/data/snli/dev.jsonl"
CONFIG = ROOT / "experiments" / "configs" / "snli_transformer_tiny.toml"
FOLDER = ROOT / "runs" / "datasets" / "snli_heldout"
N_TEST = 1500
TEST_SEED = 29  # fixed: every seed and method is scored on the same examples


def split(n: int, config: Path = CONFIG, n_test: int = N_TEST,
          seed: int = TEST_SEED) -> dict[str, list[int]]:
    """Indices into ``n`` labelled examples (the source as the trainer's reader reads
    it): the config's ``eval`` part (left out), the ``test`` set held out of its
    training part, and ``train``, the rest of the training part. Each sorted; together a
    partition of ``range(n)``."""
    import numpy as np

    from comera_engine.config import load_config
    from comera_engine.data.base import split_indices
    from comera_engine.data.registry import dataset_info

    data = load_config(config).data
    fraction = float(data.get("split_fraction", dataset_info("snli").defaults["split_fraction"]))
    data_seed = int(data.get("seed", dataset_info("snli").defaults["seed"]))
    train_idx, eval_idx = split_indices(n, fraction, data_seed)
    if not 0 < n_test < len(train_idx):
        raise ValueError(f"n_test: must be between 1 and {len(train_idx) - 1}, got {n_test}")
    pick = np.random.default_rng(seed).permutation(len(train_idx))[:n_test]
    test = np.sort(train_idx[pick])
    rest = np.setdiff1d(train_idx, test)
    return {"train": rest.tolist(), "test": test.tolist(), "eval": eval_idx.tolist()}


def write(folder: Path = FOLDER, source: Path = SOURCE, config: Path = CONFIG,
          n_test: int = N_TEST) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` into ``folder`` (each whole or not at
    all: :func:`comera_engine.store.layout.write_atomic`); returns their paths."""
    from comera_engine.data.nli import LABEL_NAMES, read_nli_file
    from comera_engine.store.layout import write_atomic

    examples = read_nli_file(source)
    parts = split(len(examples), config, n_test)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in ("train", "test"):
        path = folder / f"{name}.jsonl"
        write_atomic(path, "".join(
            json.dumps({"premise": examples.premises[i], "hypothesis": examples.hypotheses[i],
                        "label": LABEL_NAMES[examples.labels[i]]}) + "\n"
            for i in parts[name]))
        paths.append(path)
    return paths[0], paths[1]


def overrides(folder: Path = FOLDER) -> tuple[str, ...]:
    """Write the files and return the ``--set`` overrides that point a run at them."""
    train, test = write(folder)
    # relative to the repository root (where runs resolve data paths) when inside it
    names = [os.path.relpath(p, ROOT) if p.resolve().is_relative_to(ROOT) else str(p)
             for p in (train, test)]
    return (f"data.path={json.dumps(names[0])}", f"data.eval_path={json.dumps(names[1])}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", type=Path, default=FOLDER)
    ap.add_argument("--n-test", type=int, default=N_TEST)
    args = ap.parse_args(argv)
    if not SOURCE.is_file():
        print(f"{SOURCE} is missing: the held-out set is cut from it", file=sys.stderr)
        return 2
    train, test = write(args.folder, n_test=args.n_test)
    print(f"wrote {train} and {test}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
