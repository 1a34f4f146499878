"""How an exported model is rebuilt: a *recipe* stored as JSON in the export.

Two builders, neither of which imports anything named by the file (except a user
model's factory, listed by its module as one):

* ``family``: a model of :mod:`comera_engine.models` (``transformer_cls``,
  ``transformer_mlm``, ``dlrm``, ``tt_mlp``; ``custom``: a user model, rebuilt by its
  ``model.factory`` only when that module lists it in ``COMERA_MODELS``, so a file
  cannot make the loader call any other function), rebuilt by
  :func:`comera_engine.models.build_model` from the run config's ``[model]`` table and a
  *data spec* (task, classes, vocabulary, sequence length and the model-facing ``meta``
  of the dataset).
* ``tree``: an ``nn.Sequential`` (possibly nested) of whitelisted layers: ``Linear``,
  ``Embedding``, ``TTLinear``, ``TTEmbedding``, ``LayerNorm``, activations, ``Dropout``,
  ``Flatten``, ``Identity``. Covers models made with :func:`comera_engine.tensorize` on a
  plain stack. Module types outside the whitelist cannot be exported this way.

``build(recipe, dense, device)`` gives a freshly initialised model whose parameter
names match the export; the loader then fills in the tensors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from comera_engine.config import LINEAR_LAYOUTS
from comera_engine.errors import ConfigError
from comera_engine.layers import TTEmbedding, TTLinear

# the data spec a model is rebuilt from: written by the trainer, read by the export
from comera_engine.runplan.data import data_namespace as _data_namespace
from comera_engine.runplan.data import data_spec_from_bundle
from comera_engine.runplan.data import plain as _plain

__all__ = [
    "FAMILIES",
    "build",
    "data_spec_from_bundle",
    "describe",
    "example_inputs",
    "validate_recipe",
]

FAMILIES = ("transformer_cls", "transformer_mlm", "dlrm", "tt_mlp", "custom")
# ------------------------------------------------------------------------ tree specs
_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "ReLU": nn.ReLU, "Tanh": nn.Tanh, "Sigmoid": nn.Sigmoid, "SiLU": nn.SiLU,
    "Identity": nn.Identity,
}  # fmt: skip


def _tree_spec(m: nn.Module, where: str) -> dict[str, Any]:
    t = type(m)
    if t is nn.Sequential:
        return {"type": "Sequential",
                "children": [[n, _tree_spec(c, f"{where}.{n}" if where else n)]
                             for n, c in m.named_children()]}
    if t is TTLinear:
        out = {"type": "TTLinear", "in_features": m.in_features,
               "out_features": m.out_features, "in_factors": list(m.in_factors),
               "out_factors": list(m.out_factors), "bias": m.bias is not None,
               "tau": m.tt.tau}
        if m.layout != "tt":  # absent: the paper's layout (files written before layouts)
            out["layout"] = m.layout
        return out
    if t is TTEmbedding:
        return {"type": "TTEmbedding", "num_embeddings": m.num_embeddings,
                "embedding_dim": m.embedding_dim, "padding_idx": m.padding_idx,
                "vocab_factors": list(m.vocab_factors), "dim_factors": list(m.dim_factors),
                "tau": m.tt.tau}
    if t is nn.Linear:
        return {"type": "Linear", "in_features": m.in_features,
                "out_features": m.out_features, "bias": m.bias is not None}
    if t is nn.Embedding:
        if m.max_norm is not None or m.scale_grad_by_freq or m.sparse:
            raise ConfigError(where or "model", "nn.Embedding with max_norm/scale_grad_by_freq/"
                              "sparse cannot be exported as a module tree")
        return {"type": "Embedding", "num_embeddings": m.num_embeddings,
                "embedding_dim": m.embedding_dim, "padding_idx": m.padding_idx}
    if t is nn.LayerNorm:
        return {"type": "LayerNorm", "normalized_shape": list(m.normalized_shape),
                "eps": m.eps, "elementwise_affine": m.elementwise_affine,
                "bias": getattr(m, "bias", None) is not None}
    if t is nn.GELU:
        return {"type": "GELU", "approximate": m.approximate}
    if t is nn.Dropout:
        return {"type": "Dropout", "p": m.p}
    if t is nn.Flatten:
        return {"type": "Flatten", "start_dim": m.start_dim, "end_dim": m.end_dim}
    if t.__name__ in _ACTIVATIONS and _ACTIVATIONS[t.__name__] is t:
        return {"type": t.__name__}
    raise ConfigError(
        where or "model",
        f"{t.__name__} cannot be rebuilt without pickle; export models of "
        "comera_engine.models (pass metadata['config'] and metadata['data_spec']) or an "
        "nn.Sequential of Linear/Embedding/TT layers, LayerNorm, activations, Dropout, Flatten")


def _int(spec: Mapping[str, Any], key: str, where: str, minimum: int = 1) -> int:
    v = spec.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"{where}.{key}", f"must be an integer >= {minimum}, got {v!r}")
    return v


def _ints(spec: Mapping[str, Any], key: str, where: str) -> list[int]:
    v = spec.get(key)
    if not isinstance(v, list) or not v or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v
    ):
        raise ConfigError(f"{where}.{key}", f"must be a non-empty list of positive integers, "
                                            f"got {v!r}")
    return v


def _num(spec: Mapping[str, Any], key: str, where: str) -> float:
    v = spec.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ConfigError(f"{where}.{key}", f"must be a finite number >= 0, got {v!r}")
    return float(v)


def _bool(spec: Mapping[str, Any], key: str, where: str) -> bool:
    v = spec.get(key)
    if not isinstance(v, bool):
        raise ConfigError(f"{where}.{key}", f"must be true or false, got {v!r}")
    return v


def _pad(spec: Mapping[str, Any], where: str) -> int | None:
    v = spec.get("padding_idx")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{where}.padding_idx", f"must be an integer or null, got {v!r}")
    return v


def _build_tree(spec: Any, where: str, dense: bool, depth: int = 0) -> nn.Module:
    if depth > 64:
        raise ConfigError(where, "module tree nested too deeply")
    if not isinstance(spec, Mapping):
        raise ConfigError(where, f"module spec must be an object, got {type(spec).__name__}")
    t = spec.get("type")
    try:
        if t == "Sequential":
            children = spec.get("children")
            if not isinstance(children, list):
                raise ConfigError(f"{where}.children", "must be a list of [name, spec] pairs")
            seq = nn.Sequential()
            for i, item in enumerate(children):
                if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                        or not item[0] or "." in item[0]):
                    raise ConfigError(f"{where}.children[{i}]", "must be a [name, spec] pair "
                                      "with a non-empty name without dots")
                seq.add_module(item[0], _build_tree(item[1], f"{where}.{item[0]}", dense,
                                                    depth + 1))
            return seq
        if t == "TTLinear" or (t == "Linear"):
            i, o = _int(spec, "in_features", where), _int(spec, "out_features", where)
            bias = _bool(spec, "bias", where)
            if t == "Linear" or dense:
                return nn.Linear(i, o, bias=bias)
            layout = spec.get("layout", "tt")
            if layout not in LINEAR_LAYOUTS:
                raise ConfigError(f"{where}.layout", f"must be one of "
                                  f"{', '.join(LINEAR_LAYOUTS)}, got {layout!r}")
            return TTLinear(i, o, rank=1, in_factors=_ints(spec, "in_factors", where),
                            out_factors=_ints(spec, "out_factors", where), bias=bias,
                            tau=_num(spec, "tau", where), layout=layout)
        if t == "TTEmbedding" or t == "Embedding":
            n, e = _int(spec, "num_embeddings", where), _int(spec, "embedding_dim", where)
            pad = _pad(spec, where)
            if t == "Embedding" or dense:
                return nn.Embedding(n, e, padding_idx=pad)
            return TTEmbedding(n, e, rank=1, padding_idx=pad,
                               vocab_factors=_ints(spec, "vocab_factors", where),
                               dim_factors=_ints(spec, "dim_factors", where),
                               tau=_num(spec, "tau", where))
        if t == "LayerNorm":
            shape = _ints(spec, "normalized_shape", where)
            kw: dict[str, Any] = {}
            if "bias" in spec:
                kw["bias"] = _bool(spec, "bias", where)
            return nn.LayerNorm(shape, eps=_num(spec, "eps", where),
                                elementwise_affine=_bool(spec, "elementwise_affine", where), **kw)
        if t == "GELU":
            approx = spec.get("approximate")
            if approx not in ("none", "tanh"):
                raise ConfigError(f"{where}.approximate", f"must be none or tanh, got {approx!r}")
            return nn.GELU(approximate=approx)
        if t == "Dropout":
            p = _num(spec, "p", where)
            if p >= 1:
                raise ConfigError(f"{where}.p", f"must be in [0, 1), got {p}")
            return nn.Dropout(p)
        if t == "Flatten":
            s, e = spec.get("start_dim"), spec.get("end_dim")
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in (s, e)):
                raise ConfigError(where, "Flatten needs integer start_dim and end_dim")
            return nn.Flatten(s, e)
        if isinstance(t, str) and t in _ACTIVATIONS:
            return _ACTIVATIONS[t]()
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(where, str(exc)) from None
    raise ConfigError(f"{where}.type", f"unknown module type {t!r}")


# ------------------------------------------------------------------------ recipes
def _model_config(config: Mapping[str, Any], data_name: str | None) -> Any:
    """A validated ``ModelConfig`` from a run config dict (only ``model`` is required)."""
    from comera_engine.config import config_from_dict

    model = config.get("model")
    if not isinstance(model, Mapping):
        raise ConfigError("metadata.config.model", "missing; give the run config's [model] table")
    data = config.get("data")
    if not isinstance(data, Mapping) or "name" not in data:
        data = {"name": data_name or "export"}
    try:
        return config_from_dict({"model": dict(model), "data": dict(data)}).model
    except ConfigError as exc:
        raise ConfigError(f"metadata.config.{exc.field}", exc.problem) from None


def describe(model: nn.Module, metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The recipe that rebuilds ``model``: a ``family`` recipe when ``metadata`` carries
    ``config`` (with a ``model`` table naming a family) and ``data_spec``; otherwise a
    ``tree`` recipe when ``model`` is a whitelisted ``nn.Sequential``."""
    metadata = metadata or {}
    config = metadata.get("config")
    if isinstance(config, Mapping) and isinstance(config.get("model"), Mapping) and (
        config["model"].get("name") in FAMILIES
    ):
        spec = metadata.get("data_spec")
        if not isinstance(spec, Mapping) or not spec.get("task"):
            raise ConfigError(
                "metadata.data_spec", "missing; give the dataset's shape information "
                "(comera_engine.export.data_spec_from_bundle(bundle))")
        cfg = _model_config(config, spec.get("name"))
        return {"builder": "family", "family": cfg.name,
                "model_config": {k: v for k, v in dataclasses.asdict(cfg).items()
                                 if v is not None},
                "data_spec": _plain(dict(spec))}
    if config is not None and not isinstance(config, Mapping):
        raise ConfigError("metadata.config", f"must be a dict, got {type(config).__name__}")
    if type(model) is not nn.Sequential:
        raise ConfigError(
            "metadata.config", f"needed to rebuild a {type(model).__name__}: give the run "
            "config (with its [model] table) and metadata['data_spec'], or export an "
            "nn.Sequential of supported layers")
    return {"builder": "tree", "tree": _tree_spec(model, "")}


