"""``comera_engine.save`` and ``comera_engine.load_into``: the weights of *your* model with
its TT layers, as small as their ranks, for a model class you own.

``save(model, path)`` writes one safetensors file (no pickle):

- every TT layer's cores sliced to the effective ranks with the rank gates absorbed
  (``G_k · diag(g_k)``, dead entries cut out) under the layer's own ``state_dict``
  names (``<layer>.tt.cores.<k>``); gates and ``alive`` masks are not stored (after the
  absorption they are all 1);
- every other parameter and persistent buffer under its ``state_dict`` name;
- under the metadata key ``comera`` a JSON document: the format and, per TT layer, what
  rebuilds it (kind, shape, factors, layout, bias, padding index, ranks, ``tau``).

``load_into(model, path)`` takes a *fresh* instance of the saved class (its layers still
``nn.Linear`` / ``nn.Embedding``, as the constructor makes them), replaces the listed
layers by TT layers at the saved ranks and loads every tensor: the outputs equal the
saved model's. Names and shapes are checked against the header before anything is read
or replaced, so a mismatch leaves the model as it was.

``comera export`` (:mod:`comera_engine.export.core`) is the other format: a whole model
of the built-in families rebuilt from the file alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from comera_engine.errors import ConfigError
from comera_engine.export.container import (
    METADATA_KEY,
    BadExportFile,
    read_comera_metadata,
    read_header,
    write_atomic,
)
from comera_engine.layers import (
    SplitAttention,
    TTEmbedding,
    TTEmbeddingBag,
    TTLinear,
    candidate_layers,
    peer_layers,
    tt_layers,
)
from comera_engine.layers.attention import set_layer
from comera_engine.layers.tied import tie_heads, tied_heads
from comera_engine.layers.tree import unique_state_dict

__all__ = ["WEIGHTS_FORMAT", "load_into", "save"]

#: ``format`` of the ``comera`` metadata document of a :func:`save` file.
WEIGHTS_FORMAT = "comera-weights/1"


def _describe(name: str, layer: nn.Module, ranks: list[int]) -> dict[str, Any]:
    """What rebuilds ``layer`` at ``ranks`` (JSON)."""
    common = {"name": name, "ranks": ranks, "tau": float(layer.tt.tau),
              "dtype": str(layer.tt.cores[0].dtype).removeprefix("torch.")}
    if isinstance(layer, TTLinear):
        return {**common, "kind": "linear", "in_features": layer.in_features,
                "out_features": layer.out_features, "in_factors": list(layer.in_factors),
                "out_factors": list(layer.out_factors), "bias": layer.bias is not None,
                "layout": layer.layout, "path": layer.path}
    return {**common, "kind": "embedding", "num_embeddings": layer.num_embeddings,
            "embedding_dim": layer.embedding_dim, "vocab_factors": list(layer.vocab_factors),
            "dim_factors": list(layer.dim_factors), "padding_idx": layer.padding_idx,
            **({"bag": layer.options_of(layer)} if isinstance(layer, TTEmbeddingBag) else {})}


def save(model: nn.Module, path: str | os.PathLike[str]) -> Path:
    """Write ``model``'s weights with its TT layers at their effective ranks (module
    doc). The file appears whole or not at all. Returns its path.

    Raises:
        ConfigError: the model holds tltorch peer layers (save those with their own
            library).
    """
    if peer_layers(model):
        raise ConfigError("model", "holds tensorly-torch layers, which comera_engine.save "
                                   "does not rebuild; save its state_dict with safetensors")
    from safetensors.torch import save_file

    state = unique_state_dict(model)  # a module held at several places, once
    layers = []
    for name, layer in tt_layers(model):
        prefix = f"{name}." if name else ""
        cores, ranks = layer.tt.effective_cores()
        for key in [k for k in state if k.startswith(f"{prefix}tt.")]:
            del state[key]
        for k, core in enumerate(cores):
            state[f"{prefix}tt.cores.{k}"] = core
        layers.append(_describe(name, layer, ranks))
    # clones: tied weights share storage, which safetensors refuses; load_state_dict
    # fills both from their copies
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    from comera_engine._version import __version__

    doc = {"format": WEIGHTS_FORMAT, "layers": layers, "library": __version__}
    target = Path(path)
    write_atomic(target, lambda tmp: save_file(tensors, str(tmp),
                                               metadata={METADATA_KEY: json.dumps(doc)}))
    return target


def _build(path: Path, entry: Any, like: nn.Module) -> nn.Module:
    """The TT layer ``entry`` describes (fresh values), on ``like``'s device."""
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise BadExportFile(path, "a TT layer entry of the metadata is not an object with "
                                  "a name")
    name = entry["name"]
    weight = next(like.parameters(), None)
    device = weight.device if isinstance(weight, torch.Tensor) else None
    try:
        ranks = [int(r) for r in entry["ranks"]]
        dtype = getattr(torch, str(entry.get("dtype", "float32")))
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype {entry.get('dtype')!r}")
        alloc = [max(1, r) for r in ranks]
        if entry.get("kind") == "linear":
            fits = isinstance(like, (nn.Linear, TTLinear)) and (
                like.in_features, like.out_features) == (entry["in_features"],
                                                         entry["out_features"])
            shape = f"Linear({entry['in_features']}, {entry['out_features']})"
            new: nn.Module = TTLinear(
                int(entry["in_features"]), int(entry["out_features"]), rank=alloc,
                in_factors=entry["in_factors"], out_factors=entry["out_factors"],
                bias=bool(entry["bias"]), tau=float(entry["tau"]), path=entry.get("path"),
                dtype=dtype, device=device, layout=str(entry["layout"]))
        elif entry.get("kind") == "embedding":
            bag = entry.get("bag")  # an nn.EmbeddingBag's reduction
            kinds = (nn.EmbeddingBag, TTEmbeddingBag) if bag is not None else (
                nn.Embedding, TTEmbedding)
            fits = isinstance(like, kinds) and not (
                bag is None and isinstance(like, TTEmbeddingBag)) and (
                like.num_embeddings, like.embedding_dim) == (entry["num_embeddings"],
                                                             entry["embedding_dim"])
            shape = (f"{'EmbeddingBag' if bag is not None else 'Embedding'}"
                     f"({entry['num_embeddings']}, {entry['embedding_dim']})")
            options = {} if bag is None else {"mode": str(bag["mode"]), "include_last_offset":
                                              bool(bag["include_last_offset"])}
            new = (TTEmbedding if bag is None else TTEmbeddingBag)(
                int(entry["num_embeddings"]), int(entry["embedding_dim"]), rank=alloc,
                padding_idx=entry.get("padding_idx"), vocab_factors=entry["vocab_factors"],
                dim_factors=entry["dim_factors"], tau=float(entry["tau"]), dtype=dtype,
                device=device, **options)
        else:
            raise ValueError(f"kind {entry.get('kind')!r}")
    except (KeyError, TypeError, ValueError) as exc:
        raise BadExportFile(path, f"TT layer {name!r}: its description is unusable ({exc})"
                            ) from None
    if not fits:
        raise BadExportFile(path, f"layer {name!r} was saved as a TT {shape}; the model has "
                                  f"{_layer_shape(like)} there: load into a fresh instance "
                                  "of the class that was saved")
    if alloc != ranks:  # a bond of rank 0: the zero map
        new.tt.resize_(ranks)
    return new


