"""User data: local files (``data.name = "files"``) or a dataset factory
(``data.factory = "module:function"``).

``files``: ``data.train`` (and optionally ``data.eval``; else a seeded split by
``split_fraction``) are CSV, JSON lines or Parquet files, read by Hugging Face
``datasets.load_dataset(format, data_files=...)`` into a throwaway cache (never from
the hub). Columns:

* ``features``: numeric columns (default: every numeric column not named otherwise),
  standardised with the training split's mean and
  standard deviation (missing values: the mean) → ``x`` float32 [n, F];
* ``categorical``: columns whose values become embedding ids (the training split's
  values in sorted order from 1; 0 for a value not seen in training or missing) →
  ``categorical`` int64 [n, C] (``cardinalities``: ids per column, 0 included);
* ``text``: one text column, WordPiece-tokenised by a tokenizer trained on the training
  split (as the reviews set does) → ``input_ids`` int64 [n, seq_len];
* ``label``: the target: class ids (the training split's sorted values) for
  ``task = "classify"``, a float for ``"regress"``; as it is for a ``task.factory``.

Batches hold those keys in that order, then ``labels``; a user model is called as
``model(x, categorical, input_ids)`` with the ones the config names. Each run records
the files' SHA-256 in its ``dataset.json``.

``factory``: the function (called with ``data.kwargs``) returns ``(train, eval)``
``torch.utils.data.Dataset`` s whose items are dicts of tensors with a ``labels`` (or
``label``) key, or tuples ``(*inputs, label)``.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from comera_engine.data.registry import check_keys, dataset_info
from comera_engine.errors import ConfigError

FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json",
           ".parquet": "parquet", ".pq": "parquet"}
_CACHE: dict[tuple, Any] = {}


# --------------------------------------------------------------------------- reading


def _file(cfg: Mapping[str, Any], key: str, base_dir: Any) -> Path:
    raw = cfg.get(key)
    if not isinstance(raw, str) or not raw:
        raise ConfigError(f"data.{key}", "missing; give a CSV, JSON lines or Parquet file")
    path = Path(raw).expanduser()
    if not path.is_absolute():
        path = Path(base_dir or os.getcwd()) / path
    if not path.is_file():
        raise ConfigError(f"data.{key}", f"file not found: {raw}; give an existing CSV, JSON "
                                         "lines or Parquet file")
    if path.suffix.lower() not in FORMATS:
        raise ConfigError(f"data.{key}", f"{path.name}: unknown format; use a .csv, .tsv, "
                                         ".jsonl, .json or .parquet file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"data.{key}", f"{path.name} is not readable; fix its permissions")
    return path.resolve()


def file_columns(cfg: Mapping[str, Any], key: str = "train", base_dir: Any = None
                 ) -> dict[str, list[Any]]:
    """The columns of the file ``data.<key>`` of the ``[data]`` table ``cfg`` names
    (checked as a run checks it: present, a known format, readable)."""
    return read_columns(_file(cfg, key, base_dir), key)


def read_columns(path: Path, key: str) -> dict[str, list[Any]]:
    """The file's columns (name → values) through ``datasets.load_dataset`` with
    ``data_files``, in a temporary cache; kept in memory per file state."""
    stat = path.stat()
    memo = (str(path), stat.st_mtime_ns, stat.st_size)
    if memo in _CACHE:
        return _CACHE[memo]
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"data.{key}", "user files are read by Hugging Face datasets; pip "
                                         "install datasets") from None
    fmt = FORMATS[path.suffix.lower()]
    kwargs = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
    datasets.disable_progress_bars()
    # a file it cannot read is told in one line below, not in the library's log
    datasets.utils.logging.set_verbosity(logging.CRITICAL + 1)
    try:
        with tempfile.TemporaryDirectory(prefix="comera-files-") as cache:
            table = datasets.load_dataset(fmt, data_files={"train": str(path)}, split="train",
                                          cache_dir=cache, keep_in_memory=True, **kwargs)
            columns = table.to_dict()
    except Exception as exc:
        text = str(exc).strip().splitlines()
        raise ConfigError(f"data.{key}", f"cannot read {path.name} as {fmt} "
                                         f"({type(exc).__name__}: {text[0] if text else ''}); "
                                         "fix the file or its suffix") from None
    if not columns or not next(iter(columns.values()), []):
        raise ConfigError(f"data.{key}", f"{path.name} holds no rows")
    if len(_CACHE) > 16:
        _CACHE.clear()
    _CACHE[memo] = columns
    return columns


def _names(cfg: Mapping[str, Any], key: str) -> list[str]:
    value = cfg.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"data.{key}", f"must be a list of column names, got {value!r}")
    return list(value)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Table:
    """The ``[data]`` table of a ``files`` dataset, read and checked (no torch)."""

    def __init__(self, cfg: Mapping[str, Any], base_dir: Any) -> None:
        defaults = dataset_info("files").defaults
        check_keys(cfg, defaults)
        self.cfg = {**defaults, **{k: v for k, v in cfg.items() if v is not None}}
        self.task = self.cfg["task"]
        self.train_path = _file(cfg, "train", base_dir)
        self.eval_path = _file(cfg, "eval", base_dir) if cfg.get("eval") else None
        self.train = read_columns(self.train_path, "train")
        self.eval = read_columns(self.eval_path, "eval") if self.eval_path else None
        self.features = _names(cfg, "features")
        self.categorical = _names(cfg, "categorical")
        text = cfg.get("text")
        if text is not None and (not isinstance(text, str) or not text):
            raise ConfigError("data.text", f"must be one column name, got {text!r}")
        self.text = text
        label = cfg.get("label")
        if not isinstance(label, str) or not label:
            raise ConfigError("data.label", f"missing; name the label column (the file has: "
                                            f"{', '.join(self.train)})")
        self.label = label
        if label not in self.train:
            raise ConfigError("data.label", f"column {label!r} is not in "
                              f"{self.train_path.name} (its columns: {', '.join(self.train)})")
        if cfg.get("features") is None:  # every other numeric column
            taken = {label, *self.categorical, *([text] if text else [])}
            self.features = [c for c, v in self.train.items() if c not in taken and v
                             and all(x is None or _is_number(x) for x in v)]
        if not (self.features or self.categorical or self.text):
            raise ConfigError("data.features", "no input column; list numeric columns in "
                                               "data.features (or data.categorical, data.text)")
        for key, names in (("features", self.features), ("categorical", self.categorical),
                           ("text", [text] if text else []), ("label", [label])):
            for cols, path in ((self.train, self.train_path), (self.eval, self.eval_path)):
                if cols is None:
                    continue
                for name in names:
                    if name not in cols:
                        raise ConfigError(f"data.{key}", f"column {name!r} is not in "
                                          f"{path.name} (its columns: {', '.join(cols)})")
        for name in self.features:
            bad = next((v for v in self.train[name] if v is not None and not _is_number(v)),
                       None)
            if bad is not None:
                raise ConfigError("data.features", f"column {name!r} is not numeric (holds "
                                                   f"{bad!r}); list it in data.categorical "
                                                   "or data.text")
        if self.text:
            values = [v for v in self.train[self.text] if v is not None]
            if not values or all(_is_number(v) or _numeric_text(v) for v in values):
                raise ConfigError("data.text", f"column {self.text!r} holds numbers, not text; "
                                               "list it in data.features, or name a text column")
        self._labels()

    def _labels(self) -> None:
        train = self.train[self.label]
        if any(v is None for v in train):
            raise ConfigError("data.label", f"column {self.label!r} has missing values in "
                                            f"{self.train_path.name}; drop those rows")
        if self.task == "regress" and not all(_is_number(v) for v in train):
            raise ConfigError("data.label", f"column {self.label!r} is not numeric; a "
                                            'regression needs numbers (or task = "classify")')
        self.classes: list[Any] | None = None
        if self.task == "classify" or (self.task == "user" and not all(
                _is_number(v) for v in train)):
            classes = sorted(set(train), key=lambda v: (str(type(v)), v))
            if len(classes) < 2:
                raise ConfigError("data.label", f"column {self.label!r} has one class "
                                                f"({classes[0]!r}) in the training data; a "
                                                "classifier needs at least two")
            # continuous numbers (fractions, or a class for nearly every row): a
            # regression's target, which a classifier would take for as many classes
            numbers = all(_is_number(v) for v in train)
            fractional = numbers and any(math.isfinite(v) and v != int(v) for v in train)
            continuous = fractional or (numbers and len(classes) > len(train) / 2)
            hint = ('; its values are continuous numbers, a regression\'s target: set task '
                    '= "regress"' if continuous else "")
            self.classes = classes
            if self.eval is not None:
                unseen = sorted({v for v in self.eval[self.label]} - set(classes), key=str)
                if unseen:
                    raise ConfigError("data.label", f"{self.eval_path.name} has label "
                                      f"{unseen[0]!r}, which the training file does not; "
                                      "give both files the same classes" + hint)
            if fractional and self.task == "classify" and len(classes) > 100:
                raise ConfigError("data.label", f"column {self.label!r} holds "
                                                f"{len(classes):,} distinct numbers as classes"
                                                + hint)

    def splits(self) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """(train columns, eval columns): the eval file, else a seeded split."""
        if self.eval is not None:
            return self.train, self.eval
        from comera_engine.data.base import split_indices

        n = len(self.train[self.label])
        if n < 2:
            raise ConfigError("data.train", f"{self.train_path.name} holds {n} row; need 2 "
                                            "to split (or give data.eval)")
        frac = float(self.cfg["split_fraction"])
        tr, ev = split_indices(n, frac, int(self.cfg["seed"]))
        return ({k: [v[i] for i in tr] for k, v in self.train.items()},
                {k: [v[i] for i in ev] for k, v in self.train.items()})

    def cardinalities(self, train: Mapping[str, list[Any]]) -> list[int]:
        return [len({v for v in train[c] if v is not None}) + 1 for c in self.categorical]

    def vocab_size(self) -> int | None:
        return int(self.cfg["vocab_size"]) if self.text else None

    def num_classes(self) -> int | None:
        return len(self.classes) if self.classes is not None else None


def _numeric_text(v: Any) -> bool:
    try:
        float(str(v))
        return True
    except ValueError:
        return False


def shape(data: Mapping[str, Any]) -> dict[str, Any]:
    """What a model builder needs to know of a ``files`` dataset (the preview and the
    target plan), from its files' columns."""
    table = _Table(data, None)  # relative paths: from the current folder
    train, _ = table.splits()
    meta: dict[str, Any] = {"input_dim": len(table.features)}
    if table.categorical:
        meta["cardinalities"] = table.cardinalities(train)
    if table.text:
        meta["pad_id"] = 0
    return {"task": table.task, "num_classes": table.num_classes(),
            "vocab_size": table.vocab_size(),
            "seq_len": int(table.cfg["seq_len"]) if table.text else None, "meta": meta}


