"""Fused TT-linear in Triton: ``Y = (X·L)·R + b`` with the rank-r middle kept on chip.

``L`` ``[N, r]`` and ``R`` ``[r, M]`` are the merged halves of a TT layer (gates already
absorbed, ``ops.tt_linear_halves``). Three kernels, fp32 accumulation for fp32, bf16 and
fp16 inputs, any ``r <= 128`` and sizes that are not multiples of the blocks:

* :func:`chain` - ``mid = A·P`` ``[B, r]``, ``out = mid·Q (+ bias)`` ``[B, M]``: one
  program per block of rows computes its ``mid`` tile (loop over ``K``), keeps it in
  registers and sweeps the output columns (loop over ``M``), as flash-attention does
  without the softmax. The forward is ``chain(X, L, R, b)``; ``dX`` is
  ``chain(dY, Rᵀ, Lᵀ)`` (its ``mid`` is ``dY·Rᵀ``, which ``dL`` needs too).
* :func:`matmul_tn` - ``Aᵀ·G`` ``[I, J]`` with the sum over the batch rows in the kernel:
  ``dR = (X·L)ᵀ·dY`` and ``dL = Xᵀ·(dY·Rᵀ)``.
* :func:`colsum` - ``Σ_rows G`` ``[M]``: the bias gradient.

No launch depends on data and nothing is read back to the host, so a step built from
them can be captured in a CUDA graph. :func:`tt_linear_chain_reference` is the plain
PyTorch computation the kernels are tested against (float64, under
``TRITON_INTERPRET=1`` on a CPU); :class:`TTLinearChain` is the ``autograd.Function``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["MAX_RANK", "TTLinearChain", "chain", "colsum", "matmul_tn",
           "tt_linear_chain", "tt_linear_chain_reference"]

MAX_RANK = 128
BLOCK_B, BLOCK_K, BLOCK_M = 32, 32, 64  # row, reduction and column tiles of chain
BLOCK_I, BLOCK_J, BLOCK_ROWS = 32, 64, 32  # output tiles and row chunk of matmul_tn


@triton.jit
def chain_kernel(A, P, Q, BIAS, OUT, MID, n_rows, n_k, n_r, n_m,
                 s_ab, s_ak, s_pk, s_pr, s_qr, s_qm, s_ob, s_om, s_mb, s_mr,
                 HAS_BIAS: tl.constexpr, SAVE_MID: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr):
    """One block of ``BLOCK_B`` rows: ``mid = A·P`` then ``out = mid·Q (+ bias)``."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    rr = tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    mid = tl.zeros((BLOCK_B, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, n_k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(A + rows[:, None] * s_ab + kk[None, :] * s_ak,
                    mask=row_ok[:, None] & (kk[None, :] < n_k), other=0.0)
        p = tl.load(P + kk[:, None] * s_pk + rr[None, :] * s_pr,
                    mask=(kk[:, None] < n_k) & (rr[None, :] < n_r), other=0.0)
        if UPCAST:
            a, p = a.to(tl.float32), p.to(tl.float32)
        mid += tl.dot(a, p, input_precision=PRECISION, out_dtype=tl.float32)
    if SAVE_MID:
        tl.store(MID + rows[:, None] * s_mb + rr[None, :] * s_mr,
                 mid.to(MID.dtype.element_ty), mask=row_ok[:, None] & (rr[None, :] < n_r))
    mid_in = mid.to(Q.dtype.element_ty)  # the second product at the inputs' precision
    for m0 in range(0, n_m, BLOCK_M):
        mm = m0 + tl.arange(0, BLOCK_M)
        q = tl.load(Q + rr[:, None] * s_qr + mm[None, :] * s_qm,
                    mask=(rr[:, None] < n_r) & (mm[None, :] < n_m), other=0.0)
        if UPCAST:
            out = tl.dot(mid_in.to(tl.float32), q.to(tl.float32), input_precision=PRECISION,
                         out_dtype=tl.float32)
        else:
            out = tl.dot(mid_in, q, input_precision=PRECISION, out_dtype=tl.float32)
        if HAS_BIAS:
            out += tl.load(BIAS + mm, mask=mm < n_m, other=0.0).to(tl.float32)[None, :]
        tl.store(OUT + rows[:, None] * s_ob + mm[None, :] * s_om,
                 out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (mm[None, :] < n_m))


