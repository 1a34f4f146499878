"""Fused TTM embedding lookup in Triton: rows of ``E`` straight from the two merged half
tables, with no gathered copy of them.

``E[(a, b), (i, j)] = Σ_r A[a, i, r] · Bt[b, r, j]`` with ``A`` ``(V_a, E_a, r)`` and
``Bt`` ``(V_b, r, E_b)`` (``ops.ttm_lookup.merge_tables``; gates already absorbed), an id
``v`` being ``a = v // V_b``, ``b = v % V_b``. Two kernels:

* :func:`lookup` - one program per id: loads ``A[a]`` and ``Bt[b]`` once and writes the
  ``(E_a, E_b)`` row with one ``tl.dot`` (fp32 accumulation). The PyTorch path gathers
  ``A[a]`` and ``Bt[b]`` for every id first (``2·U·r·(E_a + E_b)`` elements) and runs a
  batched GEMM.
* :func:`lookup_backward` - ``dA[a] = Σ_{ids with that a} dRow · Bt[b]ᵀ`` and
  ``dBt[b]ᵀ = Σ_{ids with that b} dRowᵀ · A[a]``, both by one kernel
  (:func:`segment_grad_kernel` on transposed views): **sorted segments, no atomics**. The ids
  are ordered by ``a`` (and by ``b``) with a stable sort; one program per row of ``A``
  (of ``Bt``) walks its segment and writes the whole row, zero when no id uses it. So the
  result is the same run to run (deterministic), the grid is fixed (``V_a``, ``V_b``
  programs) and nothing is read back to the host: safe under CUDA-graph capture.

Dedup of ids is the caller's choice (``ops.ttm_lookup`` deduplicates eagerly; under
capture pass the ids as they are: the output size must not depend on data).
:func:`ttm_lookup_fused_reference` is the PyTorch computation the kernels are tested
against (float64, ``TRITON_INTERPRET=1`` on a CPU); :class:`TTMLookupFused` is the
``autograd.Function``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import configs
from .tt_linear import MAX_RANK, precision, upcast

__all__ = ["TTMLookupFused", "lookup", "lookup_backward", "ttm_lookup_fused",
           "ttm_lookup_fused_reference"]


@triton.jit
def _load_tile(P, ii, jj, s_i, s_j, n_i, n_j):
    """The tile ``P[ii, jj]`` (strides ``s_i``, ``s_j``), zero past ``n_i`` rows and
    ``n_j`` columns."""
    return tl.load(P + ii[:, None] * s_i + jj[None, :] * s_j,
                   mask=(ii[:, None] < n_i) & (jj[None, :] < n_j), other=0.0)


@triton.jit
def _store_tile(P, tile, ii, jj, s_i, s_j, n_i, n_j):
    """``P[ii, jj] = tile`` in ``P``'s dtype, within ``n_i`` rows and ``n_j`` columns."""
    tl.store(P + ii[:, None] * s_i + jj[None, :] * s_j, tile.to(P.dtype.element_ty),
             mask=(ii[:, None] < n_i) & (jj[None, :] < n_j))


