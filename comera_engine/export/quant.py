"""Exports whose weights are stored in fewer bits (``comera export --dtype bf16|int8``).

One rule decides how every parameter is stored, in the safetensors file and in the ONNX
graph alike, so that ``load`` and onnxruntime compute with the same numbers:

* ``float32``: as trained (the default; no scales).
* ``bf16``: every floating parameter rounded to bfloat16 (no scales).
* ``int8``: symmetric int8, ``w ≈ q · s`` with ``q`` in ``[-127, 127]`` and
  ``s = max|w| / 127``, taken

  - per TT core (one scale per core: a layer's packed ``<layer>.tt.cores`` gets
    ``<layer>.tt.cores.scale``, one float per core),
  - per row (dim 0) for any other parameter of two or more dimensions (a linear's
    output channels, an embedding's rows): ``<name>.scale`` of shape ``(rows,)``,
  - per tensor for a 1-D parameter (biases, norms): ``<name>.scale`` of shape ``()``.

A compressed export concatenates the stored parameters into one tensor and their scales
into another (:mod:`comera_engine.export.packed`). Buffers stay as they are; the input
pipeline's statistics are float16 where that holds them to 0.1 %. Loading dequantizes to
float32 (the model computes in float32); the ONNX graph holds the int8 / bf16
initializers and dequantizes them in the graph (Cast, Mul). A parameter that is not
finite has no int8 scale: :class:`~comera_engine.errors.ConfigError` on ``--dtype``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from comera_engine.errors import ConfigError
from comera_engine.layers.attention import weight_readers
from comera_engine.layers.tied import TiedDecoder
from comera_engine.tensor.quant import int8_round_trip, int8_scale, to_int8

__all__ = ["INT8_SCALES", "SCALE_SUFFIX", "STORE_DTYPES", "dequantize_state", "max_rel_diff",
           "parse_store_dtype", "quantize_state", "round_trip", "store_module", "stored_bytes"]

#: ``--dtype`` choices (the stored type of the weights).
STORE_DTYPES = ("float32", "bf16", "int8")
_ALIASES = {"fp32": "float32", "float32": "float32", "f32": "float32", "bf16": "bf16",
            "bfloat16": "bf16", "int8": "int8"}
#: Name suffix of an int8 tensor's scales.
SCALE_SUFFIX = ".scale"
#: How an int8 export's scales are taken (the model card says it).
INT8_SCALES = "float32 scales per TT core, per row of a matrix, per vector"


def parse_store_dtype(value: str | None) -> str:
    """``"float32"``, ``"bf16"`` or ``"int8"`` from ``--dtype`` (``None``: float32).

    Raises:
        ConfigError: any other value (``--dtype``).
    """
    if value is None:
        return "float32"
    key = str(value).strip().lower()
    if key not in _ALIASES:
        raise ConfigError("--dtype", f"{value!r} is not a stored weight type; choose "
                                     f"{', '.join(STORE_DTYPES)}")
    return _ALIASES[key]


_scale = int8_scale
_int8 = to_int8


def _check_finite(name: str, w: torch.Tensor, dtype: str) -> None:
    if dtype == "int8" and not bool(torch.isfinite(w).all()):
        raise ConfigError("--dtype", f"layer weight {name!r} holds NaN or infinite values, "
                                     "which int8 cannot store; export this run with "
                                     "--dtype float32 (or bf16)")


def quantize_state(tensors: Mapping[str, torch.Tensor], params: set[str], dtype: str,
                   cores: Mapping[str, Sequence[int]] | None = None
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors a ``dtype`` export stores, and its ``storage`` metadata.

    ``params``: the names in ``tensors`` that are parameters (stored in ``dtype``; the
    rest are buffers, stored as they are). ``cores``: packed TT cores, name -> the
    element count of each core in order (one int8 scale per core).
    """
    cores = dict(cores or {})
    if dtype == "float32":
        return dict(tensors), {"dtype": "float32"}
    out: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if (name not in params and name not in cores) or not w.is_floating_point():
            out[name] = w
            continue
        _check_finite(name, w, dtype)
        if dtype == "bf16":
            out[name] = w.detach().to(torch.bfloat16)
            continue
        if name in cores:
            sizes = list(cores[name])
            parts = torch.split(w.detach().reshape(-1), sizes) if sizes else []
            scales = torch.stack([_scale(p, False) for p in parts]) if sizes else \
                torch.zeros(0)
            q = (torch.cat([_int8(p, s) for p, s in zip(parts, scales)]) if sizes
                 else torch.zeros(0, dtype=torch.int8))
            out[name], out[name + SCALE_SUFFIX] = q, scales.float()
            continue
        scale = _scale(w, per_row=w.dim() >= 2)
        out[name], out[name + SCALE_SUFFIX] = _int8(w, scale), scale.float()
    return out, {"dtype": dtype}


