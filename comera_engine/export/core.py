"""``export_model`` and ``load``: the compressed and dense formats (ONNX lives in
:mod:`comera_engine.export.onnx_export`).

compressed
    One safetensors file: every TT layer's cores *physically truncated* to the effective
    ranks with the rank gates absorbed (``G_k · diag(g_k)``, dead entries sliced out),
    plus every other parameter and persistent buffer. A layer's cores are packed into one
    1-D tensor ``<layer>.tt.cores``: core ``k`` of shape ``(R_{k-1}, *modes_k, R_k)``
    (``R`` = ``[1, *ranks, 1]`` from the layer's entry in ``tt_layers``, modes from the
    rebuilt layer: ``(n_k,)``/``(m_k,)`` for a linear, ``(v_k, e_k)`` for an embedding),
    flattened row-major, one after the other; and all floating parameters, those packed
    cores included, are concatenated into one tensor ``params`` (int8 scales into
    ``scales``; :mod:`comera_engine.export.packed`). The model's tensor bytes equal
    ``size_report(model)["model"]["effective_bytes"]`` exactly and the header is a few
    hundred bytes. A layer whose rank fell to 0 (the zero map) stores no core values.
dense
    The reconstructed model as the dense baseline of the same architecture
    (``nn.Linear``/``nn.Embedding`` with the TT weights multiplied out): a plain
    ``state_dict`` in safetensors.

Both carry, under the safetensors metadata key ``comera``, compact JSON with what
``load`` needs and nothing else: the format and its version, the dtype computed in and
the stored type (``storage``), a recipe to rebuild the module tree (see
:mod:`comera_engine.export.spec`) whose data spec's float lists (the digits pipeline's
mean and std) are tensors ``meta:<key>`` instead of text, per TT layer its name, ranks
and ``tau``, and the tokenizer file of a text model. The input pipeline follows from the
recipe. What describes the export (run, config, data set identity, final metrics, sizes,
library version, time) is in its model card (``<file>.md``), whose JSON block
:func:`read_metadata` adds. ``load`` checks the header, the recipe and every tensor's
name, shape and dtype against the rebuilt model before reading any weights. Files of
format versions 1 and 2 (per-name tensors, everything in the JSON) still load.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from comera_engine.errors import ConfigError
from comera_engine.export import packed as _packed
from comera_engine.export import pipeline as _pipeline
from comera_engine.export import quant as _quant
from comera_engine.export import spec as _spec
from comera_engine.export.container import (
    FORMATS,
    METADATA_KEY,
    BadExportFile,
    Header,
    TensorEntry,
    read_comera_metadata,
    read_header,
    write_atomic,
)
from comera_engine.layers import TTLinear, is_conv1d, size_report, tt_layers
from comera_engine.layers.tied import TiedDecoder
from comera_engine.layers.tree import unique_state_dict, with_aliases
from comera_engine.tensor.tt import max_tt_ranks

__all__ = ["FORMATS", "ExportResult", "export_model", "load", "read_metadata"]

FORMAT_IDS = {"compressed": "comera-compressed", "dense": "comera-dense", "onnx": "comera-onnx"}
#: 3: compact header (module doc); 2: weights stored in bf16 / int8; 1: float32
FORMAT_VERSION = 3
SUFFIX = {"compressed": ".safetensors", "dense": ".safetensors", "onnx": ".onnx"}
DEFAULT_NAME = {"compressed": "model.safetensors", "dense": "model.dense.safetensors",
                "onnx": "model.onnx"}
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}


@dataclass
class ExportResult:
    """What an export wrote.

    ``file_bytes`` is the size on disk of ``path``; ``tensor_bytes`` the bytes of the
    model's tensor data in it (weights, scales, buffers; for ONNX, the initializers);
    ``input_bytes`` those of the data spec's arrays (the input pipeline's statistics,
    safetensors formats); ``expected_bytes`` what ``size_report`` says the format should
    hold (compressed: the effective size; dense: the dense size; bf16 / int8: the stored
    weights and scales), ``header_bytes`` the rest (safetensors header / ONNX graph and
    metadata).
    """

    format: str
    path: Path
    card: Path
    tokenizer: Path | None
    file_bytes: int
    tensor_bytes: int
    expected_bytes: int
    sizes: dict[str, Any]
    metadata: dict[str, Any] = field(repr=False, default_factory=dict)
    onnx_max_abs_diff: float | None = None
    layers: list[dict[str, Any]] = field(repr=False, default_factory=list)
    #: how the weights are stored: float32, bf16 or int8 (``comera export --dtype``)
    store_dtype: str = "float32"
    input_bytes: int = 0

    @property
    def header_bytes(self) -> int:
        return self.file_bytes - self.tensor_bytes - self.input_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format, "path": str(self.path), "card": str(self.card),
            "tokenizer": str(self.tokenizer) if self.tokenizer else None,
            "file_bytes": self.file_bytes, "tensor_bytes": self.tensor_bytes,
            "expected_bytes": self.expected_bytes, "input_bytes": self.input_bytes,
            "header_bytes": self.header_bytes,
            "onnx_max_abs_diff": self.onnx_max_abs_diff,
            "compression": self.sizes.get("model", {}).get("compression"),
            "dtype": self.store_dtype,
        }


# ------------------------------------------------------------------------ TT helpers
def _tt_name_set(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return tt_layers(model)


@torch.no_grad()
def _layer_info(name: str, layer: nn.Module, ranks: list[int]) -> dict[str, Any]:
    if isinstance(layer, TTLinear):
        info = {"name": name, "kind": "linear",
                "shape": [layer.in_features, layer.out_features],
                "factors": [list(layer.in_factors), list(layer.out_factors)],
                "bias": layer.bias is not None, "tau": layer.tt.tau, "ranks": ranks}
        if layer.layout != "tt":  # absent: the paper's layout
            info["layout"] = layer.layout
        return info
    return {"name": name, "kind": "embedding",
            "shape": [layer.num_embeddings, layer.embedding_dim],
            "factors": [list(layer.vocab_factors), list(layer.dim_factors)],
            "padding_idx": layer.padding_idx, "tau": layer.tt.tau, "ranks": ranks}


def _persistent_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state, each module held at several places once (T5's shared table)."""
    return unique_state_dict(model)