def _layer_shape(module: nn.Module) -> str:
    """``Linear(1024, 256)``, ``Embedding(500, 32)`` (also for their TT layers), or the
    module's class name."""
    for a, b, kind in (("in_features", "out_features", "Linear"),
                       ("num_embeddings", "embedding_dim", "Embedding")):
        if isinstance(getattr(module, a, None), int) and isinstance(getattr(module, b, None),
                                                                    int):
            tt = "TT " if isinstance(module, (TTLinear, TTEmbedding)) else ""
            if isinstance(module, (nn.EmbeddingBag, TTEmbeddingBag)):
                kind = "EmbeddingBag"
            return f"{tt}{kind}({getattr(module, a)}, {getattr(module, b)})"
    return type(module).__name__


def load_into(model: nn.Module, path: str | os.PathLike[str]) -> nn.Module:
    """Rebuild the TT layers a :func:`save` file lists inside ``model`` (a fresh instance
    of the saved class) at the saved ranks and load every tensor; returns ``model``.

    Raises:
        BadExportFile: not a :func:`save` file, damaged, or its layers, names or shapes
            do not fit ``model`` (checked before the model is touched).
    """
    path = Path(path)
    header = read_header(path)
    doc = read_comera_metadata(header)
    if doc.get("format") != WEIGHTS_FORMAT:
        raise BadExportFile(path, f"not a comera_engine.save file (format "
                                  f"{doc.get('format')!r}); `comera export` files load "
                                  "with comera_engine.load")
    entries = doc.get("layers")
    if not isinstance(entries, list):
        raise BadExportFile(path, "the metadata lists no TT layers")
    modules: dict[str, nn.Module | str] = {**dict(model.named_modules()),
                                           **dict(candidate_layers(model))}
    new: dict[str, nn.Module] = {}
    for entry in entries:
        name = entry.get("name") if isinstance(entry, dict) else None
        if name == "":
            raise BadExportFile(path, "the saved model is a TT layer itself; load_into "
                                      "rebuilds the TT layers inside a model")
        like = modules.get(name)
        if like is None or isinstance(like, str):
            raise BadExportFile(path, f"layer {name!r} is not in the model: load into a "
                                      "fresh instance of the class that was saved")
        new[name] = _build(path, entry, like)
    # heads tied to a table saved TT decode through it (their weight is not in the file)
    ties = {h: t for h, t in tied_heads(model).items() if t in new}
    # attention whose packed projection was saved TT: split before its layer goes in
    split = [owner for owner in (n.rpartition(".")[0] for n in new if n.endswith(".in_proj"))
             if isinstance(modules[owner], nn.MultiheadAttention)
             and not isinstance(modules[owner], SplitAttention)]
    prefixes = tuple(f"{n}." for n in new)
    packed = {f"{o}.in_proj_{k}" for o in split for k in ("weight", "bias")} | {
        f"{h}.weight" for h in ties}
    want = {k: tuple(v.shape) for k, v in unique_state_dict(model).items()
            if not any(k.startswith(p) for p in prefixes) and k not in packed}
    for name, layer in new.items():
        want.update({f"{name}." + k: tuple(v.shape) for k, v in layer.state_dict().items()
                     if k not in ("tt.gate", "tt.alive")})
    have = {k: e.shape for k, e in header.tensors.items()}
    for key in sorted(set(want) | set(have)):
        if key not in have:
            raise BadExportFile(path, f"holds no tensor {key!r} that the model needs: saved "
                                      "from another model?")
        if key not in want:
            raise BadExportFile(path, f"holds {key!r}, which the model does not have: saved "
                                      "from another model?")
        if tuple(have[key]) != want[key]:
            raise BadExportFile(path, f"tensor {key!r} has shape {list(have[key])}, the "
                                      f"model's is {list(want[key])}")
    from safetensors.torch import load_file

    tensors = load_file(str(path), device="cpu")
    for name, layer in new.items():  # an attention split first, every alias replaced
        set_layer(model, name, layer)
    tie_heads(model, ties)
    model.load_state_dict(tensors, strict=False)
    return model
