"""scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes; shipped with sklearn).

Pixels (0..16) are scaled to [0, 1] and then standardised per pixel with the *train*
split's mean and standard deviation (pixels that are constant in train keep scale 1).
The split is stratified by class and deterministic for a seed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from comera_engine.data.base import (
    BaseDir,
    DataBundle,
    TensorDictDataset,
    check_keys,
    get_float,
    get_int,
    missing_package,
)
from comera_engine.data.identity import content_sha256, dataset_identity
from comera_engine.data.registry import dataset_info


@dataclass
class DigitsSplit:
    """Train/test tensors: ``x_*`` float32 [n, 64], ``y_*`` int64 [n]; stats [64] each."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    train_index: np.ndarray
    test_index: np.ndarray
    mean: torch.Tensor
    std: torch.Tensor


def stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per-class deterministic split; returns sorted ``(train_idx, test_idx)`` into ``labels``.

    Each class with ``c`` members puts ``round(c * test_fraction)`` of them (at least one
    when ``c >= 2``, at most ``c - 1``) into the test part.
    """
    rng = np.random.default_rng(seed)
    train, test = [], []
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        members = members[rng.permutation(len(members))]
        n_test = int(round(len(members) * test_fraction))
        if len(members) >= 2:
            n_test = min(max(n_test, 1), len(members) - 1)
        test.append(members[:n_test])
        train.append(members[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits as ``(pixels float64 [1797, 64] in 0..16, labels int64 [1797])``,
    read from the data file inside the scikit-learn wheel without importing scikit-learn
    (whose import, scipy included, takes longer than a short run's training); its own
    ``load_digits`` where the file is not where it ships."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise ImportError("scikit-learn is not installed")
    for folder in spec.submodule_search_locations or ():
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.asarray(bunch.data, dtype=np.float64), np.asarray(bunch.target, dtype=np.int64)


def load_digits_split(test_fraction: float = 0.2, seed: int = 0) -> DigitsSplit:
    """Load sklearn digits, split (stratified, by ``seed``) and normalise with train stats."""
    pixels, labels = read_digits()
    x = np.asarray(pixels, dtype=np.float32) / 16.0  # [1797, 64]
    y = labels  # [1797]
    train_idx, test_idx = stratified_split(y, test_fraction, seed)
    mean = x[train_idx].mean(axis=0)
    std = x[train_idx].std(axis=0)
    std = np.where(std > 1e-6, std, 1.0).astype(np.float32)

    def norm(rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((x[rows] - mean) / std).astype(np.float32))

    return DigitsSplit(
        x_train=norm(train_idx),
        y_train=torch.from_numpy(y[train_idx]),
        x_test=norm(test_idx),
        y_test=torch.from_numpy(y[test_idx]),
        train_index=train_idx,
        test_index=test_idx,
        mean=torch.from_numpy(mean),
        std=torch.from_numpy(std),
    )


# --------------------------------------------------------------------------- digits


def build_digits(cfg: Mapping[str, Any], base_dir: BaseDir = None) -> DataBundle:
    """sklearn 8x8 digits: items ``{"x": float32 [64], "labels": int64}``, 10 classes."""
    defaults = dataset_info("digits").defaults
    check_keys(cfg, defaults)
    seed = get_int(cfg, "seed", defaults["seed"])
    fraction = get_float(cfg, "split_fraction", defaults["split_fraction"], 0.0, 1.0)
    try:
        split = load_digits_split(test_fraction=1.0 - fraction, seed=seed)
        sklearn_version = importlib.metadata.version("scikit-learn")
    except (ImportError, importlib.metadata.PackageNotFoundError) as exc:
        raise missing_package("name", "scikit-learn", "digits") from exc
    train = TensorDictDataset({"x": split.x_train, "labels": split.y_train})
    test = TensorDictDataset({"x": split.x_test, "labels": split.y_test})
    identity = dataset_identity(
        "digits",
        "sklearn:load_digits",
        {"train": len(train), "eval": len(test)},
        seed,
        params={"split_fraction": fraction, "normalisation": "x/16 then train z-score"},
        extra={
            "sklearn_version": sklearn_version,
            "content_sha256": content_sha256(
                split.x_train, split.y_train, split.x_test, split.y_test
            ),
        },
    )
    return DataBundle(
        name="digits",
        task="classification",
        train=train,
        eval=test,
        identity=identity,
        num_classes=10,
        meta={"input_dim": 64, "image_shape": (8, 8), "mean": split.mean, "std": split.std},
    )
