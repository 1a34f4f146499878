"""ONNX export: TT layers as their contractions, never as a reconstructed dense matrix.

Each ``TTLinear`` / ``TTEmbedding`` of a copy of the model is swapped for an export
module that holds the *effective* cores (truncated, gates absorbed) as its only
parameters and computes with ONNX-friendly ops:

* linear: ``L = G_1⋯G_d`` and ``R = G_{d+1}⋯G_{2d}`` merged in the graph from the cores
  (small MatMul/Reshape), then ``y = (x·L)·R`` (+ bias): the two-half path.
* embedding: the two TTM half-tables ``A`` and ``Bt`` merged in the graph, each id split
  into ``(a, b) = divmod(id, V_b)``, two Gathers and one batched MatMul. (The tied MLM
  decoder asks for the whole table, which is then multiplied out from the cores at run
  time, exactly as in PyTorch.)

Constant folding is off, so the file's initializers are the cores themselves: the test
suite checks that no initializer has a dense weight's size. The graph is traced with the
TorchScript exporter (``dynamo=False``), which needs no extra package; when onnxruntime
is installed the export is run and compared with PyTorch before the file is written.
"""

from __future__ import annotations

import copy
import inspect
import io
import json
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from comera_engine.errors import ConfigError
from comera_engine.export.container import METADATA_KEY, BadExportFile, write_atomic
from comera_engine.export.pipeline import RawInputs, raw_example
from comera_engine.export.quant import max_rel_diff, store_module
from comera_engine.layers import TTEmbedding, TTEmbeddingBag, TTLinear, tt_layers
from comera_engine.layers.tied import TiedDecoder
from comera_engine.layers.tree import set_module
from comera_engine.tensor.contract import merge_left, merge_right
from comera_engine.tensor.lookup import merge_tables, split_point
from comera_engine.tensor.tt import ttm_matrix

__all__ = ["OnnxTTEmbedding", "OnnxTTEmbeddingBag", "OnnxTTLinear", "export_onnx",
           "onnx_export_copy", "read_onnx_metadata"]

OPSET = 17


def _params(cores: list[torch.Tensor]) -> nn.ParameterList:
    return nn.ParameterList(nn.Parameter(c.detach().clone(), requires_grad=False)
                            for c in cores)