#: Bounds on structure read from a file, so that a hostile recipe cannot make even the
#: shape-only (``meta`` device) build run for ages: layers, list lengths, tree nodes.
MAX_LAYERS, MAX_LIST, MAX_NODES = 1024, 4096, 10_000


def _limits(value: Any, where: str) -> None:
    stack = [(value, where)]
    while stack:
        v, w = stack.pop()
        if isinstance(v, Mapping):
            stack += [(x, f"{w}.{k}") for k, x in v.items()]
        elif isinstance(v, list):
            if len(v) > MAX_LIST:
                raise ConfigError(w, f"list of {len(v)} entries exceeds the limit {MAX_LIST}")
            stack += [(x, w) for x in v]


def _count_nodes(tree: Any) -> int:
    n, stack = 0, [tree]
    while stack:
        node = stack.pop()
        n += 1
        if n > MAX_NODES:
            break
        if isinstance(node, Mapping) and isinstance(node.get("children"), list):
            stack += [c[1] for c in node["children"] if isinstance(c, list) and len(c) == 2]
    return n


def validate_recipe(recipe: Any) -> dict[str, Any]:
    """Type-check a recipe read from a file (values are checked again while building)."""
    if not isinstance(recipe, Mapping):
        raise ConfigError("metadata.model", "must be an object")
    _limits(recipe, "metadata.model")
    b = recipe.get("builder")
    if b == "family":
        if recipe.get("family") not in FAMILIES:
            raise ConfigError("metadata.model.family",
                              f"unknown model family {recipe.get('family')!r}; "
                              f"known: {', '.join(FAMILIES)}")
        if not isinstance(recipe.get("model_config"), Mapping):
            raise ConfigError("metadata.model.model_config", "must be an object")
        layers = recipe["model_config"].get("n_layers")
        if isinstance(layers, int) and layers > MAX_LAYERS:
            raise ConfigError("metadata.model.model_config.n_layers",
                              f"{layers} exceeds the limit {MAX_LAYERS}")
        if recipe["model_config"].get("name") != recipe["family"]:
            raise ConfigError("metadata.model.model_config.name",
                              f"must equal the family {recipe['family']!r}")
        spec = recipe.get("data_spec")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("meta", {}), Mapping):
            raise ConfigError("metadata.model.data_spec", "must be an object")
        for key in ("num_classes", "vocab_size", "seq_len"):
            v = spec.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"metadata.model.data_spec.{key}",
                                  f"must be a positive integer or null, got {v!r}")
        return dict(recipe)
    if b == "tree":
        if not isinstance(recipe.get("tree"), Mapping):
            raise ConfigError("metadata.model.tree", "must be an object")
        if _count_nodes(recipe["tree"]) > MAX_NODES:
            raise ConfigError("metadata.model.tree", f"more than {MAX_NODES} modules")
        return dict(recipe)
    raise ConfigError("metadata.model.builder", f"must be 'family' or 'tree', got {b!r}")


