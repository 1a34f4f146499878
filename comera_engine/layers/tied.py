"""An output layer tied to an embedding table that is made TT: a language model's head.

Many language models share one matrix between the token embedding ``E`` ``(V, d)`` and the
output layer (``nn.Linear(d, V)`` whose ``weight`` *is* ``E``: GPT-2's ``lm_head`` and
``wte``). A TT layer holds weights of its own, so making the table TT would cut the tie
and leave the head holding the old dense matrix. Instead the head becomes a
:class:`TiedDecoder` that scores through the TT table, ``h · Eᵀ (+ b)``
(:meth:`~comera_engine.layers.TTEmbedding.decode`: contracted through the cores, the
table never built on the ``tt`` path): one set of parameters, counted once, as the tie
had it.

:func:`tied_heads` finds the ties, :func:`tie_heads` makes them; ``tensorize`` and
``load_into`` both go through them. An embedding holding another's table (T5's encoder
and decoder tables are its ``shared`` one) is tied the same way: the TT table is put in
its place too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from .tree import set_module
from .tt_embedding import TTEmbedding

__all__ = ["TiedDecoder", "tie_heads", "tied_heads"]


class TiedDecoder(nn.Module):
    """``h · Eᵀ + b`` for the table ``E`` of ``embedding`` (a :class:`TTEmbedding`, or the
    ONNX export's form of one): an ``nn.Linear(d, V)`` tied to it. ``embedding`` is
    referenced, not owned: its parameters belong to the module that holds it, so they
    appear once in ``parameters()`` and the state dict. ``bias``: the head's own bias
    parameter (kept), or ``None``.

    ``weight`` is ``E`` rebuilt from the cores (``(V, d)``, ``nn.Linear``'s layout), for
    code that reads a head's weight instead of calling it.
    """

    def __init__(self, embedding: nn.Module, bias: nn.Parameter | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "embedding", embedding)  # a reference, not a child
        self.in_features = int(embedding.embedding_dim)
        self.out_features = int(embedding.num_embeddings)
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias: shape {tuple(bias.shape)}, the table has "
                             f"{self.out_features} rows")
        self.bias = bias

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The head's bias drawn afresh as ``nn.Linear``'s (the table is its owner's to
        reset): for a model built on the ``meta`` device, after ``to_empty``."""
        if self.bias is not None and not self.bias.is_meta:
            bound = 1.0 / math.sqrt(self.in_features)
            self.bias.uniform_(-bound, bound)

    def forward(self, h: Tensor) -> Tensor:
        scores = self.embedding.decode(h)
        return scores if self.bias is None else scores + self.bias.to(scores.dtype)

    @property
    def weight(self) -> Tensor:
        """The tied table ``E`` ``(V, d)``, rebuilt from the cores at each read."""
        return self.embedding.dense_weight()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tied to a TT table")


def tied_heads(model: nn.Module, candidates: Iterable[tuple[str, object]] | None = None
               ) -> dict[str, str]:
    """``{module: table}``: every module of ``model`` tied to an ``nn.Embedding`` (the
    first, in model order, of those holding that weight): an ``nn.Linear`` whose
    ``weight`` is the table's very parameter (a head, ``(V, d)``), or another
    ``nn.Embedding`` holding it (T5's encoder and decoder tables are its ``shared``
    one), by qualified name; only modules whose forward is the plain one (a subclass
    computing more cannot be replaced by the table). ``candidates``: the ``(name,
    module)`` pairs to look among (default: all modules)."""
    pairs = list(model.named_modules() if candidates is None else candidates)
    tables: dict[int, str] = {}
    ties: dict[str, str] = {}
    for name, m in pairs:
        if isinstance(m, nn.Embedding) and not isinstance(m, TTEmbedding):
            if id(m.weight) not in tables:
                tables[id(m.weight)] = name
            elif type(m).forward is nn.Embedding.forward:  # computes what the table does
                ties[name] = tables[id(m.weight)]
    ties.update({name: tables[id(m.weight)] for name, m in pairs
                 if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
                 and id(m.weight) in tables})
    return ties


def tie_heads(model: nn.Module, ties: Mapping[str, str]) -> list[str]:
    """Tie each module of ``ties`` (``{module: table}``, :func:`tied_heads`) whose table
    is now a :class:`TTEmbedding` to it: a head becomes a :class:`TiedDecoder` over it
    (its bias kept), another embedding *is* it (the same module at both places).
    Returns the modules tied."""
    done = []
    for name, table in ties.items():
        embedding = model.get_submodule(table)
        if not isinstance(embedding, TTEmbedding):
            continue
        old = model.get_submodule(name)
        new = (embedding if isinstance(old, nn.Embedding)
               else TiedDecoder(embedding, getattr(old, "bias", None)))
        set_module(model, name, new)
        done.append(name)
    return done
