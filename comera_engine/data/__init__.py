"""Data layer: datasets by name from a config dict, each as a ``DataBundle``.

>>> bundle = build_dataset({"name": "digits", "seed": 0})
>>> bundle.train[0]["x"].shape, bundle.num_classes
(torch.Size([64]), 10)

Registered names (``available_datasets()``):

* ``digits``: sklearn 8x8 digits, ``task="classification"``.
* ``snli``, ``mnli``, ``nli``: NLI from a GLUE TSV / jsonl / parquet file (``path``,
  optional ``eval_path``), or from the Hugging Face hub (``hub = true``; snli/mnli only);
  ``task="nli"``.
* ``code_mlm``: masked-LM blocks of the Python standard library, ``task="mlm"``.
* ``clicks``: Criteo TSV (``path``, ``bucket_sizes``), ``task="ctr"``.
* ``clicks_synthetic``: generated clicks with a planted interaction, ``task="ctr"``.

Only ``torch`` and ``numpy`` are needed to import this package; ``datasets``,
``tokenizers``, ``sklearn`` and ``pyarrow`` are imported when a dataset needs them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from comera_engine.data import builders
from comera_engine.data.base import DataBundle, TensorDictDataset, split_indices
from comera_engine.data.identity import content_sha256, dataset_identity, file_sha256
from comera_engine.errors import ConfigError

Builder = Callable[[Mapping[str, Any], "str | Path | None"], DataBundle]

_REGISTRY: dict[str, Builder] = {
    "digits": builders.build_digits,
    "snli": builders.build_nli,
    "mnli": builders.build_nli,
    "nli": builders.build_nli,
    "code_mlm": builders.build_code_mlm,
    "clicks": builders.build_clicks,
    "clicks_synthetic": builders.build_clicks_synthetic,
}


def register_dataset(name: str, builder: Builder) -> None:
    """Add (or replace) a dataset builder ``builder(cfg, base_dir) -> DataBundle``."""
    if not name or not isinstance(name, str):
        raise ValueError(f"name: must be a non-empty string, got {name!r}")
    _REGISTRY[name] = builder


def available_datasets() -> list[str]:
    """Names accepted by ``build_dataset``, sorted."""
    return sorted(_REGISTRY)


def build_dataset(cfg: Mapping[str, Any], base_dir: str | Path | None = None) -> DataBundle:
    """Build the dataset described by ``cfg`` (the ``[data]`` section of a run config).

    Args:
        cfg: e.g. ``{"name": "snli", "path": "../shared/data/snli/dev.jsonl",
            "seq_len": 64, "vocab_size": 4000, "split_fraction": 0.8, "seed": 0}``.
        base_dir: folder that relative paths are taken from (default: the working dir).

    Raises:
        ConfigError: bad input; the message names the field (``data.path: ...``) and the fix.
    """
    if not isinstance(cfg, Mapping):
        raise ConfigError("data", f"must be a table (dict) with at least 'name', got {cfg!r}")
    name = cfg.get("name")
    if not name:
        raise ConfigError("data.name", f"missing; choose one of {', '.join(available_datasets())}")
    if name not in _REGISTRY:
        raise ConfigError(
            "data.name",
            f"unknown dataset '{name}'; choose one of {', '.join(available_datasets())}",
        )
    return _REGISTRY[name](cfg, base_dir)


__all__ = [
    "ConfigError",
    "DataBundle",
    "TensorDictDataset",
    "available_datasets",
    "build_dataset",
    "content_sha256",
    "dataset_identity",
    "file_sha256",
    "register_dataset",
    "split_indices",
]
