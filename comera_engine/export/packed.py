"""How the tensors of a safetensors export are laid out (format 3): few header entries,
no numbers as JSON text.

A safetensors header spends some 60 bytes on each tensor it lists and a JSON number some
20 bytes on each value. At the paper's sizes that is nothing, but the 60x digits TT MLP
has under 4,000 weights (4 KB in int8): per-tensor entries and the input statistics as
text would make the header as large as the weights. So:

``params`` (compressed exports)
    every floating parameter (a TT layer's packed cores ``<layer>.tt.cores`` included),
    flattened and concatenated in the order of their names (sorted), in the stored type
    (the model's float type, bfloat16 or int8). The loader rebuilds the model and knows
    every shape, so the header lists none of them.
``scales`` (compressed int8 exports)
    their float32 int8 scales in the same order: one per TT core, one per row of a
    tensor of two or more dimensions, one for a vector (:mod:`comera_engine.export.quant`).
``meta:<key>`` (every safetensors export)
    each list of floats of the data spec's ``meta`` (the digits pipeline's per-pixel
    ``mean`` and ``std``), taken out of the JSON metadata: float32, or float16 in a bf16
    or int8 export where that keeps every value within 0.1 % (else float32).

Buffers and non-floating parameters keep their ``state_dict`` names, as do all tensors of
a dense export (a plain state dict, with ``<name>.scale`` beside each int8 tensor); a
model whose own tensors take one of these names is refused on export.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from comera_engine.errors import ConfigError
from comera_engine.export.quant import SCALE_SUFFIX

__all__ = ["META_PREFIX", "PARAMS", "SCALES", "join_meta", "meta_names", "pack",
           "packed_expectation", "packed_names", "split_meta", "unpack"]

PARAMS, SCALES = "params", "scales"
META_PREFIX = "meta:"  # no state_dict name has a colon
#: A data spec's lists are at most this long (``comera_engine.runplan.data``), and a file
#: may hold at most this many of them.
MAX_META_LEN, MAX_META_ARRAYS = 4096, 64
_KEY = re.compile(r"[A-Za-z0-9_]{1,64}\Z")
_F16_REL = 1e-3

Expectation = dict[str, tuple[tuple[int, ...], torch.dtype]]


def packed_names(expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 params: set[str]) -> list[str]:
    """The names ``params`` concatenates: the floating ones among ``params`` (parameter
    names and packed cores), sorted."""
    return sorted(n for n in params if n in expected and expected[n][1].is_floating_point)


def _scaled(stored: Mapping[str, Any], names: list[str]) -> tuple[list[str], set[str]]:
    """The names among ``names`` that have int8 scales in ``stored``, and every key of
    ``stored`` the pack takes (``names`` and those scales)."""
    scaled = [n for n in names if n + SCALE_SUFFIX in stored]
    return scaled, set(names) | {n + SCALE_SUFFIX for n in scaled}


def pack(stored: Mapping[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """``stored`` (per name, with ``<name>.scale`` beside each int8 tensor) with the
    tensors of ``names`` and their scales concatenated into ``params`` and ``scales``."""
    scaled, gone = _scaled(stored, names)
    out = {k: v for k, v in stored.items() if k not in gone}
    for taken in (PARAMS, SCALES):
        if taken in out:
            raise ConfigError("model", f"holds a buffer named {taken!r}, the name a compressed "
                                       "export gives its packed weights; rename it")
    if names:
        out[PARAMS] = torch.cat([stored[n].detach().reshape(-1) for n in names])
    if scaled:
        out[SCALES] = torch.cat([stored[n + SCALE_SUFFIX].detach().reshape(-1).float()
                                 for n in scaled])
    return out


def packed_expectation(stored: Expectation, names: list[str]) -> Expectation:
    """What a compressed file holds for the per-name expectation ``stored`` (what
    :func:`pack` was given): ``params`` and ``scales`` for ``names``, the rest as is."""
    scaled, gone = _scaled(stored, names)
    out = {k: v for k, v in stored.items() if k not in gone}
    if names:
        out[PARAMS] = ((sum(math.prod(stored[n][0]) for n in names),), stored[names[0]][1])
    if scaled:
        out[SCALES] = ((sum(math.prod(stored[n + SCALE_SUFFIX][0]) for n in scaled),),
                       torch.float32)
    return out


def unpack(read: Mapping[str, torch.Tensor], stored: Expectation, names: list[str]
           ) -> dict[str, torch.Tensor]:
    """The per-name tensors back from what :func:`pack` wrote (shapes from ``stored``)."""
    out = {k: v for k, v in read.items() if k not in (PARAMS, SCALES)}
    scaled, _ = _scaled(stored, names)
    for flat_name, keys in ((PARAMS, names), (SCALES, [n + SCALE_SUFFIX for n in scaled])):
        pos = 0
        for key in keys:
            shape = stored[key][0]
            n = math.prod(shape)
            out[key] = read[flat_name][pos: pos + n].reshape(shape)
            pos += n
    return out


def _float_list(value: Any) -> bool:
    return (isinstance(value, list) and 0 < len(value) <= MAX_META_LEN
            and all(isinstance(v, float) and math.isfinite(v) for v in value))


def _floats_tensor(values: list[float], store_dtype: str) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    if store_dtype != "float32":
        half = t.to(torch.float16)
        if bool(((half.float() - t).abs() <= _F16_REL * t.abs()).all()):
            return half
    return t


def split_meta(recipe: Mapping[str, Any], store_dtype: str
               ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``recipe`` as the file's JSON holds it (the data spec's float lists taken out, and
    its ``null`` entries), and those lists as ``meta:<key>`` tensors."""
    spec = recipe.get("data_spec")
    if not isinstance(spec, Mapping):
        return dict(recipe), {}
    meta = spec.get("meta")
    meta = dict(meta) if isinstance(meta, Mapping) else meta
    arrays: dict[str, torch.Tensor] = {}
    if isinstance(meta, dict):
        for key in [k for k, v in meta.items() if _KEY.match(k) and _float_list(v)]:
            arrays[META_PREFIX + key] = _floats_tensor(meta.pop(key), store_dtype)
    spec = {k: v for k, v in spec.items() if v is not None and k != "meta"}
    if meta is not None:
        spec["meta"] = meta
    return {**recipe, "data_spec": spec}, arrays