@triton.jit
def matmul_tn_kernel(A, G, C, n_rows, n_i, n_j, s_ab, s_ai, s_gb, s_gj, s_ci, s_cj,
                     PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_I: tl.constexpr,
                     BLOCK_J: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """One ``BLOCK_I × BLOCK_J`` tile of ``C = Aᵀ·G``, summed over every row."""
    ii = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    jj = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    acc = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
    for b0 in range(0, n_rows, BLOCK_ROWS):
        bb = b0 + tl.arange(0, BLOCK_ROWS)
        at = tl.load(A + bb[None, :] * s_ab + ii[:, None] * s_ai,
                     mask=(bb[None, :] < n_rows) & (ii[:, None] < n_i), other=0.0)
        g = tl.load(G + bb[:, None] * s_gb + jj[None, :] * s_gj,
                    mask=(bb[:, None] < n_rows) & (jj[None, :] < n_j), other=0.0)
        if UPCAST:
            at, g = at.to(tl.float32), g.to(tl.float32)
        acc += tl.dot(at, g, input_precision=PRECISION, out_dtype=tl.float32)
    tl.store(C + ii[:, None] * s_ci + jj[None, :] * s_cj, acc.to(C.dtype.element_ty),
             mask=(ii[:, None] < n_i) & (jj[None, :] < n_j))


@triton.jit
def colsum_kernel(G, OUT, n_rows, n_m, s_gb, s_gm, BLOCK_ROWS: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    """``OUT[m] = Σ_b G[b, m]`` for one block of columns."""
    mm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for b0 in range(0, n_rows, BLOCK_ROWS):
        bb = b0 + tl.arange(0, BLOCK_ROWS)
        g = tl.load(G + bb[:, None] * s_gb + mm[None, :] * s_gm,
                    mask=(bb[:, None] < n_rows) & (mm[None, :] < n_m), other=0.0)
        acc += tl.sum(g.to(tl.float32), axis=0)
    tl.store(OUT + mm, acc.to(OUT.dtype.element_ty), mask=mm < n_m)


def precision(x: Tensor) -> str:
    """``tl.dot`` input precision: exact fp32 products for fp32 inputs (no TF32, as
    ``torch.mm`` by default), the tensor cores' native path for bf16 and fp16."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def upcast(x: Tensor) -> bool:
    """Products in fp32 for 16-bit inputs under ``TRITON_INTERPRET=1``: the CPU interpreter
    multiplies bf16/fp16 tiles in ``tl.dot`` wrongly, while its loads, stores and casts
    are exact, so the interpreted kernels keep every rounding point of the compiled ones
    but the tensor-core product itself (Triton's own, checked on a GPU)."""
    return x.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1"


def rank_block(r: int) -> int:
    """The rank tile: ``r`` rounded up to a power of two, at least 16 (``tl.dot``)."""
    if not 1 <= r <= MAX_RANK:
        raise ValueError(f"rank: the fused kernels take 1 <= r <= {MAX_RANK}, got {r}")
    return max(16, triton.next_power_of_2(r))


def chain(a: Tensor, p: Tensor, q: Tensor, bias: Tensor | None = None,
          save_mid: bool = False) -> tuple[Tensor, Tensor | None]:
    """``(a·p)·q + bias`` ``[B, M]`` and, with ``save_mid``, ``a·p`` ``[B, r]``.

    Shapes: ``a [B, K]``, ``p [K, r]``, ``q [r, M]``, ``bias [M]``; outputs in ``a``'s dtype.
    """
    n_rows, n_k = a.shape
    n_r, n_m = q.shape
    if p.shape != (n_k, n_r):
        raise ValueError(f"p: expected shape {(n_k, n_r)}, got {tuple(p.shape)}")
    out = torch.empty(n_rows, n_m, dtype=a.dtype, device=a.device)
    mid = torch.empty(n_rows, n_r, dtype=a.dtype, device=a.device) if save_mid else out
    grid = (triton.cdiv(n_rows, BLOCK_B),)
    chain_kernel[grid](
        a, p, q, bias if bias is not None else out, out, mid, n_rows, n_k, n_r, n_m,
        a.stride(0), a.stride(1), p.stride(0), p.stride(1), q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), mid.stride(0), mid.stride(1),
        HAS_BIAS=bias is not None, SAVE_MID=save_mid, PRECISION=precision(a), UPCAST=upcast(a),
        BLOCK_B=BLOCK_B, BLOCK_K=BLOCK_K,
        BLOCK_R=rank_block(n_r), BLOCK_M=BLOCK_M)
    return out, (mid if save_mid else None)


def matmul_tn(a: Tensor, g: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """``aᵀ·g`` ``[I, J]`` for ``a [B, I]``, ``g [B, J]`` (the batch sum in the kernel)."""
    n_rows, n_i = a.shape
    n_j = g.shape[1]
    c = torch.empty(n_i, n_j, dtype=out_dtype or a.dtype, device=a.device)
    grid = (triton.cdiv(n_i, BLOCK_I), triton.cdiv(n_j, BLOCK_J))
    matmul_tn_kernel[grid](a, g, c, n_rows, n_i, n_j, a.stride(0), a.stride(1), g.stride(0),
                           g.stride(1), c.stride(0), c.stride(1), PRECISION=precision(a),
                           UPCAST=upcast(a), BLOCK_I=BLOCK_I, BLOCK_J=BLOCK_J,
                           BLOCK_ROWS=BLOCK_ROWS)
    return c


def colsum(g: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """``Σ_rows g`` ``[M]`` for ``g [B, M]``."""
    n_rows, n_m = g.shape
    out = torch.empty(n_m, dtype=out_dtype or g.dtype, device=g.device)
    colsum_kernel[(triton.cdiv(n_m, BLOCK_M),)](g, out, n_rows, n_m, g.stride(0), g.stride(1),
                                                BLOCK_ROWS=BLOCK_ROWS, BLOCK_M=BLOCK_M)
    return out


class TTLinearChain(torch.autograd.Function):
    """``y = (x·L)·R + bias`` on the fused kernels; saves ``x``, ``x·L``, ``L``, ``R``."""

    @staticmethod
    def forward(ctx, x: Tensor, L: Tensor, R: Tensor,  # type: ignore[override]  # noqa: ANN001
                bias: Tensor | None) -> Tensor:
        y, xl = chain(x, L, R, bias, save_mid=True)
        ctx.save_for_backward(x, xl, L, R)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]  # noqa: ANN001, ANN205
        x, xl, L, R = ctx.saved_tensors
        dy = dy.contiguous()
        dx, dxr = chain(dy, R.t(), L.t(), None, save_mid=True)  # dX = (dY·Rᵀ)·Lᵀ
        d_l = matmul_tn(x, dxr, L.dtype)  # Xᵀ·(dY·Rᵀ)
        d_r = matmul_tn(xl, dy, R.dtype)  # (X·L)ᵀ·dY
        d_b = colsum(dy) if ctx.has_bias else None
        return dx, d_l, d_r, d_b


def tt_linear_chain(x: Tensor, L: Tensor, R: Tensor, bias: Tensor | None = None) -> Tensor:
    """``(x·L)·R + bias`` for ``x [..., N]`` on the fused kernels (differentiable)."""
    lead = x.shape[:-1]
    y = TTLinearChain.apply(x.reshape(-1, x.shape[-1]).contiguous(), L, R, bias)
    return y.reshape(*lead, R.shape[1])


def tt_linear_chain_reference(x: Tensor, L: Tensor, R: Tensor,
                              bias: Tensor | None = None) -> Tensor:
    """The same computation in plain PyTorch (the kernels' reference)."""
    y = (x @ L) @ R
    return y + bias if bias is not None else y
