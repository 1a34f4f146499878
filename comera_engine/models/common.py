"""Building blocks shared by the models: a layer factory that gives TT or dense layers.

Every model is written once against :class:`LayerFactory`; whether a layer comes out as
``TTLinear``/``TTEmbedding`` or as ``nn.Linear``/``nn.Embedding`` is decided here from the
layer's *kind* (``"attention"``, ``"ffn"``, ``"embedding"``, ...) and the config. The
dense baseline of a model is the same code with ``dense=True``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from comera_engine.config import DEFAULT_TT_LAYERS, TT_LAYER_KINDS  # noqa: F401 (re-export)


@dataclass
class LayerFactory:
    """Makes the linear and embedding layers of one model.

    Args:
        tt_kinds: layer kinds built in TT form (ignored when ``dense``).
        rank: max TT rank of linear layers.
        embedding_rank: max TT rank of embedding tables.
        dense: build every layer dense (the baseline).
        min_dim: linears whose smaller side is below this stay dense (a TT factorisation
            of a 13-wide input saves nothing).
        impl: ``"comera"`` (the engine's gated ``TTLinear`` / ``TTEmbedding``) or
            ``"tltorch"`` (tensorly-torch's TT-matrix layers, ``layers.peers``;
            ``model.tt_impl``).
        linear_layout: core layout of the engine's ``TTLinear`` (``"tt"``, the paper's, or
            ``"ttm"``; ``model.linear_layout``).
    """

    tt_kinds: Sequence[str]
    rank: int
    embedding_rank: int
    dense: bool = False
    min_dim: int = 16
    impl: str = "comera"
    linear_layout: str = "tt"

    def is_tt(self, kind: str) -> bool:
        return not self.dense and kind in self.tt_kinds

    def linear(
        self,
        kind: str,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_factors: Sequence[int] | None = None,
        out_factors: Sequence[int] | None = None,
    ) -> nn.Module:
        """``TTLinear`` for a TT kind (and both sides >= ``min_dim``), else ``nn.Linear``."""
        if self.is_tt(kind) and min(in_features, out_features) >= self.min_dim:
            from comera_engine.layers import TLTorchLinear, TTLinear

            kw = {"layout": self.linear_layout} if self.impl != "tltorch" else {}
            return (TLTorchLinear if self.impl == "tltorch" else TTLinear)(
                in_features,
                out_features,
                rank=self.rank,
                in_factors=list(in_factors) if in_factors else None,
                out_factors=list(out_factors) if out_factors else None,
                bias=bias,
                **kw,
            )
        return nn.Linear(in_features, out_features, bias=bias)

    def embedding(
        self,
        kind: str,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        vocab_factors: Sequence[int] | None = None,
        dim_factors: Sequence[int] | None = None,
        min_rows: int = 0,
    ) -> nn.Module:
        """``TTEmbedding`` (TTM) for a TT kind with at least ``min_rows`` rows, else dense."""
        if self.is_tt(kind) and num_embeddings >= max(min_rows, 2):
            from comera_engine.layers import TLTorchEmbedding, TTEmbedding

            return (TLTorchEmbedding if self.impl == "tltorch" else TTEmbedding)(
                num_embeddings,
                embedding_dim,
                rank=self.embedding_rank,
                padding_idx=padding_idx,
                vocab_factors=list(vocab_factors) if vocab_factors else None,
                dim_factors=list(dim_factors) if dim_factors else None,
            )
        return embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)


def embedding(num_embeddings: int, embedding_dim: int, padding_idx: int | None = None
              ) -> nn.Embedding:
    """``nn.Embedding(num_embeddings, embedding_dim, padding_idx)``, its table left
    uninitialised on the meta device (a run plan's model: shapes only), where torch's
    ``normal_`` would import Dynamo (about a second of ``comera launch``)."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx,
                            _weight=torch.empty(num_embeddings, embedding_dim))
    return nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)


def mlp(
    factory: LayerFactory,
    kind: str,
    widths: Sequence[int],
    dropout: float = 0.0,
    last_activation: bool = False,
) -> nn.Sequential:
    """``Linear -> ReLU (-> Dropout)`` stack through ``widths`` (len >= 2)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(factory.linear(kind, a, b))
        if i < len(widths) - 2 or last_activation:
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)