def build(recipe: Mapping[str, Any], dense: bool,
          device: torch.device | str | None = None) -> nn.Module:
    """A freshly initialised model from a recipe (``dense``: the dense baseline, with
    ``nn.Linear``/``nn.Embedding`` where the TT model has TT layers). ``device="meta"``
    builds shapes only (nothing allocated)."""
    recipe = validate_recipe(recipe)
    ctx = torch.device(device) if device is not None else torch.device("cpu")
    with ctx:
        if recipe["builder"] == "tree":
            return _build_tree(recipe["tree"], "metadata.model.tree", dense)
        from comera_engine.models import build_model

        cfg = _model_config({"model": recipe["model_config"]},
                            recipe["data_spec"].get("name"))
        data = _data_namespace(recipe["data_spec"])
        try:
            if cfg.name == "custom":  # only a factory its module lists in COMERA_MODELS
                from comera_engine.models.custom import build_custom

                return build_custom(cfg, data, dense, exposed_only=True)
            return build_model(cfg, data, dense=dense or None)
        except ConfigError as exc:
            raise ConfigError(f"metadata.model.{exc.field}", exc.problem) from None
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError("metadata.model.data_spec",
                              f"cannot build {recipe['family']} from it ({type(exc).__name__}: "
                              f"{exc})") from None


