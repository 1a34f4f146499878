"""DLRM (Naumov et al., 2019) with TT embedding tables, as in the paper's DLRM experiment.

Dense features go through the bottom MLP to a vector of width ``D``; each sparse feature
is looked up in its own table (TTM ``TTEmbedding`` for large tables, ``nn.Embedding``
for small ones); the ``F = 1 + n_sparse`` vectors interact by pairwise dot products
(strict upper triangle), which are concatenated with the bottom output and fed to the
top MLP that ends in one click logit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from comera_engine.models.common import LayerFactory, embedding, mlp


@dataclass(frozen=True)
class DLRMSize:
    """Widths of a DLRM (the bottom MLP ends in ``embedding_dim``; the top in 1)."""

    embedding_dim: int
    bottom_mlp: tuple[int, ...]
    top_mlp: tuple[int, ...]
    rank: int
    embedding_rank: int
    tt_min_rows: int


PRESETS: dict[str, DLRMSize] = {
    # MLPerf DLRM (Criteo Terabyte) widths.
    "paper": DLRMSize(128, (512, 256), (1024, 1024, 512, 256), 32, 32, 1000),
    # The DLRM Criteo Kaggle widths.
    "small": DLRMSize(16, (512, 256, 64), (512, 256), 16, 16, 1000),
    "tiny": DLRMSize(16, (64,), (64,), 8, 8, 200),
}


class DLRM(nn.Module):
    """``forward(dense [B, n_dense], sparse [B, n_sparse]) -> click logits [B]``."""

    def __init__(
        self,
        size: DLRMSize,
        factory: LayerFactory,
        num_dense: int,
        bucket_sizes: Sequence[int],
        tables: Sequence[nn.Module] | None = None,
    ) -> None:
        super().__init__()
        d = size.embedding_dim
        self.bottom = mlp(factory, "bottom", [num_dense, *size.bottom_mlp, d], last_activation=True)
        self.tables = nn.ModuleList(
            tables if tables is not None else (
                factory.embedding("embedding", int(n), d, min_rows=size.tt_min_rows)
                for n in bucket_sizes)
        )
        n_vec = 1 + len(bucket_sizes)
        # on the CPU whatever the device (a meta model's would import sympy, 0.4 s)
        rows, cols = torch.triu_indices(n_vec, n_vec, offset=1, device="cpu")
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)
        self.top = mlp(factory, "top", [d + rows.numel(), *size.top_mlp, 1])
        for table in self.tables:
            if isinstance(table, nn.Embedding):
                bound = 1.0 / (table.num_embeddings**0.5)
                nn.init.uniform_(table.weight, -bound, bound)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)  # [B, D]
        vecs = [x] + [table(sparse[:, i]) for i, table in enumerate(self.tables)]
        t = torch.stack(vecs, dim=1)  # [B, F, D]
        z = torch.bmm(t, t.transpose(1, 2))  # [B, F, F]
        pairs = z[:, self.pair_rows, self.pair_cols]  # [B, F(F-1)/2]
        return self.top(torch.cat([x, pairs], dim=1)).squeeze(1)


#: ``model.kwargs.peer`` of :func:`peer_dlrm` (layers/embedding_peers.py).
COMERA_MODELS = ["peer_dlrm"]


def peer_dlrm(cardinalities: Sequence[int], peer: str = "hash", target: float | None = None,
              preset: str = "tiny", min_rows: int | None = None, lr_table: float = 1e-2,
              counts: str | None = None, num_dense: int = 13) -> DLRM:
    """DLRM whose tables of at least ``min_rows`` rows (default: the preset's
    ``tt_min_rows``) are ``peer`` tables (:func:`~comera_engine.layers.embedding_peers.
    build_peer`) of ``1/target`` of their dense bytes each (at least one row; ``None``:
    the dense size);
    smaller tables stay ``nn.Embedding``, as in the TT model. A user model
    (``model.name = "custom"``, ``model.factory = "comera_engine.models.dlrm:peer_dlrm"``,
    ``model.dense = true``).

    Args:
        cardinalities: rows per categorical field (the data fact).
        counts: an ``.npz`` of ``f<j>`` = field ``j``'s ids by falling training frequency
            (the mixed-dimension tables' hot ids).
        lr_table: the row-sparse Adam rate of the peer tables.
    """
    from comera_engine.layers.embedding_peers import build_peer

    size = PRESETS[preset]
    rows = size.tt_min_rows if min_rows is None else int(min_rows)
    d = size.embedding_dim
    hot = np.load(Path(counts)) if counts else None
    tables: list[nn.Module] = []
    for j, n in enumerate(int(c) for c in cardinalities):
        if n < max(rows, 2):
            tables.append(embedding(n, d))
            continue
        # at least one row of floats: a 305-row table at 1000x would hold 19 bytes
        budget = None if target is None else max(d * 4, int(n * d * 4 / float(target)))
        ids = hot[f"f{j}"] if hot is not None and f"f{j}" in hot else None
        tables.append(build_peer(peer, n, d, budget, counts=ids, lr=lr_table))
    factory = LayerFactory((), size.rank, size.embedding_rank, dense=True)
    return DLRM(size, factory, num_dense, list(cardinalities), tables=tables)
