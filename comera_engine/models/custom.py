"""User models by entry point (``model.factory = "package.module:function"``).

The factory is called with ``model.kwargs`` and, when its signature names them, the
data facts a network needs (:data:`DATA_FACTS`: ``in_features``, ``num_classes``,
``cardinalities``, ``vocab_size``, ``seq_len``); it returns an ``nn.Module``. Its
``nn.Linear`` / ``nn.Embedding`` layers then become TT layers as ``[model.tensorize]``
says (``include`` / ``exclude`` globs, ``rank``, ``layout``, ``min_features``), through
:func:`comera_engine.layers.tensorize`, the same function ``comera_engine.tensorize``
uses. From here on the model is trained, planned, previewed, checkpointed and exported
like a built-in family.

Which factories a module *exposes* (:func:`exposed_factories`): its ``COMERA_MODELS``
(a list of function names, or a dict of name → function) when it has one, else its
public functions defined in it. ``comera app --models MODULE`` offers those, and
``comera_engine.load`` rebuilds an export only through a factory its module lists in
``COMERA_MODELS`` (a file cannot make the loader call any other function).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

from torch import nn

from comera_engine.entry import call_entry, import_module, resolve_entry
from comera_engine.errors import ConfigError

__all__ = ["BASE_RANK", "DATA_FACTS", "build_custom", "data_facts", "exposed_factories"]

BASE_RANK = 8  # the rank a user model's TT layers start at without a target or a rank
DATA_FACTS = ("in_features", "num_classes", "cardinalities", "vocab_size", "seq_len")


def data_facts(data: Any) -> dict[str, Any]:
    """The facts of a dataset (a ``DataBundle`` or a shape namespace) a factory may ask
    for by parameter name; absent ones are left out."""
    meta = dict(getattr(data, "meta", None) or {})
    facts = {"in_features": meta.get("input_dim"), "num_classes": getattr(data, "num_classes",
                                                                            None),
             "cardinalities": meta.get("cardinalities"),
             "vocab_size": getattr(data, "vocab_size", None),
             "seq_len": getattr(data, "seq_len", None)}
    return {k: v for k, v in facts.items() if v is not None}


def _call_args(fn: Any, kwargs: Mapping[str, Any], facts: Mapping[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return dict(kwargs)
    wanted = {k: v for k, v in facts.items() if k in params and k not in kwargs}
    return {**wanted, **kwargs}


def exposed_factories(module_name: str, field: str = "--models",
                      search: tuple[str, ...] = ()) -> dict[str, str]:
    """``{name: "module:function"}`` of the factories ``module_name`` exposes (module
    docstring)."""
    module = import_module(module_name, field, search)
    listed = getattr(module, "COMERA_MODELS", None)
    if listed is None:
        names = [n for n, v in vars(module).items() if not n.startswith("_")
                 and inspect.isfunction(v) and v.__module__ == module.__name__]
        return {n: f"{module_name}:{n}" for n in names}
    if isinstance(listed, Mapping):
        out = {}
        for name, fn in listed.items():
            attr = fn if isinstance(fn, str) else getattr(fn, "__name__", None)
            if not isinstance(attr, str) or not callable(getattr(module, attr, None)):
                raise ConfigError(field, f"{module_name}.COMERA_MODELS[{name!r}] must name a "
                                         "function of the module")
            out[str(name)] = f"{module_name}:{attr}"
        return out
    if isinstance(listed, (list, tuple)) and all(isinstance(n, str) for n in listed):
        missing = [n for n in listed if not callable(getattr(module, n, None))]
        if missing:
            raise ConfigError(field, f"{module_name}.COMERA_MODELS names {missing[0]!r}, which "
                                     "is not a function of the module")
        return {n: f"{module_name}:{n}" for n in listed}
    raise ConfigError(field, f"{module_name}.COMERA_MODELS must be a list of function names "
                             "or a dict of name -> function")


def build_custom(cfg: Any, data: Any, dense: bool, *, exposed_only: bool = False) -> nn.Module:
    """The user model of the ``[model]`` config ``cfg`` for ``data``, with its TT layers
    (none when ``dense``). ``exposed_only``: the factory must be listed in its module's
    ``COMERA_MODELS`` (an export being loaded names it).

    Raises:
        ConfigError: ``model.factory`` does not import, is not callable, raises, or
            returns something that is not an ``nn.Module``; a ``[model.tensorize]``
            setting leaves no layer to make TT.
    """
    spec = cfg.factory
    search = (os.getcwd(),)
    if exposed_only:
        module_name, _, attr = spec.partition(":")
        module = import_module(module_name, "model.factory", search)
        listed = getattr(module, "COMERA_MODELS", None)
        names = set(listed) if isinstance(listed, (list, tuple, Mapping)) else set()
        if isinstance(listed, Mapping):
            names |= {getattr(f, "__name__", f) for f in listed.values()}
        if attr not in names:
            raise ConfigError("model.factory", f"{spec} is not listed in {module_name}."
                                               "COMERA_MODELS; add it there to load exports "
                                               "built by it")
    fn = resolve_entry(spec, "model.factory", search)
    model = call_entry(fn, spec, "model.factory",
                       _call_args(fn, dict(cfg.kwargs or {}), data_facts(data)))
    if not isinstance(model, nn.Module):
        raise ConfigError("model.factory", f"{spec} returned a {type(model).__name__}, not an "
                                           "nn.Module; return the network")
    if dense:
        return model
    from comera_engine.layers import factorized_layers, tensorize_layers

    t = dict(cfg.tensorize or {})
    rank = cfg.rank or (t["rank"] if isinstance(t.get("rank"), int) else BASE_RANK)
    rows = tensorize_layers(model, rank=rank, embedding_rank=cfg.embedding_rank or rank,
                            include=t.get("include"), exclude=t.get("exclude"),
                            layout=t.get("layout", "tt"),
                            min_features=t.get("min_features", 8))
    if not any(r.get("replaced") for r in rows) and not factorized_layers(model):
        raise ConfigError("model.tensorize", f"no nn.Linear or nn.Embedding of {spec}'s model "
                                             "is made TT; widen include / exclude, lower "
                                             "min_features, or set model.dense = true")
    return model
