"""TTM embedding lookups: the op lives in :mod:`comera_engine.ops.ttm_lookup`; its
``fused`` path takes the rows from the Triton lookup (:mod:`comera_engine.kernels.ttm_lookup`)
where the kernels run (CUDA with ``COMERA_KERNELS=1``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor

from ..ops.gates import absorb_gates
from ..ops.ttm_lookup import merge_tables, split_point, ttm_lookup_naive
from ..ops.ttm_lookup import ttm_lookup as _ttm_lookup
from ..ops.ttm_matrix import ttm_matrix

__all__ = ["lookup_rows", "merge_tables", "split_point", "ttm_lookup", "ttm_lookup_naive"]


def lookup_rows(ids: Tensor, cores: Sequence[Tensor], gates: Sequence[Tensor],
                alive: Sequence[Tensor], tau: float, path: str, h: int | None = None
                ) -> Tensor:
    """Rows ``(*ids.shape, ∏ e_k)`` of the TTM table of the raw ``cores`` gated by
    ``gates`` (``alive``, ``tau`` as :func:`comera_engine.ops.gates.absorb_gates`), on the
    planner's ``path``: ``"dense"`` (the table ``E`` from the gated cores,
    :func:`comera_engine.ops.ttm_matrix.ttm_matrix`, then one gather; its gradient
    scatters into ``E`` and goes back through the cores), ``"gather"`` or ``"fused"``
    (:func:`ttm_lookup` on the gated cores, split after core ``h``)."""
    ranks = [int(c.shape[-1]) for c in cores[:-1]]
    if path == "dense" and min(ranks, default=1) > 0:
        return F.embedding(ids, ttm_matrix(cores, gates, alive, tau))
    if path not in ("dense", "gather", "fused"):
        raise ValueError(f"path: a TTM lookup's paths are dense, gather, fused; got {path!r}")
    return ttm_lookup(ids, absorb_gates(cores, gates, tau, alive), h,
                      path="fused" if path == "fused" else "gather")


def ttm_lookup(ids: Tensor, cores: Sequence[Tensor], h: int | None = None,
               dedup: bool | None = None, path: str | None = None) -> Tensor:
    """Rows of the TTM table of the (gated) ``cores`` for ``ids``
    (:func:`comera_engine.ops.ttm_lookup.ttm_lookup`). ``path``: ``"gather"`` (the
    PyTorch rows), ``"fused"`` (the Triton lookup where the kernels take the cores and
    the rank at the split fits its tile; else as ``gather``) or None: ``fused`` where it
    runs (the kernels are opt-in)."""
    from ..kernels import runs_on

    rows_fn = None
    if path != "gather" and cores and runs_on(cores[0]):
        from ..kernels.tt_linear import MAX_RANK
        from ..kernels.ttm_lookup import ttm_lookup_fused
        from .planner import device_model

        device_model(cores[0].device)  # its profile's kernel configurations, if any

        ranks = [1, *[c.shape[-1] for c in cores[:-1]], 1]
        split = h if h is not None else split_point([c.shape[1] for c in cores],
                                                    [c.shape[2] for c in cores], ranks)
        if 1 <= ranks[split] <= MAX_RANK:
            rows_fn = ttm_lookup_fused
    return _ttm_lookup(ids, cores, h, dedup, rows_fn=rows_fn)