def dequantize_state(stored: Mapping[str, torch.Tensor], dtype: str,
                     cores: Mapping[str, Sequence[int]] | None = None,
                     like: Mapping[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """The float tensors back from what :func:`quantize_state` stored (``like``: the
    float dtype each name is rebuilt in; default float32)."""
    cores = dict(cores or {})
    like = dict(like or {})
    out: dict[str, torch.Tensor] = {}
    for name, t in stored.items():
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in stored and dtype == "int8":
            continue
        target = like.get(name, torch.float32)
        if dtype == "bf16" and t.dtype == torch.bfloat16:
            out[name] = t.to(target)
        elif dtype == "int8" and t.dtype == torch.int8 and name + SCALE_SUFFIX in stored:
            s = stored[name + SCALE_SUFFIX].float()
            if name in cores:
                sizes = list(cores[name])
                rep = torch.repeat_interleave(s, torch.tensor(sizes, dtype=torch.long)) \
                    if sizes else s
                out[name] = (t.float() * rep).to(target)
            else:
                shape = (-1, *([1] * (t.dim() - 1))) if s.dim() else ()
                out[name] = (t.float() * (s.reshape(shape) if shape else s)).to(target)
        else:
            out[name] = t
    return out


def round_trip(w: torch.Tensor, dtype: str, core: bool = False) -> torch.Tensor:
    """``w`` as the ``dtype`` export gives it back (float32): what ``load`` computes
    with. ``core``: a single TT core (one scale)."""
    if dtype == "float32" or not w.is_floating_point():
        return w
    if dtype == "bf16":
        return w.detach().to(torch.bfloat16).float()
    return int8_round_trip(w, per_row=not core and w.dim() >= 2)


class _Stored(nn.Module):
    """Holds one module's stored weights as buffers and rebuilds the float weights
    before each forward (traced into the ONNX graph as Cast and Mul)."""

    def __init__(self, names: list[str], lists: dict[str, int], dtype: str) -> None:
        super().__init__()
        self.names, self.lists, self.dtype = names, lists, dtype

    def weight(self, key: str) -> torch.Tensor:
        q = getattr(self, f"{key}_q")
        if self.dtype == "bf16":
            return q.to(torch.float32)
        s = getattr(self, f"{key}_scale")
        return q.to(torch.float32) * (s.reshape(-1, *([1] * (q.dim() - 1))) if s.dim() else s)

    def __call__(self, module: nn.Module, args: Any) -> None:  # forward pre-hook
        for n in self.names:
            object.__setattr__(module, n, self.weight(n))
        for n, count in self.lists.items():
            object.__setattr__(module, n, [self.weight(f"{n}_{k}") for k in range(count)])


def _store(holder: _Stored, key: str, w: torch.Tensor, dtype: str, core: bool) -> None:
    _check_finite(key, w, dtype)
    if dtype == "bf16":
        holder.register_buffer(f"{key}_q", w.detach().to(torch.bfloat16))
        return
    scale = _scale(w, per_row=not core and w.dim() >= 2)
    holder.register_buffer(f"{key}_q", _int8(w, scale))
    holder.register_buffer(f"{key}_scale", scale.float())


@torch.no_grad()
def store_module(module: nn.Module, dtype: str, core_lists: str = "cores") -> nn.Module:
    """``module`` (an export copy, changed in place) with every floating parameter held
    as its stored ``dtype`` form and rebuilt in float32 before each forward (for the ONNX
    trace). A ``nn.ParameterList`` attribute named ``core_lists`` holds TT cores: one
    scale per core."""
    if dtype == "float32":
        return module
    # torch's attention reads its projections' weights without calling them: their
    # weights are rebuilt before the attention's forward too
    readers = weight_readers(module)
    readers.update({id(m.embedding): m for m in module.modules()  # a tied head's table
                    if isinstance(m, TiedDecoder)})
    for owner in list(module.modules()):
        if isinstance(owner, (_Stored, nn.ParameterList)):
            continue
        names = [n for n, p in owner.named_parameters(recurse=False) if p.is_floating_point()]
        lists = {n: len(c) for n, c in owner.named_children()
                 if n == core_lists and isinstance(c, nn.ParameterList)}
        if not names and not lists:
            continue
        holder = _Stored(names, lists, dtype)
        for n in names:
            w = getattr(owner, n)
            _store(holder, n, w, dtype, core=False)
            delattr(owner, n)
        for n, count in lists.items():
            cores = list(getattr(owner, n))
            for k in range(count):
                _store(holder, f"{n}_{k}", cores[k], dtype, core=True)
            delattr(owner, n)
        owner.add_module("stored_weights", holder)
        owner.register_forward_pre_hook(holder)
        if id(owner) in readers:
            readers[id(owner)].register_forward_pre_hook(
                lambda _reader, args, holder=holder, owner=owner: holder(owner, args))
        holder(owner, ())  # the attributes exist before the first call, too
    return module


def stored_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of tensor data in ``tensors`` (scales included)."""
    return int(sum(t.numel() * t.element_size() for t in tensors.values()))


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max(1, max|b|)``: the tolerance measure the export states."""
    scale = max(1.0, float(b.detach().abs().max())) if b.numel() else 1.0
    d = float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0
    return d / scale if math.isfinite(d) else math.inf