# ------------------------------------------------------------------------ example inputs
def example_inputs(
    recipe: Mapping[str, Any], model: nn.Module, batch: int = 2, seed: int = 0,
) -> tuple[list[str], tuple[torch.Tensor, ...], list[str], dict[str, dict[int, str]]]:
    """``(input names, example tensors, output names, dynamic axes)`` for the model's
    plain ``forward`` (what ONNX export traces and what the model card documents)."""
    g = torch.Generator().manual_seed(seed)
    if recipe["builder"] == "family":
        spec, family = recipe["data_spec"], recipe["family"]
        meta = spec.get("meta") or {}
        if family in ("transformer_cls", "transformer_mlm"):
            L, V = int(spec["seq_len"]), int(spec["vocab_size"])
            ids = torch.randint(0, V, (batch, L), generator=g)
            types = torch.zeros(batch, L, dtype=torch.long)
            types[:, L // 2:] = 1
            mask = torch.ones(batch, L, dtype=torch.long)
            mask[-1, (3 * L) // 4:] = 0
            out = "logits"
            axes = {"input_ids": {0: "batch", 1: "seq"}, "token_type_ids": {0: "batch", 1: "seq"},
                    "attention_mask": {0: "batch", 1: "seq"},
                    out: {0: "batch", 1: "seq"} if family == "transformer_mlm" else {0: "batch"}}
            return (["input_ids", "token_type_ids", "attention_mask"], (ids, types, mask),
                    [out], axes)
        if family == "dlrm":
            sizes = [int(s) for s in meta["bucket_sizes"]]
            dense = torch.randn(batch, int(meta["num_dense"]), generator=g)
            sparse = torch.stack([torch.randint(0, s, (batch,), generator=g) for s in sizes], 1)
            return (["dense", "sparse"], (dense, sparse), ["logit"],
                    {"dense": {0: "batch"}, "sparse": {0: "batch"}, "logit": {0: "batch"}})
        if family == "custom":
            return _user_inputs(spec, batch, g)
        x = torch.randn(batch, int(meta["input_dim"]), generator=g)
        return ["x"], (x,), ["logits"], {"x": {0: "batch"}, "logits": {0: "batch"}}
    first = next((m for m in model.modules() if isinstance(
        m, (nn.Linear, nn.Embedding, TTLinear, TTEmbedding))), None)
    if isinstance(first, (nn.Embedding, TTEmbedding)):
        x = torch.randint(0, first.num_embeddings, (batch, 8), generator=g)
        axes = {"input": {0: "batch", 1: "seq"}}
    elif isinstance(first, (nn.Linear, TTLinear)):
        x = torch.randn(batch, first.in_features, generator=g)
        axes = {"input": {0: "batch"}}
    else:
        raise ConfigError("example_inputs", "cannot guess the input of this model; pass "
                          "example_inputs=(tensor, ...)")
    return ["input"], (x,), ["output"], {**axes, "output": {0: "batch"}}


def _user_inputs(spec: Mapping[str, Any], batch: int, g: torch.Generator
                 ) -> tuple[list[str], tuple[torch.Tensor, ...], list[str],
                            dict[str, dict[int, str]]]:
    """A user model's inputs on ``data.name = "files"`` (``x``, ``categorical``,
    ``input_ids``, in that order, those its data has)."""
    meta = spec.get("meta") or {}
    names: list[str] = []
    args: list[torch.Tensor] = []
    if int(meta.get("input_dim") or 0):
        names.append("x")
        args.append(torch.randn(batch, int(meta["input_dim"]), generator=g))
    if meta.get("cardinalities"):
        names.append("categorical")
        args.append(torch.stack([torch.randint(0, int(c), (batch,), generator=g)
                                 for c in meta["cardinalities"]], 1))
    if spec.get("seq_len") and spec.get("vocab_size"):
        names.append("input_ids")
        args.append(torch.randint(0, int(spec["vocab_size"]), (batch, int(spec["seq_len"])),
                                  generator=g))
    if not names:
        raise ConfigError("example_inputs", "cannot tell this user model's inputs from its "
                          "data; pass example_inputs=(tensor, ...)")
    axes = {n: {0: "batch"} for n in names}
    return names, tuple(args), ["output"], {**axes, "output": {0: "batch"}}
