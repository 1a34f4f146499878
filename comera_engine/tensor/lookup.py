"""TTM embedding lookups: the op lives in :mod:`comera_engine.ops.ttm_lookup`; on a CUDA
device with the kernels on (``COMERA_KERNELS=1``) the rows come from the fused Triton
lookup (:mod:`comera_engine.kernels.ttm_lookup`)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..ops.ttm_lookup import merge_tables, split_point, ttm_lookup_naive
from ..ops.ttm_lookup import ttm_lookup as _ttm_lookup

__all__ = ["merge_tables", "split_point", "ttm_lookup", "ttm_lookup_naive"]


def ttm_lookup(ids: Tensor, cores: Sequence[Tensor], h: int | None = None,
               dedup: bool | None = None) -> Tensor:
    """:func:`comera_engine.ops.ttm_lookup.ttm_lookup`, its rows on the fused kernel where
    the kernels take the cores (:func:`comera_engine.kernels.runs_on`) and the rank at the
    split fits its tile."""
    from ..kernels import runs_on

    rows_fn = None
    if cores and runs_on(cores[0]):
        from ..kernels.tt_linear import MAX_RANK
        from ..kernels.ttm_lookup import ttm_lookup_fused

        ranks = [1, *[c.shape[-1] for c in cores[:-1]], 1]
        split = h if h is not None else split_point([c.shape[1] for c in cores],
                                                    [c.shape[2] for c in cores], ranks)
        if 1 <= ranks[split] <= MAX_RANK:
            rows_fn = ttm_lookup_fused
    return _ttm_lookup(ids, cores, h, dedup, rows_fn=rows_fn)
