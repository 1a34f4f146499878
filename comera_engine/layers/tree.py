"""Where modules sit in a model's tree: a module held at several places (aliases),
putting a module in place of another everywhere it sits, and a state dict that names
each tensor once."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["module_aliases", "set_module", "unique_state_dict", "with_aliases"]


def module_aliases(model: nn.Module) -> dict[str, list[str]]:
    """``{name: [other names]}``: the modules of ``model`` held at more than one place
    (T5's and BART's ``shared`` table is also ``encoder.embed_tokens`` and
    ``decoder.embed_tokens``), by the name ``named_modules`` gives them first."""
    first: dict[int, str] = {}
    out: dict[str, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) in first:
            out.setdefault(first[id(module)], []).append(name)
        else:
            first[id(module)] = name
    return out


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where the module ``name`` is, and at every other place that holds the
    same module (:func:`module_aliases`), so no alias keeps the old one."""
    for where in (name, *module_aliases(model).get(name, ())):
        parent_name, _, child = where.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)


def unique_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` without the entries a module held at several places repeats
    under its other names (:func:`module_aliases`): each tensor once, under the name
    ``named_modules`` gives its module first."""
    others = tuple(f"{a}." for names in module_aliases(model).values() for a in names)
    return {k: v for k, v in model.state_dict().items() if not k.startswith(others)}


def with_aliases(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (named as :func:`unique_state_dict` names it) with the entries of every
    module held at several places repeated under its other names: what
    ``model.load_state_dict(strict=True)`` and ``model.state_dict()`` expect. The
    repeated entries are the same tensors, not copies."""
    out = dict(state)
    for first, others in module_aliases(model).items():
        for key, value in state.items():
            if key.startswith(f"{first}."):
                out.update({f"{other}{key[len(first):]}": value for other in others})
    return out