def _under(key: str, prefixes: list[str]) -> str | None:
    for p in prefixes:
        if key.startswith(p + "."):
            return p
    return None


def _compressed_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    names = []
    for name, layer in _tt_name_set(model):
        cores, _ = layer.tt.effective_cores()
        tensors[f"{name}.tt.cores"] = torch.cat([c.reshape(-1) for c in cores])
        names.append(name)
    for key, value in _persistent_state(model).items():
        owner = _under(key, names)
        if owner is not None and key.startswith(owner + ".tt."):
            continue  # cores (written above), gates (absorbed), alive masks (all alive)
        tensors[key] = value
    return tensors


@torch.no_grad()
def _dense_tensors(model: nn.Module, dense: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of ``model`` with each TT layer's weight rebuilt, named and laid out
    as the dense rebuild ``dense`` (a skeleton) holds them: ``<layer>.weight``, an
    attention's packed projection as its ``in_proj_weight`` / ``in_proj_bias``, a
    Hugging Face ``Conv1D``'s weight ``(in, out)``."""
    tensors: dict[str, torch.Tensor] = {}
    layers = dict(_tt_name_set(model))
    names = list(layers)
    home = dict(dense.named_modules())
    for key, value in _persistent_state(model).items():
        owner = _under(key, names)
        if owner is None:
            tensors[key] = value
            continue
        attention = owner.rpartition(".")[0]
        packed = (owner.endswith(".in_proj") and owner not in home
                  and isinstance(home.get(attention), nn.MultiheadAttention))
        weight = f"{attention}.in_proj_weight" if packed else f"{owner}.weight"
        if key.startswith(owner + ".tt."):
            if weight not in tensors:
                w = layers[owner].dense_weight()
                tensors[weight] = w.t().contiguous() if is_conv1d(home.get(owner)) else w
            continue
        tensors[f"{attention}.in_proj_bias" if packed and key == f"{owner}.bias" else key] = value
    for name, module in model.named_modules():  # a tied head holds the table's weight
        if isinstance(module, TiedDecoder) and f"{name}.weight" not in tensors:
            tensors[f"{name}.weight"] = module.weight.detach().clone()
    return with_aliases(dense, tensors)  # the dense model's state dict, every name


# ------------------------------------------------------------------------ expectations
def _expected_state(skeleton: nn.Module, fmt: str, infos: list[dict] | None,
                    where: str) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], dict]:
    """Names, shapes and dtypes the file must hold for this skeleton (built on ``meta``),
    and per TT layer name ``(validated ranks, core shapes)`` (compressed). A layer's cores
    are stored packed: one 1-D tensor ``<layer>.tt.cores``, the row-major cores one after
    the other. A dense file holds the dense model's whole state dict (a module held at
    several places under each of its names: ``load_state_dict`` takes it as it is); a
    compressed file each module once (:func:`unique_state_dict`)."""
    state = {k: (tuple(v.shape), v.dtype) for k, v in (
        skeleton.state_dict() if fmt == "dense" else unique_state_dict(skeleton)).items()}
    layers = dict(_tt_name_set(skeleton))
    if fmt == "dense":
        if layers:
            raise ConfigError(where, "the dense rebuild still has TT layers")
        return state, {}
    if not isinstance(infos, list):
        raise ConfigError(f"{where}.tt_layers", "must be a list")
    given: dict[str, dict] = {}
    for i, info in enumerate(infos):
        if not isinstance(info, Mapping) or not isinstance(info.get("name"), str):
            raise ConfigError(f"{where}.tt_layers[{i}]", "must be an object with a name")
        if info["name"] in given:
            raise ConfigError(f"{where}.tt_layers[{i}]", f"duplicate layer {info['name']!r}")
        given[info["name"]] = dict(info)
    extra = sorted(set(given) - set(layers))
    missing = sorted(set(layers) - set(given))
    if extra:
        raise ConfigError(f"{where}.tt_layers", f"{extra[0]!r} is not a TT layer of the "
                                                "model the recipe builds")
    if missing:
        raise ConfigError(f"{where}.tt_layers", f"TT layer {missing[0]!r} of the model is not "
                                                "described")
    ranks_of: dict[str, list[int]] = {}
    for name, layer in layers.items():
        info = given[name]
        if "factors" in info:  # the export's own rows and files before version 3: checked
            _same_structure(info, _layer_info(name, layer, []), f"{where}.tt_layers.{name}")
        ranks = info.get("ranks")
        K = layer.tt.num_cores
        if not isinstance(ranks, list) or len(ranks) != K - 1 or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks
        ):
            raise ConfigError(f"{where}.tt_layers.{name}.ranks",
                              f"need {K - 1} integers >= 0, got {ranks!r}")
        caps = max_tt_ranks(layer.tt.mode_sizes)
        for k, (r, cap) in enumerate(zip(ranks, caps)):
            if r > cap:
                raise ConfigError(f"{where}.tt_layers.{name}.ranks",
                                  f"rank {r} of bond {k} exceeds the maximal TT rank {cap}")
        if 0 in ranks and any(ranks):
            raise ConfigError(f"{where}.tt_layers.{name}.ranks",
                              f"a zero-rank layer must have every rank 0, got {ranks}")
        full = [1, *ranks, 1]
        shapes = [(full[k], *layer.tt.mode_shapes[k], full[k + 1]) for k in range(K)]
        tau = info.get("tau", layer.tt.tau)
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0 <= tau < 1:
            raise ConfigError(f"{where}.tt_layers.{name}.tau", f"must be in [0, 1), got {tau!r}")
        ranks_of[name] = (ranks, shapes, float(tau))
        dtype = layer.tt.cores[0].dtype
        for key in [k for k in state if k.startswith(name + ".tt.")]:
            del state[key]
        state[f"{name}.tt.cores"] = ((sum(math.prod(sh) for sh in shapes),), dtype)
    return state, ranks_of