@triton.jit
def _dot(x, y, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``x · y`` accumulated in fp32 (both upcast first where their dtype asks it)."""
    if UPCAST:
        x, y = x.to(tl.float32), y.to(tl.float32)
    return tl.dot(x, y, input_precision=PRECISION, out_dtype=tl.float32)


@triton.jit
def lookup_kernel(IDS, A, BT, OUT, n_ea, n_r, n_eb, n_vb,
                  s_aa, s_ai, s_ar, s_bb, s_br, s_bj, s_ou, s_oi, s_oj,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_EA: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_EB: tl.constexpr):
    """``OUT[u] = A[a] · Bt[b]`` for the id ``u`` of this program."""
    u = tl.program_id(0)
    v = tl.load(IDS + u)
    a = v // n_vb
    b = v - a * n_vb
    ii = tl.arange(0, BLOCK_EA)
    rr = tl.arange(0, BLOCK_R)
    jj = tl.arange(0, BLOCK_EB)
    at = _load_tile(A + a * s_aa, ii, rr, s_ai, s_ar, n_ea, n_r)
    bt = _load_tile(BT + b * s_bb, rr, jj, s_br, s_bj, n_r, n_eb)
    row = _dot(at, bt, PRECISION, UPCAST)
    _store_tile(OUT + u * s_ou, row, ii, jj, s_oi, s_oj, n_ea, n_eb)


@triton.jit
def segment_grad_kernel(ORDER, START, COUNT, OTHER, G, H, D, n_m, n_n, n_r,
                        s_gu, s_gm, s_gn, s_hv, s_hn, s_hr, s_dv, s_dm, s_dr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """``D[k] = Σ G[u] · H[OTHER[u]]`` over the ids ``u`` of segment ``k`` (this program):
    ``G[u]`` an ``(n_m, n_n)`` tile of the rows' gradient, ``H[v]`` an ``(n_n, n_r)`` tile
    of the other half table. The strides orient each tile: one kernel for both halves'
    gradients (``dA[a] = Σ dRow · Bt[b]ᵀ``, ``dBt[b]ᵀ = Σ dRowᵀ · A[a]``)."""
    k = tl.program_id(0)
    start = tl.load(START + k)
    count = tl.load(COUNT + k)
    mm = tl.arange(0, BLOCK_M)
    nn = tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for t in range(0, count):
        u = tl.load(ORDER + start + t)
        v = tl.load(OTHER + u)
        g = _load_tile(G + u * s_gu, mm, nn, s_gm, s_gn, n_m, n_n)
        h = _load_tile(H + v * s_hv, nn, rr, s_hn, s_hr, n_n, n_r)
        acc += _dot(g, h, PRECISION, UPCAST)
    _store_tile(D + k * s_dv, acc, mm, rr, s_dm, s_dr, n_m, n_r)


def _dtype_name(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _block(n: int) -> int:
    """A tile for ``n``: a power of two, at least 16 (``tl.dot``)."""
    return max(16, triton.next_power_of_2(n))


def _check(A: Tensor, Bt: Tensor) -> tuple[int, int, int, int, int]:
    Va, Ea, r = A.shape
    Vb, r2, Eb = Bt.shape
    if r2 != r:
        raise ValueError(f"Bt: expected rank {r} in dim 1, got shape {tuple(Bt.shape)}")
    if not 1 <= r <= MAX_RANK:
        raise ValueError(f"rank: the fused lookup takes 1 <= r <= {MAX_RANK}, got {r}")
    return Va, Ea, r, Vb, Eb


def lookup(ids: Tensor, A: Tensor, Bt: Tensor) -> Tensor:
    """Rows ``(U, E_a, E_b)`` of the table for ``ids`` ``(U,)`` (int64, each below
    ``V_a·V_b``), in ``A``'s dtype."""
    Va, Ea, r, Vb, Eb = _check(A, Bt)
    out = torch.empty(ids.shape[0], Ea, Eb, dtype=A.dtype, device=A.device)
    if ids.numel() == 0:
        return out
    cfg = configs.config("lookup", (ids.shape[0], Ea, r, Eb), _dtype_name(A))
    lookup_kernel[(ids.shape[0],)](
        ids, A, Bt, out, Ea, r, Eb, Vb, *A.stride(), *Bt.stride(), *out.stride(),
        PRECISION=precision(A), UPCAST=upcast(A), BLOCK_EA=_block(Ea), BLOCK_R=_block(r),
        BLOCK_EB=_block(Eb), **configs.launch_options(cfg))
    return out


def _segments(keys: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """Ids ordered by ``keys`` (stable), and per key value its start and count. The
    counts by an integer ``index_add_`` into ``n`` slots (exact, and no host sync:
    ``bincount`` sizes its output from the keys' max on the host, which a CUDA graph
    capture refuses)."""
    order = torch.sort(keys, stable=True).indices
    count = torch.zeros(n, dtype=torch.long, device=keys.device).index_add_(
        0, keys, torch.ones_like(keys))
    start = torch.cumsum(count, 0) - count
    return order, start, count


def _segment_grad(keys: Tensor, n: int, other: Tensor, G: Tensor, H: Tensor, D: Tensor
                  ) -> None:
    """``D[k] = Σ_{u: keys[u] = k} G[u] · H[other[u]]`` for ``k < n``, written into ``D``
    ``(n, M, r)`` (a view: its strides are what the kernel writes through), ``G``
    ``(U, M, N)``, ``H`` ``(·, N, r)``; zero where no id has key ``k``."""
    order, start, count = _segments(keys, n)
    _, M, N = G.shape
    r = H.shape[2]
    cfg = configs.config("segment_grad", (G.shape[0], M, N, r), _dtype_name(H))
    segment_grad_kernel[(n,)](order, start, count, other, G, H, D, M, N, r, *G.stride(),
                              *H.stride(), *D.stride(), PRECISION=precision(H),
                              UPCAST=upcast(H), BLOCK_M=_block(M), BLOCK_N=_block(N),
                              BLOCK_R=_block(r), **configs.launch_options(cfg))


def lookup_backward(ids: Tensor, grad: Tensor, A: Tensor, Bt: Tensor) -> tuple[Tensor, Tensor]:
    """``(dA, dBt)`` for the rows' gradient ``grad`` ``(U, E_a, E_b)`` (sorted segments:
    deterministic, fixed grid)."""
    Va, _, _, Vb, _ = _check(A, Bt)
    grad = grad.contiguous()
    dA = torch.empty_like(A)
    dBt = torch.empty_like(Bt)
    a = torch.div(ids, Vb, rounding_mode="floor")
    b = torch.remainder(ids, Vb)
    # dA[a] = Σ dRow · Bt[b]ᵀ and dBt[b]ᵀ = Σ dRowᵀ · A[a]: one kernel, transposed views
    _segment_grad(a, Va, b, grad, Bt.transpose(1, 2), dA)
    _segment_grad(b, Vb, a, grad.transpose(1, 2), A, dBt.transpose(1, 2))
    return dA, dBt


class TTMLookupFused(torch.autograd.Function):
    """Rows of the TTM table from the half tables; saves ``ids``, ``A``, ``Bt``."""

    @staticmethod
    def forward(ctx, ids: Tensor, A: Tensor, Bt: Tensor) -> Tensor:  # type: ignore[override]  # noqa: ANN001
        ids = ids.contiguous()
        ctx.save_for_backward(ids, A, Bt)
        return lookup(ids, A, Bt)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]  # noqa: ANN001, ANN205
        ids, A, Bt = ctx.saved_tensors
        dA, dBt = lookup_backward(ids, grad, A, Bt)
        return None, dA, dBt


def ttm_lookup_fused(ids: Tensor, A: Tensor, Bt: Tensor) -> Tensor:
    """Rows ``(U, E_a·E_b)`` of the TTM table for ``ids`` (differentiable in ``A``, ``Bt``)."""
    rows = TTMLookupFused.apply(ids.long(), A, Bt)
    return rows.reshape(rows.shape[0], -1)


def ttm_lookup_fused_reference(ids: Tensor, A: Tensor, Bt: Tensor) -> Tensor:
    """The same in plain PyTorch: gather both halves, one batched GEMM."""
    Vb = Bt.shape[0]
    a = torch.div(ids, Vb, rounding_mode="floor")
    b = torch.remainder(ids, Vb)
    return torch.bmm(A[a], Bt[b]).reshape(ids.shape[0], -1)