def meta_names(tensors: Mapping[str, Any]) -> list[str]:
    """The ``meta:<key>`` tensors among a header's."""
    return [k for k in tensors if k.startswith(META_PREFIX)]


def join_meta(recipe: Any, entries: Mapping[str, Any], read: Any) -> Any:
    """``recipe`` (from a file's JSON) with the data spec's float lists put back from the
    ``meta:<key>`` tensors. ``entries``: their header entries (checked here: 1-D float
    tensors of at most 4,096 values, at most 64 of them, for keys the JSON lacks);
    ``read(names)`` reads them.

    Raises:
        ConfigError: a bad entry (the field names the tensor).
    """
    if not entries:
        return recipe
    if len(entries) > MAX_META_ARRAYS:
        raise ConfigError("tensors", f"{len(entries)} are data spec arrays ({META_PREFIX}"
                                     f"...), more than the {MAX_META_ARRAYS} a spec has")
    spec = recipe.get("data_spec") if isinstance(recipe, Mapping) else None
    meta = spec.get("meta", {}) if isinstance(spec, Mapping) else None
    if not isinstance(meta, Mapping):
        raise ConfigError(f"tensor {next(iter(entries))!r}", "a data spec array, and the "
                          "metadata's recipe has no data spec")
    for name, entry in entries.items():
        key = name[len(META_PREFIX):]
        if not _KEY.match(key) or key in meta:
            raise ConfigError(f"tensor {name!r}", "names no free entry of the data spec's "
                                                  "meta")
        if entry.dtype not in ("F16", "F32") or len(entry.shape) != 1 or not (
                0 < entry.shape[0] <= MAX_META_LEN):
            raise ConfigError(f"tensor {name!r}", f"must be a float16 or float32 vector of 1 "
                              f"to {MAX_META_LEN} values, got {entry.dtype} "
                              f"{list(entry.shape)}")
    values = read(list(entries))
    meta = {**meta, **{k[len(META_PREFIX):]: [float(x) for x in values[k].float().tolist()]
                       for k in entries}}
    return {**recipe, "data_spec": {**spec, "meta": meta}}
