"""Shared pieces of the data layer: the bundle, a dict-of-tensors dataset, config readers.

Only ``torch`` and ``numpy`` are imported here, so every data module can be imported on a
minimal install; heavier libraries are imported inside the functions that need them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from comera_engine.data.registry import check_keys  # noqa: F401 (re-export)
from comera_engine.errors import ConfigError

#: Prefix for the field names in ``ConfigError`` messages (the ``[data]`` config section).
FIELD_PREFIX = "data."


class TensorDictDataset(Dataset):
    """A map-style dataset over named tensors that share their first dimension.

    ``dataset[i]`` returns ``{key: tensor[i]}``; the default ``DataLoader`` collate stacks
    these into ``{key: tensor[B, ...]}``. ``dataset.tensors`` gives the whole columns, e.g.
    for copying an entire split to the GPU once.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if not tensors:
            raise ValueError("tensors: need at least one named tensor")
        lengths = {k: int(v.shape[0]) for k, v in tensors.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"tensors: first dimensions differ: {lengths}")
        self.tensors: dict[str, torch.Tensor] = dict(tensors)
        self._len = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {k: v[index] for k, v in self.tensors.items()}

    def subset(self, indices: torch.Tensor | np.ndarray | list[int]) -> TensorDictDataset:
        """Rows ``indices`` (1-D) as a new dataset (copies)."""
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return TensorDictDataset({k: v[idx] for k, v in self.tensors.items()})


@dataclass
class DataBundle:
    """Everything a trainer needs from a dataset.

    Attributes:
        name: registry name (``"digits"``, ``"snli"``, ``"code_mlm"``, ...).
        task: ``"classification"`` (digits: ``x`` [B, 64] float, ``labels`` [B] long),
            ``"nli"`` (``input_ids``/``token_type_ids``/``attention_mask`` [B, L] long,
            ``labels`` [B] long), ``"mlm"`` (after ``collate_fn``: ``input_ids``,
            ``attention_mask`` [B, L] long, ``labels`` [B, L] long with -100 on unmasked
            positions), ``"text"`` (the ``"nli"`` keys for one text, or a text's two parts,
            and its class) or ``"ctr"`` (``dense`` [B, num_dense] float, ``sparse``
            [B, num_sparse] long, ``labels`` [B] float in {0, 1}; Criteo: 13 and 26).
        train, eval: map-style datasets whose items are dicts of tensors (see ``task``).
        identity: JSON-serialisable description saved with each run (``dataset_identity``).
        num_classes: classes of the target (10, 3, 2), or ``None`` for MLM.
        vocab_size: tokenizer vocabulary size for text tasks, else ``None``.
        seq_len: fixed sequence length for text tasks, else ``None``.
        tokenizer: the ``WordPieceTokenizer`` for text tasks, else ``None``.
        collate_fn: collate for the *train* loader, or ``None`` for the default collate.
            MLM sets it to an ``MLMCollator`` (random masking each time); the eval split of
            MLM is masked once, deterministically, and uses the default collate.
        meta: model-facing details, e.g. ``input_dim``, ``pad_id``, ``mask_id``,
            ``bucket_sizes``, ``num_dense``, ``label_names``. Plain Python values, except
            the tensors ``mean``/``std`` [64] (digits) and ``eval_probability`` [n_eval]
            (clicks_synthetic: the true click probability of each eval example).
    """

    name: str
    task: str
    train: Dataset
    eval: Dataset
    identity: dict[str, Any]
    num_classes: int | None = None
    vocab_size: int | None = None
    seq_len: int | None = None
    tokenizer: Any = None
    collate_fn: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- config readers


def field_name(key: str) -> str:
    """``"path"`` -> ``"data.path"`` (the name used in error messages)."""
    return f"{FIELD_PREFIX}{key}"