class OnnxTTLinear(nn.Module):
    """Export form of a :class:`TTLinear`: the two-half contraction on the cores (layout
    ``"tt"``), or ``W`` multiplied out from the TT-matrix cores then one matmul
    (``"ttm"``)."""

    def __init__(self, layer: TTLinear) -> None:
        super().__init__()
        cores, ranks = layer.tt.effective_cores()
        self.d = layer.tt.d
        self.layout = layer.layout
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.N, self.M = layer.tt.shape
        self.zero = 0 in ranks
        self.cores = _params([] if self.zero else cores)
        self.bias = (nn.Parameter(layer.bias.detach().clone(), requires_grad=False)
                     if layer.bias is not None else None)

    @property
    def weight(self) -> torch.Tensor:
        """``W`` ``(out_features, in_features)`` multiplied out from the cores in the graph
        (the file still holds only the cores), for a module that reads its linear's
        weight instead of calling it: torch's attention reads its projections'."""
        if self.zero:
            return torch.zeros(self.out_features, self.in_features)
        cores = list(self.cores)
        W = (ttm_matrix(cores) if self.layout == "ttm"
             else merge_left(cores[: self.d])[-1] @ merge_right(cores[self.d:])[0])
        return W[: self.in_features, : self.out_features].t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero:
            y = torch.zeros_like(x[..., :1]).expand(*x.shape[:-1], self.out_features)
        else:
            if self.N != self.in_features:
                x = F.pad(x, (0, self.N - self.in_features))
            cores = list(self.cores)
            if self.layout == "ttm":
                y = torch.matmul(x, ttm_matrix(cores))  # W (N, M) from the cores
            else:
                left = merge_left(cores[: self.d])[-1]  # (N, r_d)
                right = merge_right(cores[self.d:])[0]  # (r_d, M)
                y = torch.matmul(torch.matmul(x, left), right)
            if self.M != self.out_features:
                y = y[..., : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y


class OnnxTTEmbedding(nn.Module):
    """Export form of a :class:`TTEmbedding`: gathers from the two merged half-tables."""

    def __init__(self, layer: TTEmbedding) -> None:
        super().__init__()
        cores, ranks = layer.tt.effective_cores()
        rows, cols = list(layer.vocab_factors), list(layer.dim_factors)
        self.num_embeddings, self.embedding_dim = layer.num_embeddings, layer.embedding_dim
        self.padding_idx = layer.padding_idx
        self.zero = 0 in ranks
        self.h = split_point(rows, cols, [1, *ranks, 1]) if not self.zero else 1
        self.Va, self.Vb = math.prod(rows[: self.h]), math.prod(rows[self.h:])
        self.cores = _params([] if self.zero else cores)

    def _mask(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.padding_idx is None:
            return out
        return out * (ids != self.padding_idx).unsqueeze(-1).to(out.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.zero:
            return torch.zeros_like(ids.unsqueeze(-1), dtype=torch.float32).expand(
                *ids.shape, self.embedding_dim)
        A, Bt = merge_tables(list(self.cores), self.h)  # (Va, Ea, r), (Vb, r, Eb)
        a = torch.div(ids, self.Vb, rounding_mode="floor")
        b = ids - a * self.Vb
        out = torch.matmul(A[a], Bt[b]).flatten(-2)  # (*ids, Ea*Eb)
        if out.shape[-1] != self.embedding_dim:
            out = out[..., : self.embedding_dim]
        return self._mask(ids, out)

    def decode(self, h: torch.Tensor) -> torch.Tensor:
        """``h · Eᵀ`` (the tied MLM decoder) in plain ONNX ops: the table, then a matmul."""
        return h @ self.dense_weight().to(h.dtype).t()

    def dense_weight(self) -> torch.Tensor:
        """The whole table, multiplied out from the cores."""
        if self.zero:
            return torch.zeros(self.num_embeddings, self.embedding_dim)
        A, Bt = merge_tables(list(self.cores), self.h)
        W = torch.matmul(A.unsqueeze(1), Bt.unsqueeze(0))  # (Va, Vb, Ea, Eb)
        W = W.reshape(self.Va * self.Vb, -1)[: self.num_embeddings, : self.embedding_dim]
        if self.padding_idx is not None:
            keep = torch.ones(self.num_embeddings, 1, dtype=W.dtype)
            keep[self.padding_idx] = 0
            W = W * keep
        return W


class OnnxTTEmbeddingBag(OnnxTTEmbedding):
    """Export form of a :class:`TTEmbeddingBag`: the entries' rows as
    :class:`OnnxTTEmbedding` gathers them, reduced per bag in plain ONNX ops (torch's
    exporter has no ``embedding_bag`` with a padding row). A 2-D input (equal bags)
    reduces along its rows; flat ids with ``offsets`` through a bag-membership matrix
    ``(B, N)``: a matmul for ``sum`` / ``mean``, a masked maximum for ``max``."""

    def __init__(self, layer: TTEmbeddingBag) -> None:
        super().__init__(layer)
        self.mode, self.include_last_offset = layer.mode, layer.include_last_offset

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,  # noqa: A002
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        rows = super().forward(input)  # (*input, D), padding rows zero
        keep = (torch.ones_like(input, dtype=torch.bool) if self.padding_idx is None
                else input != self.padding_idx)
        if offsets is None:  # (B, L): bag b holds row b's entries
            member = keep
        else:  # flat ids: entry i belongs to the last bag starting at or before it
            starts = offsets[:-1] if self.include_last_offset else offsets
            pos = torch.arange(input.shape[0], device=input.device)
            bag = (starts.unsqueeze(0) <= pos.unsqueeze(1)).sum(1) - 1  # (N,)
            if self.include_last_offset:
                keep = keep & (pos < offsets[-1])
            bags = torch.arange(starts.shape[0], device=input.device)
            member = (bag.unsqueeze(0) == bags.unsqueeze(1)) & keep.unsqueeze(0)  # (B, N)
            rows = rows.unsqueeze(0)  # (1, N, D)
        if self.mode == "max":
            out = torch.where(member.unsqueeze(-1), rows, float("-inf")).amax(-2)
            return torch.where(member.any(-1, keepdim=True), out, 0.0)  # an empty bag: 0
        weight = member.to(rows.dtype)
        if per_sample_weights is not None:
            weight = weight * per_sample_weights.to(rows.dtype)
        out = torch.matmul(weight.unsqueeze(-2), rows).squeeze(-2)  # (B, D)
        if self.mode == "mean":
            out = out / member.sum(-1, keepdim=True).clamp(min=1).to(rows.dtype)
        return out


def onnx_export_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (eval mode) with every TT layer in its export form (one per
    layer, put at every place that holds it: T5's shared table)."""
    clone = copy.deepcopy(model).eval()
    swapped: dict[int, nn.Module] = {}
    for name, layer in tt_layers(clone):
        new = (OnnxTTLinear(layer) if isinstance(layer, TTLinear) else OnnxTTEmbeddingBag(layer)
               if isinstance(layer, TTEmbeddingBag) else OnnxTTEmbedding(layer))
        set_module(clone, name, new)  # at every place that holds the layer
        swapped[id(layer)] = new
    for module in clone.modules():  # a tied head decodes through the table's export form
        if isinstance(module, TiedDecoder):
            object.__setattr__(module, "embedding", swapped[id(module.embedding)])
    for p in clone.parameters():
        p.requires_grad_(False)
    return clone


def _dense_sizes(model: nn.Module) -> dict[str, int]:
    out = {}
    for name, layer in tt_layers(model):
        if isinstance(layer, TTLinear):
            out[name] = layer.in_features * layer.out_features
        else:
            out[name] = layer.num_embeddings * layer.embedding_dim
    return out


def _trace(module: nn.Module, args: tuple, names: list[str], outputs: list[str],
           axes: dict[str, dict[int, str]]) -> bytes:
    buf = io.BytesIO()
    kwargs: dict[str, Any] = dict(
        input_names=names, output_names=outputs, dynamic_axes=axes, opset_version=OPSET,
        do_constant_folding=False, export_params=True)
    if "dynamo" in inspect.signature(torch.onnx.export).parameters:
        kwargs["dynamo"] = False
    fast = torch.backends.mha.get_fastpath_enabled()
    # torch's attention and encoder layers take fused inference kernels under no_grad,
    # which ONNX has no operator for; traced without them they are plain ops
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.no_grad():
                torch.onnx.export(module, args, buf, **kwargs)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
    return buf.getvalue()


def _variants(names: list[str], args: tuple, recipe: Mapping[str, Any]) -> list[tuple]:
    """The traced example plus one with another batch size (and sequence length)."""
    out = [args]
    if recipe.get("builder") == "family" and recipe.get("family", "").startswith("transformer"):
        L = args[0].shape[1]
        short = max(2, L // 2)
        out.append(tuple(torch.cat([a, a[:1]], 0)[:, :short].contiguous() for a in args))
    else:
        out.append(tuple(torch.cat([a, a[:1]], 0) for a in args))
    return out


def _run_onnxruntime(data: bytes, names: list[str], variants: list[tuple],
                     model: nn.Module) -> float | None:
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    sess = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
    worst = 0.0
    for args in variants:
        with torch.no_grad():
            ref = model(*args)
        got = sess.run(None, {n: a.cpu().numpy() for n, a in zip(names, args)})[0]
        got_t = torch.from_numpy(got)
        if tuple(got_t.shape) != tuple(ref.shape):
            raise ConfigError("format", f"onnx export gives shape {list(got_t.shape)} for "
                              f"inputs where PyTorch gives {list(ref.shape)}")
        worst = max(worst, float((got_t.double() - ref.double()).abs().max()))
    return worst


def export_onnx(
    model: nn.Module,
    path: Path,
    recipe: Mapping[str, Any],
    doc: dict[str, Any],
    example_inputs: tuple[torch.Tensor, ...] | None,
    verify: bool,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Trace, check, verify and write the ONNX file; returns its summary for metadata.

    ``dtype`` ``bf16`` / ``int8``: the initializers are the stored weights (and scales,
    :mod:`comera_engine.export.quant`), dequantized in the graph; onnxruntime is then
    checked against PyTorch computing with the same stored weights, and the summary's
    ``max_rel_diff_vs_float32`` says how far both are from the float32 model."""
    try:
        import onnx
    except ImportError:
        raise ConfigError("format", "onnx export needs the onnx package (pip install onnx "
                          "onnxruntime)") from None
    from comera_engine.export.spec import example_inputs as default_inputs

    if any(t.device.type != "cpu" for t in model.parameters()):
        model = copy.deepcopy(model).cpu()  # traced and checked on the CPU
    names, args, outputs, axes = default_inputs(recipe, model)
    pipe = doc.get("input_pipeline")
    module = onnx_export_copy(model)
    fp32_model = model
    if dtype != "float32":
        store_module(module, dtype)
        model = module  # onnxruntime is checked against the same stored weights
    if pipe is not None and pipe.get("kind") != "tokens":  # the graph takes raw inputs
        args = raw_example(pipe, args)
        model, module = RawInputs(model, pipe).eval(), RawInputs(module, pipe).eval()
        fp32_model = RawInputs(fp32_model, pipe).eval() if dtype != "float32" else model
    if example_inputs is not None:
        args = tuple(a.cpu() for a in example_inputs)
        if len(args) != len(names):
            names = [f"input_{i}" for i in range(len(args))]
            axes = {n: {0: "batch"} for n in names} | {outputs[0]: {0: "batch"}}
    try:
        data = _trace(module, args, names, outputs, axes)
    except Exception as exc:
        raise ConfigError("format", f"onnx export failed ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    proto = onnx.load_from_string(data)
    inits = [(i.name, math.prod(i.dims), onnx.helper.tensor_dtype_to_np_dtype(i.data_type))
             for i in proto.graph.initializer]
    init_bytes = sum(n * dt.itemsize for _, n, dt in inits)
    dense = _dense_sizes(model)
    for init_name, n, _ in inits:
        for layer, size in dense.items():
            if n >= size and init_name.startswith(layer + "."):
                raise ConfigError("format", f"onnx export of TT layer {layer!r} holds a "
                                  f"dense-sized initializer {init_name!r}")
    diff = None
    vs_fp32 = None
    if dtype != "float32":
        with torch.no_grad():
            vs_fp32 = max_rel_diff(module(*args), fp32_model(*args))
    if verify:
        variants = _variants(names, args, recipe) if example_inputs is None else [args]
        diff = _run_onnxruntime(data, names, variants, model)
        if diff is not None:
            with torch.no_grad():
                scale = max(1.0, float(model(*args).abs().max()))
            if not diff <= 1e-3 * scale:
                raise ConfigError("format", f"onnx export does not reproduce the PyTorch "
                                  f"outputs (max abs difference {diff:.3g})")
    summary = {
        "opset": OPSET, "inputs": names, "outputs": outputs,
        "input_shapes": {n: list(a.shape) for n, a in zip(names, args)},
        "input_dtypes": {n: str(a.dtype).replace("torch.", "") for n, a in zip(names, args)},
        "dynamic_axes": {k: {str(i): v for i, v in d.items()} for k, d in axes.items()},
        "initializers": len(inits), "initializer_bytes": int(init_bytes),
        "largest_initializer": max((n for _, n, _ in inits), default=0),
        "max_abs_diff": diff,
    }
    if vs_fp32 is not None:
        summary["max_rel_diff_vs_float32"] = vs_fp32
    doc = dict(doc)
    doc["onnx"] = summary
    entry = proto.metadata_props.add()
    entry.key, entry.value = METADATA_KEY, json.dumps(doc, separators=(",", ":"),
                                                      allow_nan=False)
    proto.producer_name = "comera-studio"
    onnx.checker.check_model(proto)
    payload = proto.SerializeToString()
    write_atomic(path, lambda tmp: tmp.write_bytes(payload))
    return summary


def read_onnx_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The CoMERA metadata stored in an exported ONNX file."""
    import onnx

    p = Path(path)
    try:
        proto = onnx.load(str(p), load_external_data=False)
    except Exception as exc:
        raise BadExportFile(p, f"not a readable ONNX file ({type(exc).__name__})") from None
    for prop in proto.metadata_props:
        if prop.key == METADATA_KEY:
            try:
                doc = json.loads(prop.value)
            except ValueError:
                raise BadExportFile(p, "metadata 'comera' is not valid JSON") from None
            if not isinstance(doc, dict):
                raise BadExportFile(p, "metadata 'comera' must be a JSON object")
            return doc
    raise BadExportFile(p, "not a CoMERA export: no 'comera' metadata")
