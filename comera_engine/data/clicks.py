"""Click-through data for DLRM: Criteo-format TSV and a synthetic generator.

Criteo layout, one example a line, tab separated, no header::

    label  I1 .. I13  C1 .. C26

``label`` is 0/1, ``I*`` are integer counts (may be negative or empty = missing), ``C*``
are 32-bit hashes written as 8 hex digits (empty = missing).

Preprocessing (the usual DLRM recipe):
* dense: ``log(1 + max(x, 0))``, missing -> 0, float32 [n, 13];
* categorical feature ``j`` with ``B_j`` buckets (given by the caller): missing -> bucket 0,
  value ``v`` -> ``1 + h(v) mod (B_j - 1)`` where ``h`` is the hex value (or a stable
  BLAKE2b hash for non-hex strings); int64 [n, 26];
* label float32 [n] in {0, 1}.

The synthetic generator plants a low-rank pairwise interaction between a few categorical
features (plus a weak dense effect) that decides the click probability, so a model with
feature interactions (DLRM, factorisation machine) can learn it while a per-feature
additive model cannot.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from comera_engine.data.base import (
    BaseDir,
    DataBundle,
    TensorDictDataset,
    check_keys,
    field_name,
    get_existing_file,
    get_float,
    get_int,
    get_optional_int,
    split_indices,
)
from comera_engine.data.identity import content_sha256, dataset_identity
from comera_engine.data.registry import dataset_info
from comera_engine.errors import ConfigError
from comera_engine.metrics import log_loss

NUM_DENSE = 13
NUM_SPARSE = 26


@dataclass
class ClickData:
    """Preprocessed clicks.

    ``dense`` float32 [n, 13], ``sparse`` int64 [n, 26], ``labels`` float32 [n].
    """

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def subset(self, indices: np.ndarray | torch.Tensor | Sequence[int]) -> ClickData:
        """Rows ``indices`` as a new ``ClickData``."""
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return ClickData(self.dense[idx], self.sparse[idx], self.labels[idx])

    def tensors(self) -> dict[str, torch.Tensor]:
        """``{"dense", "sparse", "labels"}`` for a ``TensorDictDataset``."""
        return {"dense": self.dense, "sparse": self.sparse, "labels": self.labels}


def normalise_bucket_sizes(
    bucket_sizes: int | Sequence[int], num_sparse: int = NUM_SPARSE
) -> list[int]:
    """One bucket count per categorical feature; an int means the same count for all.

    Raises ``ValueError`` (message starts with ``bucket_sizes``) on a wrong length or a
    count below 1.
    """
    if isinstance(bucket_sizes, (int, np.integer)) and not isinstance(bucket_sizes, bool):
        sizes = [int(bucket_sizes)] * num_sparse
    else:
        sizes = [int(b) for b in bucket_sizes]
    if len(sizes) != num_sparse:
        raise ValueError(
            f"bucket_sizes: need {num_sparse} counts (one per categorical feature) or one "
            f"integer, got {len(sizes)}"
        )
    if min(sizes) < 1:
        raise ValueError(f"bucket_sizes: every count must be >= 1, got {min(sizes)}")
    return sizes


def _token_hash(token: str) -> int:
    """Integer value of a hex token; a stable 64-bit BLAKE2b hash for anything else."""
    try:
        return int(token, 16)
    except ValueError:
        return int.from_bytes(hashlib.blake2b(token.encode(), digest_size=8).digest(), "little")


def hash_category(token: str, buckets: int) -> int:
    """Bucket of one categorical token: ``""`` -> 0, else ``1 + h(token) % (buckets - 1)``."""
    if not token or buckets == 1:
        return 0
    return 1 + _token_hash(token) % (buckets - 1)


def transform_dense(raw: np.ndarray) -> np.ndarray:
    """``log(1 + max(x, 0))`` elementwise (missing values must already be 0)."""
    return np.log1p(np.maximum(np.asarray(raw, dtype=np.float64), 0.0)).astype(np.float32)


@dataclass
class CriteoReadStats:
    """What ``read_criteo_tsv`` saw: rows kept, malformed rows skipped, missing fractions."""

    rows: int
    malformed: int
    missing_dense: float
    missing_sparse: float
    first_malformed_line: int | None = None


def read_criteo_tsv(
    path: str | Path,
    bucket_sizes: int | Sequence[int],
    max_rows: int | None = None,
) -> tuple[ClickData, CriteoReadStats]:
    """Parse a Criteo TSV into tensors (see the module docstring for the preprocessing).

    Lines with a field count other than 40 or a label other than 0/1, or an integer field
    that is not an integer, are skipped and counted as malformed. ``max_rows`` caps the
    number of kept rows (reading stops there).
    """
    sizes = normalise_bucket_sizes(bucket_sizes)
    n_fields = 1 + NUM_DENSE + NUM_SPARSE
    labels: list[float] = []
    dense_rows: list[list[float]] = []
    sparse_rows: list[list[int]] = []
    malformed, missing_dense, missing_sparse = 0, 0, 0
    first_bad: int | None = None
    with open(path, encoding="utf-8", errors="replace", newline="") as handle:
        for number, line in enumerate(handle, start=1):
            if max_rows is not None and len(labels) >= max_rows:
                break
            if not line.strip():
                continue
            fields = line.rstrip("\r\n").split("\t")
            row = _parse_row(fields, sizes) if len(fields) == n_fields else None
            if row is None:
                malformed += 1
                first_bad = first_bad or number
                continue
            label, dense, sparse, n_missing_dense, n_missing_sparse = row
            labels.append(label)
            dense_rows.append(dense)
            sparse_rows.append(sparse)
            missing_dense += n_missing_dense
            missing_sparse += n_missing_sparse
    n = len(labels)
    data = ClickData(
        dense=torch.from_numpy(
            transform_dense(np.asarray(dense_rows, dtype=np.float64).reshape(n, NUM_DENSE))
        ),
        sparse=torch.tensor(sparse_rows, dtype=torch.long).reshape(n, NUM_SPARSE),
        labels=torch.tensor(labels, dtype=torch.float32),
    )
    stats = CriteoReadStats(
        rows=n,
        malformed=malformed,
        missing_dense=missing_dense / max(n * NUM_DENSE, 1),
        missing_sparse=missing_sparse / max(n * NUM_SPARSE, 1),
        first_malformed_line=first_bad,
    )
    return data, stats


def _parse_row(
    fields: list[str], sizes: list[int]
) -> tuple[float, list[float], list[int], int, int] | None:
    """(label, raw dense [13], buckets [26], #missing dense, #missing sparse) or ``None``."""
    if fields[0] not in ("0", "1"):
        return None
    dense: list[float] = []
    missing_dense = 0
    for text in fields[1 : 1 + NUM_DENSE]:
        if text == "":
            dense.append(0.0)
            missing_dense += 1
            continue
        try:
            dense.append(float(int(text)))
        except ValueError:
            return None
    tokens = fields[1 + NUM_DENSE :]
    sparse = [hash_category(tok, b) for tok, b in zip(tokens, sizes)]
    missing_sparse = sum(1 for tok in tokens if tok == "")
    return float(fields[0]), dense, sparse, missing_dense, missing_sparse


def write_criteo_tsv(
    path: str | Path,
    labels: np.ndarray | torch.Tensor,
    dense_raw: np.ndarray | torch.Tensor,
    categorical: Sequence[Sequence[str]],
    dense_missing: np.ndarray | torch.Tensor | None = None,
) -> Path:
    """Write raw rows in Criteo layout.

    Args:
        labels: [n] 0/1. dense_raw: [n, 13] integers. categorical: n rows of 26 strings
            (``""`` = missing). dense_missing: optional bool [n, 13]; ``True`` writes an
            empty field.
    """
    labels_np = np.asarray(labels).astype(np.int64).reshape(-1)
    dense_np = np.asarray(dense_raw).astype(np.int64)
    missing_np = (
        np.zeros(dense_np.shape, dtype=bool) if dense_missing is None else np.asarray(dense_missing)
    )
    path = Path(path)
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        for i, label in enumerate(labels_np):
            dense_text = ["" if missing_np[i, j] else str(dense_np[i, j]) for j in range(NUM_DENSE)]
            handle.write("\t".join([str(int(label)), *dense_text, *categorical[i]]) + "\n")
    return path


# --------------------------------------------------------------------------- synthetic


@dataclass
class SyntheticClicks:
    """Generated clicks plus the ground truth that produced them.

    Attributes:
        data: preprocessed tensors (what a model sees).
        dense_raw: int64 [n, 13] raw counts (0 where missing).
        dense_missing: bool [n, 13].
        probability: float64 [n] true click probability.
        planted_features: categorical feature indices whose pairwise interaction matters.
        bucket_sizes: [26] bucket counts.
        params: the generator settings.
    """

    data: ClickData
    dense_raw: np.ndarray
    dense_missing: np.ndarray
    probability: np.ndarray
    planted_features: tuple[int, ...]
    bucket_sizes: list[int]
    params: dict[str, Any] = field(default_factory=dict)

    def categorical_tokens(self) -> list[list[str]]:
        """Hex tokens that hash back (``hash_category``) to exactly ``data.sparse``."""
        sparse = self.data.sparse.numpy()
        return [["" if v == 0 else f"{v - 1:08x}" for v in row] for row in sparse.tolist()]

    def write_tsv(self, path: str | Path) -> Path:
        """Write as a Criteo TSV that ``read_criteo_tsv(path, bucket_sizes)`` reads back exactly."""
        return write_criteo_tsv(
            path,
            self.data.labels.numpy(),
            self.dense_raw,
            self.categorical_tokens(),
            self.dense_missing,
        )


def _zipf_buckets(rng: np.random.Generator, n: int, buckets: int, exponent: float) -> np.ndarray:
    """[n] bucket ids in ``1..buckets-1`` with Zipf-like frequencies in a shuffled order."""
    if buckets <= 1:
        return np.zeros(n, dtype=np.int64)
    ranks = np.arange(1, buckets, dtype=np.float64)
    probs = ranks**-exponent
    probs /= probs.sum()
    ids = 1 + rng.permutation(buckets - 1)
    return ids[rng.choice(buckets - 1, size=n, p=probs)].astype(np.int64)


def bias_for_rate(mean_probability: Callable[[float], float], rate: float,
                  steps: int = 60) -> float:
    """The offset ``b`` in ``[-30, 30]`` with ``mean_probability(b) == rate``, by ``steps``
    bisections (``mean_probability`` increasing in ``b``: the mean click probability of
    a sample of logits shifted by ``b``)."""
    low, high = -30.0, 30.0
    for _ in range(steps):
        mid = 0.5 * (low + high)
        if mean_probability(mid) < rate:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def generate_synthetic_clicks(
    num_samples: int,
    bucket_sizes: int | Sequence[int] = 50,
    seed: int = 0,
    planted_features: Sequence[int] = (0, 1, 2),
    rank: int = 4,
    signal: float = 1.5,
    dense_signal: float = 0.3,
    base_rate: float = 0.25,
    missing_rate: float = 0.0,
    zipf_exponent: float = 1.05,
) -> SyntheticClicks:
    """Generate Criteo-shaped clicks whose probability comes from a planted structure.

    ``logit = b + signal * sum_{a<c in planted} <U_a[i_a], U_c[i_c]> + dense_signal * w . z``
    with per-bucket factors ``U_f`` of rank ``rank`` (bucket 0 = missing has factor 0),
    ``z`` the standardised transformed dense features and ``b`` chosen so the mean click
    probability is ``base_rate``. Categorical buckets follow a Zipf-like law; each dense /
    categorical value is missing with probability ``missing_rate``.

    Returns:
        ``SyntheticClicks`` with ``data.dense`` [n, 13], ``data.sparse`` [n, 26],
        ``data.labels`` [n] and the true ``probability`` [n].
    """
    if num_samples < 1:
        raise ValueError(f"num_samples: must be >= 1, got {num_samples}")
    sizes = normalise_bucket_sizes(bucket_sizes)
    planted = tuple(int(f) for f in planted_features)
    if len(planted) < 2 or len(set(planted)) != len(planted):
        raise ValueError(f"planted_features: need at least 2 distinct features, got {planted}")
    if any(not 0 <= f < NUM_SPARSE for f in planted):
        raise ValueError(f"planted_features: indices must be in 0..{NUM_SPARSE - 1}, got {planted}")
    if any(sizes[f] < 2 for f in planted):
        raise ValueError("bucket_sizes: planted features need at least 2 buckets")
    if rank < 1:
        raise ValueError(f"rank: must be >= 1, got {rank}")
    if not 0.0 < base_rate < 1.0:
        raise ValueError(f"base_rate: must be in (0, 1), got {base_rate}")
    if not 0.0 <= missing_rate < 1.0:
        raise ValueError(f"missing_rate: must be in [0, 1), got {missing_rate}")

    rng = np.random.default_rng(seed)
    n = num_samples
    sparse = np.stack([_zipf_buckets(rng, n, b, zipf_exponent) for b in sizes], axis=1)
    # Raw dense counts: log-normal with a per-feature scale, rounded down.
    scales = rng.uniform(0.5, 4.0, size=NUM_DENSE)
    dense_raw = np.floor(np.exp(rng.normal(0.0, 1.0, size=(n, NUM_DENSE)) * 0.8 + scales))
    dense_raw = dense_raw.astype(np.int64)
    dense_missing = rng.random((n, NUM_DENSE)) < missing_rate
    dense_raw[dense_missing] = 0
    sparse[rng.random((n, NUM_SPARSE)) < missing_rate] = 0

    dense = transform_dense(dense_raw)
    z = (dense - dense.mean(axis=0)) / (dense.std(axis=0) + 1e-6)
    weights = rng.normal(0.0, 1.0, size=NUM_DENSE) / math.sqrt(NUM_DENSE)
    factor_std = rank**-0.25  # each <u, v> then has unit variance
    factors = {}
    for f in planted:
        table = rng.normal(0.0, factor_std, size=(sizes[f], rank))
        table[0] = 0.0
        factors[f] = table
    interaction = np.zeros(n)
    for a_pos, a in enumerate(planted):
        for c in planted[a_pos + 1 :]:
            interaction += np.einsum("nr,nr->n", factors[a][sparse[:, a]], factors[c][sparse[:, c]])
    logits = signal * interaction + dense_signal * (z @ weights)
    logits = logits + bias_for_rate(
        lambda b: float(np.mean(1.0 / (1.0 + np.exp(-(logits + b))))), base_rate)
    probability = 1.0 / (1.0 + np.exp(-logits))
    labels = (rng.random(n) < probability).astype(np.float32)

    data = ClickData(
        dense=torch.from_numpy(dense),
        sparse=torch.from_numpy(sparse.astype(np.int64)),
        labels=torch.from_numpy(labels),
    )
    params = {
        "num_samples": n,
        "seed": seed,
        "planted_features": list(planted),
        "rank": rank,
        "signal": signal,
        "dense_signal": dense_signal,
        "base_rate": base_rate,
        "missing_rate": missing_rate,
        "zipf_exponent": zipf_exponent,
    }
    return SyntheticClicks(data, dense_raw, dense_missing, probability, planted, sizes, params)


# --------------------------------------------------------------------------- clicks

_CLICK_FILE_HELP = "an existing Criteo TSV (label, 13 integer and 26 categorical fields per line)"


def _bucket_sizes(cfg: Mapping[str, Any], default: int) -> list[int]:
    """``data.bucket_sizes`` (an int or 26 ints) as a list of 26 counts."""

    raw = cfg.get("bucket_sizes", default)
    ok_int = isinstance(raw, int) and not isinstance(raw, bool)
    ok_list = isinstance(raw, (list, tuple)) and all(
        isinstance(b, int) and not isinstance(b, bool) for b in raw
    )
    if not (ok_int or ok_list):
        raise ConfigError(
            field_name("bucket_sizes"),
            f"must be an integer or a list of {NUM_SPARSE} integers, got {raw!r}",
        )
    try:
        return normalise_bucket_sizes(raw)
    except ValueError as exc:
        raise ConfigError(field_name("bucket_sizes"), str(exc).split(": ", 1)[1]) from None


def _click_meta(sizes: list[int], train_labels: torch.Tensor) -> dict[str, Any]:
    """Model-facing facts about click data."""

    return {
        "num_dense": NUM_DENSE,
        "num_sparse": NUM_SPARSE,
        "bucket_sizes": sizes,
        "click_rate": float(train_labels.mean()) if len(train_labels) else 0.0,
    }


def _click_bundle(name: str, train_data: Any, eval_data: Any, identity: dict[str, Any],
                  meta: dict[str, Any]) -> DataBundle:
    """A click-through-rate bundle (two classes) from the train and eval click tables."""
    return DataBundle(name=name, task="ctr", train=TensorDictDataset(train_data.tensors()),
                      eval=TensorDictDataset(eval_data.tensors()), identity=identity,
                      num_classes=2, meta=meta)


def build_clicks(cfg: Mapping[str, Any], base_dir: BaseDir = None) -> DataBundle:
    """Criteo TSV: items ``dense`` float32 [13], ``sparse`` int64 [26], ``labels`` float32."""

    defaults = dataset_info("clicks").defaults
    check_keys(cfg, defaults)
    seed = get_int(cfg, "seed", defaults["seed"])
    fraction = get_float(cfg, "split_fraction", defaults["split_fraction"], 0.0, 1.0)
    max_rows = get_optional_int(cfg, "max_rows")
    sizes = _bucket_sizes(cfg, defaults["bucket_sizes"])

    def read(key: str) -> tuple[Any, Any, Path]:
        path = get_existing_file(cfg, key, base_dir, _CLICK_FILE_HELP)
        try:
            data, stats = read_criteo_tsv(path, sizes, max_rows)
        except UnicodeDecodeError as exc:
            raise ConfigError(field_name(key), f"{path.name}: {exc}") from None
        if len(data) == 0:
            raise ConfigError(
                field_name(key),
                f"no valid rows in {path.name} ({stats.malformed} malformed, first at line "
                f"{stats.first_malformed_line}); give {_CLICK_FILE_HELP}",
            )
        return data, stats, path

    data, stats, path = read("path")
    files = [path]
    extra: dict[str, Any] = {"read": vars(stats)}
    if cfg.get("eval_path") is not None:
        eval_data, eval_stats, eval_path = read("eval_path")
        files.append(eval_path)
        extra["eval_read"] = vars(eval_stats)
        train_data = data
    else:
        if len(data) < 2:
            raise ConfigError(field_name("path"), "need at least 2 valid rows to split")
        train_idx, eval_idx = split_indices(len(data), fraction, seed)
        train_data, eval_data = data.subset(train_idx), data.subset(eval_idx)
    identity = dataset_identity(
        "clicks",
        "files",
        {"train": len(train_data), "eval": len(eval_data)},
        seed,
        files=files,
        params={
            "bucket_sizes": sizes,
            "max_rows": max_rows,
            "split_fraction": None if cfg.get("eval_path") else fraction,
            "dense_transform": "log1p(max(x, 0)), missing -> 0",
        },
        extra=extra,
    )
    return _click_bundle("clicks", train_data, eval_data, identity,
                         _click_meta(sizes, train_data.labels))


def build_clicks_synthetic(cfg: Mapping[str, Any], base_dir: BaseDir = None) -> DataBundle:
    """Synthetic clicks with a planted low-rank interaction (same items as ``clicks``)."""

    defaults = dataset_info("clicks_synthetic").defaults
    check_keys(cfg, defaults)
    seed = get_int(cfg, "seed", defaults["seed"])
    num_samples = get_int(cfg, "num_samples", defaults["num_samples"], minimum=2)
    fraction = get_float(cfg, "split_fraction", defaults["split_fraction"], 0.0, 1.0)
    sizes = _bucket_sizes(cfg, defaults["bucket_sizes"])
    planted = cfg.get("planted_features", list(defaults["planted_features"]))
    if (
        not isinstance(planted, (list, tuple))
        or len(planted) < 2
        or len(set(planted)) != len(planted)
        or not all(isinstance(f, int) and 0 <= f < NUM_SPARSE for f in planted)
    ):
        raise ConfigError(
            field_name("planted_features"),
            f"must be a list of at least 2 distinct feature indices in 0..{NUM_SPARSE - 1}, "
            f"got {planted!r}",
        )
    if any(sizes[f] < 2 for f in planted):
        raise ConfigError(field_name("bucket_sizes"), "planted features need at least 2 buckets")
    settings = {
        "rank": get_int(cfg, "rank", defaults["rank"], minimum=1),
        "signal": get_float(cfg, "signal", defaults["signal"], 0.0, 100.0, open_interval=False),
        "dense_signal": get_float(cfg, "dense_signal", defaults["dense_signal"], 0.0, 100.0,
                                  open_interval=False),
        "base_rate": get_float(cfg, "base_rate", defaults["base_rate"], 0.0, 1.0),
        "missing_rate": get_float(cfg, "missing_rate", defaults["missing_rate"], 0.0, 0.99,
                                  open_interval=False),
    }
    synth = generate_synthetic_clicks(
        num_samples, sizes, seed=seed, planted_features=planted, **settings
    )
    train_idx, eval_idx = split_indices(num_samples, fraction, seed)
    train_data, eval_data = synth.data.subset(train_idx), synth.data.subset(eval_idx)
    identity = dataset_identity(
        "clicks_synthetic",
        "synthetic",
        {"train": len(train_data), "eval": len(eval_data)},
        seed,
        params={**synth.params, "bucket_sizes": sizes, "split_fraction": fraction},
        extra={
            "content_sha256": content_sha256(
                synth.data.dense, synth.data.sparse, synth.data.labels
            ),
            "bayes_log_loss_eval": log_loss(synth.probability[eval_idx], eval_data.labels.numpy()),
        },
    )
    meta = _click_meta(sizes, train_data.labels)
    meta["planted_features"] = list(synth.planted_features)
    meta["eval_probability"] = torch.from_numpy(synth.probability[eval_idx])
    return _click_bundle("clicks_synthetic", train_data, eval_data, identity, meta)