# --------------------------------------------------------------------------- building


def build_files(cfg: Mapping[str, Any], base_dir: Any = None) -> Any:
    """The ``files`` dataset (module docstring) as a ``DataBundle``."""
    import numpy as np
    import torch

    from comera_engine.data.base import DataBundle, TensorDictDataset
    from comera_engine.data.identity import dataset_identity

    table = _Table(cfg, base_dir)
    train, evals = table.splits()
    tensors: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
    extra: dict[str, Any] = {}
    meta: dict[str, Any] = {"input_dim": len(table.features)}
    if table.features:
        x_tr = np.array([[math.nan if v is None else float(v) for v in train[c]]
                         for c in table.features], dtype=np.float64).T
        mean = np.nanmean(x_tr, axis=0)
        mean = np.where(np.isfinite(mean), mean, 0.0)
        std = np.nanstd(x_tr, axis=0)
        std = np.where(np.isfinite(std) & (std > 0), std, 1.0)
        for out, cols in zip(tensors, (train, evals)):
            x = np.array([[math.nan if v is None else float(v) for v in cols[c]]
                          for c in table.features], dtype=np.float64).T
            x = np.where(np.isnan(x), mean, x)
            out["x"] = torch.from_numpy(((x - mean) / std).astype(np.float32))
        extra["standardise"] = {"mean": mean.tolist(), "std": std.tolist()}
        meta["feature_names"] = list(table.features)
        # the preparation, for an export that takes raw rows (export/pipeline.py)
        meta["mean"], meta["std"] = mean.tolist(), std.tolist()
    if table.categorical:
        vocab = {c: {v: i + 1 for i, v in enumerate(sorted(
            {v for v in train[c] if v is not None}, key=lambda v: (str(type(v)), v)))}
            for c in table.categorical}
        for out, cols in zip(tensors, (train, evals)):
            ids = [[vocab[c].get(v, 0) for v in cols[c]] for c in table.categorical]
            out["categorical"] = torch.tensor(list(zip(*ids)), dtype=torch.long)
        meta["cardinalities"] = table.cardinalities(train)
        # each column's values in id order (id 1 first; 0: unseen or missing)
        meta["categories"] = {c: sorted(vocab[c], key=vocab[c].get) for c in table.categorical}
    tokenizer = None
    notes: dict[str, Any] = {}
    if table.text:
        from comera_engine.data.tokenizer import TextSettings, load_or_train_tokenizer

        text = TextSettings.read({k: v for k, v in table.cfg.items()},
                                 dataset_info("files").defaults)
        texts = {id(cols): ["" if v is None else str(v) for v in cols[table.text]]
                 for cols in (train, evals)}
        tokenizer, trained, tok_path = load_or_train_tokenizer(
            table.cfg, base_dir, text, lambda: texts[id(train)])
        for out, cols in zip(tensors, (train, evals)):
            out["input_ids"] = tokenizer.encode_pairs(texts[id(cols)], None,
                                                      text.seq_len)["input_ids"]
        meta["pad_id"] = tokenizer.pad_id
        extra["tokenizer_sha256"] = tokenizer.sha256
        notes = {"tokenizer_trained": trained,
                 "tokenizer_path": str(tok_path) if tok_path else None}
    for out, cols in zip(tensors, (train, evals)):
        out["labels"] = _label_tensor(table, cols[table.label])
    if table.classes is not None:
        meta["label_names"] = [str(c) for c in table.classes]
    files = [table.train_path] + ([table.eval_path] if table.eval_path else [])
    identity = dataset_identity(
        "files", "files", {"train": len(train[table.label]), "eval": len(evals[table.label])},
        int(table.cfg["seed"]), files=files,
        params={"task": table.task, "features": table.features,
                "categorical": table.categorical, "text": table.text, "label": table.label,
                "split_fraction": None if table.eval_path else table.cfg["split_fraction"],
                "seq_len": table.cfg["seq_len"] if table.text else None,
                "vocab_size": table.vocab_size()},
        extra={**extra, "classes": meta.get("label_names")}, notes=notes)
    return DataBundle(
        name="files", task=table.task, train=TensorDictDataset(tensors[0]),
        eval=TensorDictDataset(tensors[1]), identity=identity,
        num_classes=table.num_classes(), vocab_size=table.vocab_size(),
        seq_len=int(table.cfg["seq_len"]) if table.text else None, tokenizer=tokenizer,
        meta=meta)