def _same_structure(info: Mapping[str, Any], mine: dict[str, Any], where: str) -> None:
    """A layer entry's factors and layout against the rebuilt layer's (files from version 3
    on leave them out: the recipe gives them)."""
    if info.get("factors") != mine["factors"]:
        raise ConfigError(f"{where}.factors",
                          f"{info.get('factors')} disagree with the model's {mine['factors']}")
    if info.get("layout", "tt") != mine.get("layout", "tt"):
        raise ConfigError(f"{where}.layout", f"{info.get('layout', 'tt')!r} disagrees with "
                                             f"the model's {mine.get('layout', 'tt')!r}")


def _check_tensors(path: Path, have: Mapping[str, TensorEntry],
                   expected: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    missing = [k for k in expected if k not in have]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise BadExportFile(path, f"tensor {missing[0]!r} is missing{more}")
    extra = sorted(k for k in have if k not in expected)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise BadExportFile(path, f"unknown tensor {extra[0]!r}{more}: the metadata does not "
                                  "describe it")
    for name, (shape, dtype) in expected.items():
        entry = have[name]
        if entry.shape != tuple(shape):
            raise BadExportFile(
                path, f"tensor {name!r} has shape {list(entry.shape)} but the metadata "
                f"(config, factors and ranks) says {list(shape)}")
        if entry.dtype != _ST_DTYPES.get(dtype):
            raise BadExportFile(path, f"tensor {name!r} has dtype {entry.dtype}, expected "
                                      f"{_ST_DTYPES.get(dtype, dtype)}")


# ------------------------------------------------------------------------ paths
def resolve_out(out: str | os.PathLike[str], fmt: str) -> Path:
    """The file an export writes: ``out`` itself, or ``out/<default name>`` when ``out``
    is an existing folder or ends with a path separator."""
    text = os.fspath(out)
    if not text:
        raise ConfigError("--out", "must be a file or folder path")
    p = Path(text)
    if p.is_dir() or text.endswith(("/", os.sep)):
        p.mkdir(parents=True, exist_ok=True)
        return p / DEFAULT_NAME[fmt]
    if p.suffix != SUFFIX[fmt]:
        article = "an" if fmt[0] in "aeiou" else "a"
        raise ConfigError("--out", f"{article} {fmt} export is a {SUFFIX[fmt]} file, got "
                          f"{p.name!r} "
                          f"(or give a folder)")
    if not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    return p


def card_path(path: Path) -> Path:
    return path.with_name(path.name + ".md")


def tokenizer_path(path: Path) -> Path:
    return path.with_name(path.name + ".tokenizer.json")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------------ metadata
def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "item"):
        return _jsonable(value.item())
    return str(value)


def _stored_compressed_bytes(model: nn.Module, dtype: str) -> int:
    """The bytes of ``model``'s compressed weights stored in ``dtype`` (``bf16``: two a
    value; ``int8``: one, plus the scales), as a compressed safetensors file holds them."""
    tensors = _compressed_tensors(model)
    stored, _ = _quant.quantize_state(tensors, _param_names(model, tensors), dtype,
                                      _core_sizes(model))
    return _quant.stored_bytes(stored)


