"""Model size in a target's scope (docs/SIZE_AND_TARGET.md), built on the one formula of
:mod:`comera_engine.tensor.size` (a TT layer's size ``S`` and surrogate ``Ŝ``).

One size, counted one way (the same as :func:`~comera_engine.layers.size_report`, the
preview and the export card):

- ``tensorized``: every parameter of the TT layers at their effective ranks, i.e. the
  cores plus a TT linear's bias; its dense equivalent is the dense layer with the same
  bias (``in·out + out``; an embedding table ``rows·dim``).
- ``other``: every parameter outside the TT layers (dense linears, norms, heads, their
  biases), counted the same on both sides. Gate vectors count nowhere (training controls,
  absorbed into the cores on export).
- ``model`` = ``tensorized + other``.

The TT biases are a constant in ``S`` (the surrogate ``Ŝ`` is the cores' part only, which
is all the gates can change): :func:`size_extra`.
"""

from __future__ import annotations

from torch import Tensor, nn

from ..layers import TTEmbedding, TTLinear, peer_layers, tt_layers
from ..tensor.size import tt_size
from .target import LayerSpec, SizeSpec

__all__ = ["dense_size", "effective_size", "min_size", "model_sizes", "size_extra",
           "size_spec"]


def _dense_params(m: TTLinear | TTEmbedding) -> int:
    """A TT layer's dense equivalent without its bias: ``in·out`` or ``rows·dim``."""
    if isinstance(m, TTLinear):
        return m.in_features * m.out_features
    return m.num_embeddings * m.embedding_dim


def _other_params(model: nn.Module) -> int:
    tt_ids = set()
    for _, m in tt_layers(model) + peer_layers(model):
        tt_ids.update(id(p) for p in m.parameters())
    return sum(p.numel() for p in model.parameters() if id(p) not in tt_ids)


def _bias(layer: nn.Module) -> int:
    """Parameters of a TT layer outside its cores and gates (a TT linear's bias)."""
    b = getattr(layer, "bias", None)
    return int(b.numel()) if isinstance(b, Tensor) else 0


def model_sizes(model: nn.Module) -> dict[str, int]:
    """Effective sizes: ``tensorized`` (TT layers: cores at the effective ranks + bias),
    ``other`` (every parameter outside the TT layers) and ``model`` (their sum)."""
    tt = sum(m.tt.num_params(effective=True) + _bias(m) for _, m in tt_layers(model))
    other = _other_params(model)
    return {"tensorized": tt, "other": other, "model": tt + other}


def dense_size(model: nn.Module) -> dict[str, int]:
    """Sizes of the dense equivalent: TT layers as dense matrices/tables (with the bias)."""
    tt = sum(_dense_params(m) + _bias(m) for _, m in tt_layers(model))
    other = _other_params(model)
    return {"tensorized": tt, "other": other, "model": tt + other}


def min_size(model: nn.Module) -> dict[str, int]:
    """Smallest reachable size: every bond at rank 1 (``Σ s_k`` + bias per layer)."""
    tt = sum(tt_size(m.tt.mode_sizes, [1] * (m.tt.num_cores - 1)) + _bias(m)
             for _, m in tt_layers(model))
    other = _other_params(model)
    return {"tensorized": tt, "other": other, "model": tt + other}


def effective_size(model: nn.Module, scope: str) -> float:
    """Effective size ``S`` (``"tensorized"`` or ``"model"``; ``"cores"``: the TT cores
    alone, no bias): the cores at their effective ranks (:func:`tt_size` of each layer)
    plus the TT biases, plus every other parameter for ``"model"``."""
    cores = sum(m.tt.num_params(effective=True) for _, m in tt_layers(model))
    return float(cores) + size_extra(model, scope)


def size_extra(model: nn.Module, scope: str) -> float:
    """What ``scope`` counts beyond the TT cores, constant through training: the TT
    biases (``"tensorized"``), plus every parameter outside the TT layers (``"model"``);
    0 for ``"cores"``."""
    if scope == "cores":
        return 0.0
    extra = sum(_bias(m) for _, m in tt_layers(model))
    return float(extra + (_other_params(model) if scope == "model" else 0))


def size_spec(model: nn.Module) -> SizeSpec:
    """The shapes :func:`comera_engine.rank.target.plan_target` needs, read off ``model``
    (a meta-device model is enough: only shapes and allocated ranks are read).

    The engine's TT layers first, then the peer (tltorch) layers, each in model order
    (a model has one kind or the other; the fixed-rank plans list ranks in this order)."""
    peers = tuple(
        LayerSpec(
            kind="linear" if hasattr(m, "in_features") else "embedding",
            mode_sizes=tuple(m.mode_sizes),
            ranks=tuple(m.effective_ranks()),
            bias=_bias(m),
            dense=m.dense_num_params(),
        )
        for _, m in peer_layers(model)
    )
    layers = tuple(
        LayerSpec(
            kind="linear" if isinstance(m, TTLinear) else "embedding",
            mode_sizes=tuple(int(s) for s in m.tt.mode_sizes),
            ranks=tuple(int(r) for r in m.tt.bond_ranks),
            bias=_bias(m),
            dense=_dense_params(m) + _bias(m),
        )
        for _, m in tt_layers(model)
    )
    return SizeSpec(layers + peers, _other_params(model))