def _label_tensor(table: _Table, values: Sequence[Any]) -> Any:
    import torch

    if table.classes is not None:
        index = {c: i for i, c in enumerate(table.classes)}
        return torch.tensor([index[v] for v in values], dtype=torch.long)
    if table.task == "regress" or any(isinstance(v, float) for v in values):
        return torch.tensor([float(v) for v in values], dtype=torch.float32)
    return torch.tensor([int(v) for v in values], dtype=torch.long)


# --------------------------------------------------------------------------- factory


class _Items:
    """A user ``Dataset`` whose items become dicts of tensors (``labels`` last)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return _as_item(self.dataset[index])


def _as_item(item: Any) -> dict[str, Any]:
    import torch

    if isinstance(item, Mapping):
        out = {k: torch.as_tensor(v) for k, v in item.items() if k not in ("label", "labels")}
        label = item.get("labels", item.get("label"))
    elif isinstance(item, (tuple, list)) and len(item) >= 2:
        out = {f"input_{i}": torch.as_tensor(v) for i, v in enumerate(item[:-1])}
        label = item[-1]
    else:
        raise ConfigError("data.factory", f"a dataset item is a {type(item).__name__}; give "
                                          "dicts with a 'labels' key or (*inputs, label) tuples")
    if label is None:
        raise ConfigError("data.factory", "a dataset item has no 'labels' (or 'label') key")
    out["labels"] = torch.as_tensor(label)
    return out


def _factory_sets(cfg: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    from comera_engine.entry import call_entry, resolve_entry

    defaults = dataset_info("factory").defaults
    check_keys(cfg, defaults)
    spec = cfg.get("factory")
    fn = resolve_entry(spec, "data.factory", (os.getcwd(),))
    kwargs = cfg.get("kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise ConfigError("data.kwargs", f"must be a table, got {kwargs!r}")
    made = call_entry(fn, spec, "data.factory", dict(kwargs))
    if not (isinstance(made, (tuple, list)) and len(made) == 2 and all(
            hasattr(d, "__getitem__") and hasattr(d, "__len__") for d in made)):
        raise ConfigError("data.factory", f"{spec} returned {type(made).__name__}; return "
                                          "(train, eval) torch Datasets")
    train, evals = _Items(made[0]), _Items(made[1])
    if len(train) == 0 or len(evals) == 0:
        raise ConfigError("data.factory", f"{spec} returned an empty split; both need rows")
    labels = [train[i]["labels"] for i in range(len(train))]
    return spec, (train, evals), labels


def build_factory(cfg: Mapping[str, Any], base_dir: Any = None) -> Any:
    """The datasets of ``data.factory`` as a ``DataBundle``."""
    from comera_engine.data.base import DataBundle
    from comera_engine.data.identity import content_sha256, dataset_identity

    spec, (train, evals), labels = _factory_sets(cfg)
    task = cfg.get("task", dataset_info("factory").defaults["task"])
    classes = None
    if task == "classify":
        classes = sorted({int(v) for v in labels})
        if len(classes) < 2:
            raise ConfigError("data.factory", f"{spec}'s training labels have one class "
                                              f"({classes[0]}); a classifier needs two or more")
    first = train[0]
    meta = {"input_dim": int(first["x"].shape[-1]) if "x" in first and first["x"].dim() else 0}
    import torch

    identity = dataset_identity(
        "factory", f"factory:{spec}", {"train": len(train), "eval": len(evals)},
        cfg.get("seed"), params={"factory": spec, "kwargs": dict(cfg.get("kwargs") or {}),
                                 "task": task},
        extra={"labels_sha256": content_sha256(torch.stack(labels))})
    return DataBundle(name="factory", task=task, train=train, eval=evals, identity=identity,
                      num_classes=(max(classes) + 1) if classes else None, meta=meta)


def factory_shape(data: Mapping[str, Any]) -> dict[str, Any]:
    """A ``data.factory`` dataset's shape facts (its datasets are built to tell them)."""
    bundle = build_factory(data)
    return {"task": bundle.task, "num_classes": bundle.num_classes, "vocab_size": None,
            "seq_len": None, "meta": bundle.meta}