def _param_names(model: nn.Module, tensors: dict[str, torch.Tensor]) -> set[str]:
    """The names in ``tensors`` that are not the model's buffers: the weights a storage
    dtype applies to (buffers are stored as they are)."""
    buffers = {k for k, _ in model.named_buffers(remove_duplicate=False)}
    return {k for k in tensors if k not in buffers}


def _sizes(model: nn.Module) -> dict[str, Any]:
    """``size_report`` as JSON (the per-layer rows live in the ``tt_layers`` entries)."""
    return _jsonable(size_report(model))


def _layer_rows(model: nn.Module, sizes: dict[str, Any]) -> list[dict[str, Any]]:
    """Per TT layer, for the model card: name, kind, shape, factors, allocated and
    exported (effective) ranks, and its sizes from ``size_report``."""
    by_name = {r["name"]: r for r in sizes.get("layers", [])}
    rows = []
    for name, layer in _tt_name_set(model):
        row = _layer_info(name, layer, layer.tt.effective_cores()[1])
        row["allocated_ranks"] = layer.tt.ranks[1:-1]
        rep = by_name.get(name, {})
        for key in ("dense_params", "effective_params", "compression"):
            if key in rep:
                row[key] = rep[key]
        rows.append(row)
    return rows


_DOC_LAYER_KEYS = ("name", "kind", "shape", "factors", "ranks", "tau", "bias", "padding_idx",
                   "layout")


def _model_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _base_metadata(fmt: str, recipe: dict, metadata: Mapping[str, Any], model: nn.Module,
                   sizes: dict, infos: list[dict]) -> dict[str, Any]:
    from comera_engine._version import __version__

    doc: dict[str, Any] = {
        "format": FORMAT_IDS[fmt],
        "format_version": FORMAT_VERSION,
        "name": metadata.get("name") or (metadata.get("run") or {}).get("name") or
        recipe.get("family") or "model",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "library": {"name": "comera-studio", "version": __version__,
                    "torch": torch.__version__.split("+")[0]},
        "model": recipe,
        "dtype": str(_model_dtype(model)).replace("torch.", ""),
        "tt_layers": [{k: r[k] for k in _DOC_LAYER_KEYS if k in r} for r in infos],
        "sizes": {k: v for k, v in sizes.items() if k != "layers"},
    }
    if recipe.get("builder") == "family":
        pipe = _pipeline.pipeline_for(recipe.get("data_spec"), recipe.get("family"))
        if pipe is not None:
            doc["input_pipeline"] = pipe
    config = metadata.get("config")
    if isinstance(config, Mapping):
        doc["config"] = _jsonable(dict(config))
    for key in ("dataset", "metrics", "run"):
        if metadata.get(key) is not None:
            if not isinstance(metadata[key], Mapping):
                raise ConfigError(f"metadata.{key}", f"must be a dict, got "
                                  f"{type(metadata[key]).__name__}")
            doc[key] = _jsonable(metadata[key])
    return doc