def get_int(cfg: Mapping[str, Any], key: str, default: int | None, minimum: int = 0) -> int:
    """Integer field ``key`` (>= ``minimum``); ``default`` when absent (``None``: required)."""
    if key not in cfg or cfg[key] is None:
        if default is None:
            raise ConfigError(field_name(key), "missing; give an integer")
        return default
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ConfigError(field_name(key), f"must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ConfigError(field_name(key), f"must be an integer >= {minimum}, got {value}")
    return int(value)


def get_optional_int(cfg: Mapping[str, Any], key: str, minimum: int = 1) -> int | None:
    """Integer field or ``None`` when absent (used for caps such as ``max_examples``)."""
    if cfg.get(key) is None:
        return None
    return get_int(cfg, key, None, minimum)


def get_float(
    cfg: Mapping[str, Any],
    key: str,
    default: float,
    low: float,
    high: float,
    open_interval: bool = True,
) -> float:
    """Float field in ``(low, high)`` (or ``[low, high]`` when not ``open_interval``)."""
    if key not in cfg or cfg[key] is None:
        return default
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ConfigError(field_name(key), f"must be a number, got {value!r}")
    value = float(value)
    ok = low < value < high if open_interval else low <= value <= high
    if not ok:
        brackets = ("(", ")") if open_interval else ("[", "]")
        raise ConfigError(
            field_name(key),
            f"must be in {brackets[0]}{low}, {high}{brackets[1]}, got {value}",
        )
    return value


def get_bool(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    """Boolean field ``key``."""
    if key not in cfg or cfg[key] is None:
        return default
    value = cfg[key]
    if not isinstance(value, bool):
        raise ConfigError(field_name(key), f"must be true or false, got {value!r}")
    return value


def get_str(cfg: Mapping[str, Any], key: str, default: str | None) -> str | None:
    """String field ``key``."""
    if key not in cfg or cfg[key] is None:
        return default
    value = cfg[key]
    if not isinstance(value, str) or not value:
        raise ConfigError(field_name(key), f"must be a non-empty string, got {value!r}")
    return value


def resolve_path(value: str | Path, base_dir: str | Path | None) -> Path:
    """``value`` as an absolute path; relative paths are taken from ``base_dir`` (or cwd)."""
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = Path(base_dir) / path if base_dir is not None else Path.cwd() / path
    return path.resolve()


def get_existing_file(
    cfg: Mapping[str, Any], key: str, base_dir: str | Path | None, what: str
) -> Path:
    """Path field that must name an existing file; ``what`` describes the accepted files."""
    raw = cfg.get(key)
    if raw is None or raw == "":
        raise ConfigError(field_name(key), f"missing; give {what}")
    if not isinstance(raw, (str, Path)):
        raise ConfigError(field_name(key), f"must be a file path string, got {raw!r}")
    path = resolve_path(raw, base_dir)
    if not path.is_file():
        raise ConfigError(field_name(key), f"file not found: {raw} (give {what})")
    return path


# --------------------------------------------------------------------------- splitting


def split_indices(n: int, train_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic random split of ``range(n)``.

    Returns ``(train_idx [n_train], eval_idx [n - n_train])``, each sorted ascending, with
    ``n_train = round(n * train_fraction)`` clamped so that both parts are non-empty.
    """
    if n < 2:
        raise ValueError(f"n: need at least 2 examples to split, got {n}")
    order = np.random.default_rng(seed).permutation(n)
    n_train = min(max(int(round(n * train_fraction)), 1), n - 1)
    return np.sort(order[:n_train]), np.sort(order[n_train:])


def seeded_subset(n: int, cap: int | None, seed: int) -> np.ndarray:
    """Sorted indices of a deterministic random subset of ``range(n)`` of size ``min(n, cap)``."""
    if cap is None or cap >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).permutation(n)[:cap])


BaseDir = str | Path | None


def missing_package(key: str, package: str, what: str) -> ConfigError:
    """ConfigError for an optional dependency that is not installed."""
    return ConfigError(
        field_name(key), f"{what} needs the '{package}' package (pip install {package})"
    )
