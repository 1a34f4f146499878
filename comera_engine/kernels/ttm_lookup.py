"""Fused TTM embedding lookup in Triton: rows of ``E`` straight from the two merged half
tables, with no gathered copy of them.

``E[(a, b), (i, j)] = Σ_r A[a, i, r] · Bt[b, r, j]`` with ``A`` ``(V_a, E_a, r)`` and
``Bt`` ``(V_b, r, E_b)`` (``ops.ttm_lookup.merge_tables``; gates already absorbed), an id
``v`` being ``a = v // V_b``, ``b = v % V_b``. Three kernels:

* :func:`lookup` - one program per id: loads ``A[a]`` and ``Bt[b]`` once and writes the
  ``(E_a, E_b)`` row with one ``tl.dot`` (fp32 accumulation). The PyTorch path gathers
  ``A[a]`` and ``Bt[b]`` for every id first (``2·U·r·(E_a + E_b)`` elements) and runs a
  batched GEMM.
* :func:`lookup_backward` - ``dA[a] = Σ_{ids with that a} dRow · Bt[b]ᵀ`` and
  ``dBt[b] = Σ_{ids with that b} A[a]ᵀ · dRow``: **sorted segments, no atomics**. The ids
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

from .tt_linear import MAX_RANK, precision, upcast

__all__ = ["TTMLookupFused", "lookup", "lookup_backward", "ttm_lookup_fused",
           "ttm_lookup_fused_reference"]


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
    at = tl.load(A + a * s_aa + ii[:, None] * s_ai + rr[None, :] * s_ar,
                 mask=(ii[:, None] < n_ea) & (rr[None, :] < n_r), other=0.0)
    bt = tl.load(BT + b * s_bb + rr[:, None] * s_br + jj[None, :] * s_bj,
                 mask=(rr[:, None] < n_r) & (jj[None, :] < n_eb), other=0.0)
    if UPCAST:
        at, bt = at.to(tl.float32), bt.to(tl.float32)
    row = tl.dot(at, bt, input_precision=PRECISION, out_dtype=tl.float32)
    tl.store(OUT + u * s_ou + ii[:, None] * s_oi + jj[None, :] * s_oj,
             row.to(OUT.dtype.element_ty), mask=(ii[:, None] < n_ea) & (jj[None, :] < n_eb))


@triton.jit
def grad_a_kernel(IDS, ORDER, START, COUNT, G, BT, DA, n_ea, n_r, n_eb, n_vb,
                  s_gu, s_gi, s_gj, s_bb, s_br, s_bj, s_da, s_di, s_dr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_EA: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_EB: tl.constexpr):
    """``dA[a] = Σ dRow[u] · Bt[b(u)]ᵀ`` over the ids ``u`` of row ``a`` (its segment)."""
    a = tl.program_id(0)
    start = tl.load(START + a)
    count = tl.load(COUNT + a)
    ii = tl.arange(0, BLOCK_EA)
    rr = tl.arange(0, BLOCK_R)
    jj = tl.arange(0, BLOCK_EB)
    acc = tl.zeros((BLOCK_EA, BLOCK_R), dtype=tl.float32)
    for t in range(0, count):
        u = tl.load(ORDER + start + t)
        b = tl.load(IDS + u) % n_vb
        g = tl.load(G + u * s_gu + ii[:, None] * s_gi + jj[None, :] * s_gj,
                    mask=(ii[:, None] < n_ea) & (jj[None, :] < n_eb), other=0.0)
        btt = tl.load(BT + b * s_bb + jj[:, None] * s_bj + rr[None, :] * s_br,
                      mask=(jj[:, None] < n_eb) & (rr[None, :] < n_r), other=0.0)
        if UPCAST:
            g, btt = g.to(tl.float32), btt.to(tl.float32)
        acc += tl.dot(g, btt, input_precision=PRECISION, out_dtype=tl.float32)
    tl.store(DA + a * s_da + ii[:, None] * s_di + rr[None, :] * s_dr,
             acc.to(DA.dtype.element_ty), mask=(ii[:, None] < n_ea) & (rr[None, :] < n_r))


@triton.jit
def grad_b_kernel(IDS, ORDER, START, COUNT, G, A, DB, n_ea, n_r, n_eb, n_vb,
                  s_gu, s_gi, s_gj, s_aa, s_ai, s_ar, s_db, s_dr, s_dj,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_EA: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_EB: tl.constexpr):
    """``dBt[b] = Σ A[a(u)]ᵀ · dRow[u]`` over the ids ``u`` of row ``b`` (its segment)."""
    b = tl.program_id(0)
    start = tl.load(START + b)
    count = tl.load(COUNT + b)
    ii = tl.arange(0, BLOCK_EA)
    rr = tl.arange(0, BLOCK_R)
    jj = tl.arange(0, BLOCK_EB)
    acc = tl.zeros((BLOCK_R, BLOCK_EB), dtype=tl.float32)
    for t in range(0, count):
        u = tl.load(ORDER + start + t)
        a = tl.load(IDS + u) // n_vb
        att = tl.load(A + a * s_aa + rr[:, None] * s_ar + ii[None, :] * s_ai,
                      mask=(rr[:, None] < n_r) & (ii[None, :] < n_ea), other=0.0)
        g = tl.load(G + u * s_gu + ii[:, None] * s_gi + jj[None, :] * s_gj,
                    mask=(ii[:, None] < n_ea) & (jj[None, :] < n_eb), other=0.0)
        if UPCAST:
            att, g = att.to(tl.float32), g.to(tl.float32)
        acc += tl.dot(att, g, input_precision=PRECISION, out_dtype=tl.float32)
    tl.store(DB + b * s_db + rr[:, None] * s_dr + jj[None, :] * s_dj,
             acc.to(DB.dtype.element_ty), mask=(rr[:, None] < n_r) & (jj[None, :] < n_eb))


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
    lookup_kernel[(ids.shape[0],)](
        ids, A, Bt, out, Ea, r, Eb, Vb, *A.stride(), *Bt.stride(), *out.stride(),
        PRECISION=precision(A), UPCAST=upcast(A), BLOCK_EA=_block(Ea), BLOCK_R=_block(r),
        BLOCK_EB=_block(Eb))
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


def lookup_backward(ids: Tensor, grad: Tensor, A: Tensor, Bt: Tensor) -> tuple[Tensor, Tensor]:
    """``(dA, dBt)`` for the rows' gradient ``grad`` ``(U, E_a, E_b)`` (sorted segments:
    deterministic, fixed grid)."""
    Va, Ea, r, Vb, Eb = _check(A, Bt)
    grad = grad.contiguous()
    dA = torch.empty_like(A)
    dBt = torch.empty_like(Bt)
    blocks = dict(PRECISION=precision(A), UPCAST=upcast(A), BLOCK_EA=_block(Ea),
                  BLOCK_R=_block(r), BLOCK_EB=_block(Eb))
    order, start, count = _segments(torch.div(ids, Vb, rounding_mode="floor"), Va)
    grad_a_kernel[(Va,)](ids, order, start, count, grad, Bt, dA, Ea, r, Eb, Vb,
                         *grad.stride(), *Bt.stride(), *dA.stride(), **blocks)
    order, start, count = _segments(torch.remainder(ids, Vb), Vb)
    grad_b_kernel[(Vb,)](ids, order, start, count, grad, A, dBt, Ea, r, Eb, Vb,
                         *grad.stride(), *A.stride(), *dBt.stride(), **blocks)
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