def _stage_tokenizer(tok: Any, target: Path, pipeline: Mapping[str, Any] | None = None
                     ) -> tuple[Path | None, dict[str, Any] | None]:
    """Write the tokenizer to a temporary file beside ``target``; returns it (moved into
    place by the caller once the export itself is written) and its metadata entry. With a
    ``tokens`` pipeline the file pads and truncates to the model's sequence length."""
    if tok is None:
        return None, None
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    if isinstance(tok, (str, os.PathLike)):
        src = Path(tok)
        if src.is_dir():
            src = src / "tokenizer.json"
        if not src.is_file():
            raise ConfigError("metadata.tokenizer", f"file not found: {tok}")
        shutil.copyfile(src, tmp)
    elif hasattr(tok, "save"):
        try:
            written = Path(tok.save(tmp.with_name(tmp.name + ".json")))
            os.replace(written, tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    else:
        raise ConfigError("metadata.tokenizer",
                          f"must be a tokenizer.json path or a tokenizer, got {type(tok).__name__}")
    if pipeline is not None and pipeline.get("kind") == "tokens":
        try:
            _pipeline.bake_tokenizer(tmp, int(pipeline["seq_len"]), int(pipeline["pad_id"]))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return tmp, {"file": target.name, "sha256": _sha256(tmp)}


# ------------------------------------------------------------------------ export
def export_model(
    model: nn.Module,
    out_path: str | os.PathLike[str],
    format: str = "compressed",  # noqa: A002 - the CLI flag's name
    metadata: Mapping[str, Any] | None = None,
    *,
    example_inputs: tuple[torch.Tensor, ...] | None = None,
    verify: bool = True,
    dtype: str = "float32",
) -> ExportResult:
    """Export ``model`` as ``format`` (``compressed``, ``dense`` or ``onnx``) to
    ``out_path`` (a file, or a folder that gets ``model.safetensors`` /
    ``model.dense.safetensors`` / ``model.onnx``), with a model card beside it
    (``<file>.md``). ``model`` itself is not modified.

    ``metadata`` (all optional, JSON-able): ``config`` (the run config dict; its
    ``model`` table is how a :mod:`comera_engine.models` family is rebuilt),
    ``data_spec`` (:func:`~comera_engine.export.spec.data_spec_from_bundle`),
    ``dataset`` (dataset identity), ``metrics`` (final metrics), ``tokenizer`` (a
    ``tokenizer.json`` path or a tokenizer with ``save``; copied beside the export),
    ``run`` (run id, dir, checkpoint, step), ``name``. Without ``config``, ``model``
    must be an ``nn.Sequential`` of supported layers.

    ``example_inputs`` (ONNX only) overrides the traced inputs; ``verify`` (ONNX) runs
    onnxruntime when it is installed and compares with PyTorch. ``dtype``: how the
    weights are stored, ``float32``, ``bf16`` or ``int8`` (scales per TT core, per row,
    per vector: :mod:`comera_engine.export.quant`).

    Raises:
        ConfigError: bad format/out path/dtype, weights int8 cannot hold, or metadata
            that cannot rebuild ``model``.
    """
    dtype = _quant.parse_store_dtype(dtype)
    if format not in FORMATS:
        raise ConfigError("format", f"unknown format {format!r}; choose from {', '.join(FORMATS)}")
    if not isinstance(model, nn.Module):
        raise ConfigError("model", f"must be an nn.Module, got {type(model).__name__}")
    metadata = dict(metadata or {})
    try:
        recipe = _spec.describe(model, metadata)
    except ConfigError:  # a network of the user's own class: ONNX is a graph, not a build
        if format != "onnx" or metadata.get("config") is not None:
            raise
        if not example_inputs:
            raise ConfigError("example_inputs", f"an ONNX export of a {type(model).__name__} "
                                                "traces it: give example_inputs=(x,), a batch "
                                                "of what it takes") from None
        recipe = {"builder": "graph", "class": type(model).__name__}
    path = resolve_out(out_path, format)
    sizes = _sizes(model)
    was_training = model.training
    tok_tmp: Path | None = None
    try:
        model.eval()
        infos = _layer_rows(model, sizes)
        if format == "onnx":
            from comera_engine.export import onnx_export

            doc = _base_metadata(format, recipe, metadata, model, sizes, infos)
            tok_tmp, doc["tokenizer"] = _stage_tokenizer(metadata.get("tokenizer"),
                                                         tokenizer_path(path),
                                                         doc.get("input_pipeline"))
            doc["storage"] = _storage_doc(dtype)
            res = onnx_export.export_onnx(model, path, recipe, doc, example_inputs, verify,
                                          dtype=dtype)
            tensor_bytes, diff = res["initializer_bytes"], res["max_abs_diff"]
            input_bytes = 0
            expected = int(sizes["model"]["effective_bytes"])
            if dtype != "float32":  # the graph's initializers: the compressed weights, stored
                expected = _stored_compressed_bytes(model, dtype)
            doc["onnx"] = res
        else:
            if format == "compressed":
                tensors = _compressed_tensors(model)
                expected = int(sizes["model"]["effective_bytes"])
            else:
                tensors = _dense_tensors(model, _spec.build(recipe, dense=True,
                                                            device="meta"))
                expected = int(sizes["model"]["dense_bytes"])
            doc = _base_metadata(format, recipe, metadata, model, sizes, infos)
            taus = _self_check(recipe, format, tensors, infos)
            params = _param_names(model, tensors)
            packed = _packed.packed_names(
                {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}, params)
            tensors, doc["storage"] = _quant.quantize_state(
                tensors, params, dtype, _core_sizes(model) if format == "compressed" else None)
            if dtype != "float32":
                expected = _quant.stored_bytes(tensors)
            tok_tmp, doc["tokenizer"] = _stage_tokenizer(metadata.get("tokenizer"),
                                                         tokenizer_path(path),
                                                         doc.get("input_pipeline"))
            if format == "compressed":
                tensors = _packed.pack(tensors, packed)
            tensor_bytes, input_bytes = _write_safetensors(path, doc, tensors, taus)
            diff = None
        if tok_tmp is not None:
            os.replace(tok_tmp, tokenizer_path(path))
            tok_tmp = None
    finally:
        model.train(was_training)
        if tok_tmp is not None:
            tok_tmp.unlink(missing_ok=True)
    result = ExportResult(
        format=format, path=path, card=card_path(path),
        tokenizer=tokenizer_path(path) if doc.get("tokenizer") else None,
        file_bytes=path.stat().st_size, tensor_bytes=int(tensor_bytes),
        expected_bytes=expected, sizes=sizes, metadata=doc, onnx_max_abs_diff=diff,
        layers=infos, store_dtype=dtype, input_bytes=input_bytes)
    from comera_engine.export.card import model_card

    text = model_card(result, _sha256(path))
    write_atomic(result.card, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return result


#: What the JSON of a safetensors export holds (what ``load`` needs); the rest of the
#: metadata describes the export and goes to its model card (``card.PROVENANCE``).
_FILE_DOC_KEYS = ("format", "format_version", "dtype", "storage", "model", "tt_layers",
                  "tokenizer")
#: The ranks a family model is built at (``load`` builds at 1 and resizes to the file's).
_BUILD_RANKS = ("rank", "embedding_rank")


def _file_doc(doc: dict[str, Any], recipe: dict[str, Any], taus: dict[str, float]
              ) -> dict[str, Any]:
    """The JSON a safetensors file holds: :data:`_FILE_DOC_KEYS` of ``doc`` with the file's
    ``recipe``, leaving out what the loader assumes (dtype float32), rebuilds or does not
    use: the ranks a family model is built at (it allocates rank 1 and resizes to the
    file's ranks); a TT layer's entry is its name and ranks, and its ``tau`` where the
    rebuilt layer's (``taus``) differs; a dense file has none (no TT layers)."""
    out = {k: doc[k] for k in _FILE_DOC_KEYS if doc.get(k) is not None}
    if recipe.get("builder") == "family":
        recipe = {**recipe, "model_config": {k: v for k, v in recipe["model_config"].items()
                                             if k not in _BUILD_RANKS}}
    out["model"] = recipe
    if out.get("dtype") == "float32":
        del out["dtype"]
    if doc["format"] == FORMAT_IDS["dense"]:
        out.pop("tt_layers", None)
    else:
        out["tt_layers"] = [{"name": r["name"], "ranks": r["ranks"],
                             **({"tau": r["tau"]} if r["tau"] != taus.get(r["name"]) else {})}
                            for r in doc["tt_layers"]]
    return out


def _write_safetensors(path: Path, doc: dict[str, Any], tensors: dict[str, torch.Tensor],
                       taus: dict[str, float]) -> tuple[int, int]:
    """Write the file (the model's ``tensors``, the recipe's data spec arrays as tensors,
    the JSON of :func:`_file_doc`); returns the bytes of the model's tensors and of the
    arrays."""
    from safetensors.torch import save_file

    recipe, arrays = _packed.split_meta(doc["model"], doc["storage"]["dtype"])
    clash = next(iter(_packed.meta_names(tensors)), None)
    if clash is not None:
        raise ConfigError("model", f"holds a tensor named {clash!r}; names starting with "
                                   f"{_packed.META_PREFIX!r} are the data spec's in an export")
    text = json.dumps(_file_doc(doc, recipe, taus), separators=(",", ":"), allow_nan=False)
    out = {k: v.detach().to("cpu").contiguous() for k, v in {**tensors, **arrays}.items()}
    seen: set[int] = set()
    for k, v in out.items():  # safetensors refuses tensors sharing memory: copy repeats
        if v.numel() and v.untyped_storage().data_ptr() in seen:
            out[k] = v.clone()
        seen.add(v.untyped_storage().data_ptr())
    write_atomic(path, lambda tmp: save_file(out, str(tmp), metadata={METADATA_KEY: text}))
    return _quant.stored_bytes(tensors), _quant.stored_bytes(arrays)


def _core_sizes(model: nn.Module) -> dict[str, list[int]]:
    """Per packed ``<layer>.tt.cores`` tensor, the element count of each core."""
    return {f"{name}.tt.cores": [int(c.numel()) for c in layer.tt.effective_cores()[0]]
            for name, layer in _tt_name_set(model)}


def _storage_doc(dtype: str) -> dict[str, Any]:
    return _quant.quantize_state({}, set(), dtype)[1]


def _stored_expectation(expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
                        params: set[str], dtype: str, ncores: dict[str, int]
                        ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What a ``dtype`` file holds for the float tensors ``expected``: parameters (and
    packed cores) in that type, and for int8 their scales (per core, per row, per
    vector)."""
    if dtype == "float32":
        return expected
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, (shape, dt) in expected.items():
        if not (name in params or name in ncores) or not dt.is_floating_point:
            out[name] = (shape, dt)
            continue
        out[name] = (shape, torch.bfloat16 if dtype == "bf16" else torch.int8)
        if dtype == "int8":
            sshape = (ncores[name],) if name in ncores else (
                (shape[0],) if len(shape) >= 2 else ())
            out[name + _quant.SCALE_SUFFIX] = (sshape, torch.float32)
    return out


def _self_check(recipe: dict, fmt: str, tensors: dict[str, torch.Tensor],
                infos: list[dict]) -> dict[str, float]:
    """The recipe must rebuild a model that takes exactly these tensors (else the export
    could not be loaded): checked on the ``meta`` device before anything is written.
    Returns the rebuilt TT layers' ``tau`` (what a file need not repeat)."""
    skeleton = _spec.build(recipe, dense=fmt == "dense", device="meta")
    try:
        expected, _ = _expected_state(skeleton, fmt, infos, "metadata")
    except ConfigError as exc:
        raise ConfigError("metadata.config", f"does not describe this model ({exc})") from None
    names, shapes = set(expected), {k: tuple(v.shape) for k, v in tensors.items()}
    problems = sorted(names ^ set(shapes))
    if problems:
        raise ConfigError("metadata.config", f"does not describe this model: parameter "
                          f"{problems[0]!r} is in only one of the model and its rebuild")
    for k, (shape, _) in expected.items():
        if shapes[k] != tuple(shape):
            raise ConfigError("metadata.config", f"does not describe this model: {k!r} has "
                              f"shape {list(shapes[k])}, the rebuild {list(shape)}")
    return {name: layer.tt.tau for name, layer in _tt_name_set(skeleton)}


# ------------------------------------------------------------------------ load
def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The CoMERA metadata of an export (safetensors or ONNX) without loading its weights.

    For a safetensors export of format 3 that is the file's own JSON with the data spec's
    arrays put back (from its small ``meta:<key>`` tensors) and the input pipeline the
    recipe gives, plus what its model card (``<file>.md``, when it lies beside the file)
    records in its JSON block: run, config, data set, metrics, sizes, library, time.
    """
    p = Path(path)
    if p.suffix == ".onnx":
        from comera_engine.export.onnx_export import read_onnx_metadata

        return read_onnx_metadata(p)
    header = read_header(p)
    doc = read_comera_metadata(header)
    if not _packed_format(doc):
        return doc
    recipe, _ = _file_recipe(p, header, doc)
    doc = {**doc, "model": recipe}
    try:
        pipe = _pipeline_of(recipe)
    except ConfigError:
        pipe = None
    if pipe is not None:
        doc["input_pipeline"] = pipe
    from comera_engine.export.card import PROVENANCE, read_card_metadata

    extra = read_card_metadata(card_path(p))
    return {**{k: v for k, v in extra.items() if k in PROVENANCE}, **doc}


def _packed_format(doc: Mapping[str, Any]) -> bool:
    """Whether a file's JSON is of format 3 or later (packed weights, data spec arrays as
    tensors, provenance in the card)."""
    v = doc.get("format_version")
    return isinstance(v, int) and not isinstance(v, bool) and v >= 3


def _file_recipe(p: Path, header: Header, doc: Mapping[str, Any]
                 ) -> tuple[Any, dict[str, TensorEntry]]:
    """A format-3 file's recipe with its data spec's arrays read back from the
    ``meta:<key>`` tensors, and the header's other tensors."""
    arrays = {k: header.tensors[k] for k in _packed.meta_names(header.tensors)}
    try:
        recipe = _packed.join_meta(doc.get("model"), arrays,
                                   lambda names: _read_tensors(p, names))
    except BadExportFile:
        raise
    except ConfigError as exc:
        raise BadExportFile(p, str(exc)) from None
    return recipe, {k: e for k, e in header.tensors.items() if k not in arrays}


def _pipeline_of(recipe: Mapping[str, Any]) -> dict[str, Any] | None:
    """The input pipeline a (validated) recipe gives, as the export derived it."""
    if recipe.get("builder") != "family":
        return None
    return _pipeline.pipeline_for(recipe.get("data_spec"), recipe.get("family"))


class NonFiniteWeightsWarning(UserWarning):
    """An exported model holds NaN or infinite weights (it loads; its outputs will not be
    numbers)."""


def _warn_non_finite(path: Path, state: Mapping[str, torch.Tensor]) -> None:
    bad = [k for k, t in state.items()
           if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())]
    if bad:
        warnings.warn(f"{path.name}: {len(bad)} tensor(s) hold NaN or infinite values "
                      f"(first: {bad[0]}); the model's outputs will not be numbers",
                      NonFiniteWeightsWarning, stacklevel=3)


def load(path: str | os.PathLike[str], map_location: str | torch.device = "cpu") -> nn.Module:
    """Rebuild an exported model (compressed or dense) without pickle, in eval mode.

    Everything is checked before the weights are read: the safetensors header, the JSON
    metadata, the recipe, and every tensor's name, shape and dtype against the rebuilt
    model (a format-3 file's data spec arrays, the recipe's part, are read first: at most
    64 vectors of 4,096 values). Bad, truncated or hostile files raise :class:`BadExportFile` (a
    ``ConfigError``/``ValueError``) naming the file.
    """
    p = Path(path)
    if p.suffix == ".onnx":
        raise BadExportFile(p, "ONNX exports run with onnxruntime "
                               "(onnxruntime.InferenceSession); load the .safetensors export")
    header = read_header(p)
    doc = read_comera_metadata(header)
    fmt = doc.get("format")
    if fmt not in (FORMAT_IDS["compressed"], FORMAT_IDS["dense"]):
        from comera_engine.export.weights import WEIGHTS_FORMAT

        if fmt == WEIGHTS_FORMAT:  # the weights of a model of one's own: its class rebuilds it
            raise BadExportFile(p, "a comera_engine.save file holds the weights of your "
                                   "model, not how to build it: load it with "
                                   "comera_engine.load_into(YourModel(), path)")
        raise BadExportFile(p, f"metadata.format: unknown export format {fmt!r}")
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT_VERSION:
        raise BadExportFile(p, f"metadata.format_version: {version!r} is not supported by this "
                               f"version of comera (reads <= {FORMAT_VERSION})")
    storage = doc.get("storage", {"dtype": "float32"})
    stored = storage.get("dtype") if isinstance(storage, Mapping) else None
    if stored not in _quant.STORE_DTYPES:
        raise BadExportFile(p, f"metadata.storage.dtype: unsupported stored type {stored!r} "
                               f"(reads {', '.join(_quant.STORE_DTYPES)})")
    kind = "dense" if fmt == FORMAT_IDS["dense"] else "compressed"
    dtype_name = doc.get("dtype", "float32")
    if dtype_name not in _DTYPE_NAMES:
        raise BadExportFile(p, f"metadata.dtype: unsupported dtype {dtype_name!r}")
    dtype = _DTYPE_NAMES[dtype_name]
    packed_file = _packed_format(doc)
    recipe, have = _file_recipe(p, header, doc) if packed_file else (doc.get("model"),
                                                                     header.tensors)
    try:
        recipe = _spec.validate_recipe(recipe)
        pipe = _pipeline_of(recipe) if packed_file else doc.get("input_pipeline")
        if pipe is not None:
            pipe = _pipeline.validate_pipeline(pipe, data_spec=recipe.get("data_spec"))
        if recipe["builder"] == "family":
            # TT layers are resized to the file's ranks below: allocate them at rank 1, so
            # that what the build allocates is bounded by the file's own tensors.
            low = dict.fromkeys(_BUILD_RANKS, 1)
            if recipe["family"] == "tt_mlp":  # the TT MLP has no embedding rank
                del low["embedding_rank"]
            recipe = {**recipe, "model_config": {**recipe["model_config"], **low}}
        skeleton = _spec.build(recipe, dense=kind == "dense", device="meta")
        _cast_floating(skeleton, dtype)
        expected, ranks_of = _expected_state(skeleton, kind, doc.get("tt_layers"), "metadata")
    except ConfigError as exc:
        raise BadExportFile(p, str(exc)) from None
    ncores = {f"{n}.tt.cores": len(sh) for n, (_, sh, _) in ranks_of.items()}
    params = {k for k, _ in skeleton.named_parameters(remove_duplicate=False)} | set(ncores)
    per_name = _stored_expectation(expected, params, stored, ncores)
    packed = _packed.packed_names(expected, params) if (
        packed_file and kind == "compressed") else []
    in_file = _packed.packed_expectation(per_name, packed)
    _check_tensors(p, have, in_file)
    # Everything agrees: build for real (sizes are now bounded by the file's tensors).
    try:
        model = _spec.build(recipe, dense=kind == "dense")
    except ConfigError as exc:
        raise BadExportFile(p, str(exc)) from None
    _cast_floating(model, dtype)
    read = _packed.unpack(_read_tensors(p, list(in_file)), per_name, packed)
    sizes = {f"{n}.tt.cores": [math.prod(s) for s in sh] for n, (_, sh, _) in ranks_of.items()}
    state = _quant.dequantize_state(read, stored, sizes,
                                    {k: v[1] for k, v in expected.items()})
    _warn_non_finite(p, state)
    layers = dict(_tt_name_set(model))
    for name, (ranks, shapes, tau) in ranks_of.items():
        tt = layers[name].tt
        tt.tau = tau
        flat = state.pop(f"{name}.tt.cores")
        if 0 in ranks:
            # The zero map. Physically rank-0 cores cannot run through the contraction,
            # so it comes back as rank-1 bonds whose gates are pruned (effective rank 0).
            ones = [1] * len(ranks)
            tt.resize_(ones)
            for k, shape in enumerate(tt.mode_shapes):
                state[f"{name}.tt.cores.{k}"] = torch.zeros(1, *shape, 1, dtype=dtype)
            state[f"{name}.tt.gate"] = torch.zeros(len(ranks), dtype=dtype)
            state[f"{name}.tt.alive"] = torch.zeros(len(ranks), dtype=torch.bool)
            continue
        tt.resize_(ranks)
        pos = 0
        for k, shape in enumerate(shapes):
            n = math.prod(shape)
            state[f"{name}.tt.cores.{k}"] = flat[pos: pos + n].reshape(shape)
            pos += n
        state[f"{name}.tt.gate"] = torch.ones(sum(ranks), dtype=dtype)
        state[f"{name}.tt.alive"] = torch.ones(sum(ranks), dtype=torch.bool)
    try:
        model.load_state_dict(with_aliases(model, state), strict=True)
    except RuntimeError as exc:  # pragma: no cover - shapes were checked above
        raise BadExportFile(p, f"tensors do not fit the rebuilt model: "
                               f"{str(exc).splitlines()[0]}") from None
    model.to(map_location)
    model.eval()
    return _pipeline.wrap(model, pipe)


def _cast_floating(model: nn.Module, dtype: torch.dtype) -> None:
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point() and t.dtype != dtype:
            t.data = t.data.to(dtype)


def _read_tensors(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    try:
        out = {}
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                out[name] = f.get_tensor(name)
        return out
    except Exception as exc:  # safetensors raises its own error types
        raise BadExportFile(path, f"cannot read tensors ({type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
