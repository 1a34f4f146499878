"""TTM embedding lookups.

Optimised (comera-method.md §3): deduplicate ids, merge cores ``1..h`` and ``h+1..d`` into
two tables ``A ∈ R^{V_a×E_a×r_h}`` and ``Bt ∈ R^{V_b×r_h×E_b}``, unravel each unique id
into ``(a, b)``, gather, and one batched GEMM ``A[a]·Bt[b] -> (U, E_a, E_b)``. Autograd
scatters the gradient into the two tables (``index_add``), then back into the cores.

The naive baseline contracts the gathered core slices token by token (no dedup, no
merged tables): what the optimised path is measured against.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["split_point", "merge_tables", "ttm_lookup", "ttm_lookup_naive"]


def split_point(row_factors: Sequence[int], col_factors: Sequence[int],
                ranks: Sequence[int]) -> int:
    """The split ``h`` (cores ``1..h`` | ``h+1..d``) that makes the two tables smallest."""
    d = len(row_factors)
    if d == 1:
        return 1
    best = None
    for h in range(1, d):
        size = (math.prod(row_factors[:h]) * math.prod(col_factors[:h])
                + math.prod(row_factors[h:]) * math.prod(col_factors[h:])) * ranks[h]
        if best is None or size < best[0]:
            best = (size, h)
    return best[1]


def _merge(cores: Sequence[Tensor]) -> Tensor:
    """Merge TTM cores ``(r, v_k, e_k, r')`` into ``(r_0, V, E, r_last)`` with row index
    ``(v_1..)`` and column index ``(e_1..)`` row-major."""
    acc = cores[0]  # (r0, V, E, r)
    for c in cores[1:]:
        r0, V, E, r = acc.shape
        _, v, e, r2 = c.shape
        t = acc.reshape(-1, r) @ c.reshape(r, -1)  # (r0·V·E, v·e·r2)
        t = t.reshape(r0, V, E, v, e, r2).permute(0, 1, 3, 2, 4, 5)
        acc = t.reshape(r0, V * v, E * e, r2)
    return acc


def merge_tables(cores: Sequence[Tensor], h: int) -> tuple[Tensor, Tensor]:
    """``A (V_a, E_a, r_h)`` from cores ``1..h`` and ``Bt (V_b, r_h, E_b)`` from the rest.

    For ``d = 1``, ``h = 1`` and ``Bt`` is the trivial ``(1, 1, 1)`` ones table.
    """
    A = _merge(cores[:h])[0]  # (V_a, E_a, r_h)
    if h == len(cores):
        return A, A.new_ones(1, 1, 1)
    Bm = _merge(cores[h:])[..., 0]  # (r_h, V_b, E_b)
    return A, Bm.permute(1, 0, 2)


def ttm_lookup(ids: Tensor, cores: Sequence[Tensor], h: int | None = None,
               dedup: bool | None = None,
               rows_fn: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None) -> Tensor:
    """Rows ``E[ids]`` of the TTM table; ``ids`` any shape of int64, returns
    ``(*ids.shape, ∏ e_k)``.

    ``dedup`` (default: on, except while a CUDA graph is being captured) computes each
    distinct id once; its output size depends on the data, so graph capture uses the
    fixed-shape path (one small GEMM per token, same numbers). ``rows_fn(ids, A, Bt)``
    replaces the gather + batched GEMM (``(U, E_a·E_b)`` rows; e.g. the fused Triton
    lookup, ``kernels/ttm_lookup.py``)."""
    rows = [c.shape[1] for c in cores]
    cols = [c.shape[2] for c in cores]
    ranks = [1, *[c.shape[-1] for c in cores[:-1]], 1]
    if min(ranks) == 0:  # a bond of rank 0: every row is zero
        return cores[0].new_zeros(*ids.shape, math.prod(cols))
    if h is None:
        h = split_point(rows, cols, ranks)
    A, Bt = merge_tables(cores, h)
    Vb = math.prod(rows[h:])
    flat = ids.reshape(-1)
    if dedup is None:
        dedup = not (flat.is_cuda and torch.cuda.is_current_stream_capturing())
    if dedup:
        uniq, inv = torch.unique(flat, return_inverse=True)
    else:
        uniq, inv = flat, None
    if rows_fn is not None:
        out = rows_fn(uniq, A, Bt)
    else:
        a = torch.div(uniq, Vb, rounding_mode="floor")
        b = uniq - a * Vb
        out = torch.bmm(A.index_select(0, a), Bt.index_select(0, b))  # (U, E_a, E_b)
        out = out.reshape(uniq.shape[0], math.prod(cols))
    if inv is not None:
        out = out.index_select(0, inv)
    return out.reshape(*ids.shape, math.prod(cols))  # no ids: (…, 0, E), as torch gives


def ttm_lookup_naive(ids: Tensor, cores: Sequence[Tensor]) -> Tensor:
    """Per-token, core-by-core TTM lookup (the unoptimised baseline): for every token,
    gather ``G_k[:, i_k]`` and contract left to right. Same output as :func:`ttm_lookup`."""
    rows = [c.shape[1] for c in cores]
    flat = ids.reshape(-1)
    T = flat.shape[0]
    idx = []
    rem = flat
    for v in reversed(rows):
        idx.append(rem % v)
        rem = torch.div(rem, v, rounding_mode="floor")
    idx = idx[::-1]
    acc = cores[0][:, idx[0]].permute(1, 0, 2, 3).reshape(T, -1, cores[0].shape[-1])
    for k, c in enumerate(cores[1:], start=1):
        s = c[:, idx[k]].permute(1, 0, 2, 3)  # (T, r, e, r')
        r, e, r2 = s.shape[1:]
        acc = torch.bmm(acc, s.reshape(T, r, e * r2)).reshape(T, -1, r2)
    return acc.reshape(*ids.shape, -1)
