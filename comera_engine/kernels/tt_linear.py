"""Fused TT-linear in Triton: ``Y = (X·L)·R + b`` with the rank-r middle kept on chip.

``L`` ``[N, r]`` and ``R`` ``[r, M]`` are the merged halves of a TT layer (gates already
absorbed, ``ops.tt_linear_halves``). Three kernels, fp32 accumulation for fp32, bf16 and
fp16 inputs, any ``r <= 128`` and sizes that are not multiples of the blocks:

* :func:`chain` - ``mid = A·P`` ``[B, r]``, ``out = mid·Q (+ bias)`` ``[B, M]``: one
  program per block of rows and group of output columns computes its ``mid`` tile (loop
  over ``K``), keeps it in registers and sweeps its columns (loop over ``M``), as
  flash-attention does without the softmax. With ``SPLIT`` column groups, ``mid`` is
  computed ``SPLIT`` times (``B·K·r`` MACs each, small) for ``SPLIT`` times the programs.
  The forward is ``chain(X, L, R, b)``; ``dX`` is ``chain(dY, Rᵀ, Lᵀ)`` (its ``mid`` is
  ``dY·Rᵀ``, which ``dL`` needs too).
* :func:`matmul_tn` - ``Aᵀ·G`` ``[I, J]`` with the sum over the batch rows in the kernel,
  split over ``SPLIT`` groups of rows whose fp32 partial sums are added after:
  ``dR = (X·L)ᵀ·dY`` and ``dL = Xᵀ·(dY·Rᵀ)``.
* :func:`colsum` - ``Σ_rows G`` ``[M]``: the bias gradient (row groups likewise).

The tiles, splits and warps of each launch come from :mod:`.configs` (the defaults, or a
device profile's tuned table). No launch depends on data and nothing is read back to
the host, so a step built from them can be captured in a CUDA graph.
:func:`tt_linear_chain_reference` is the plain PyTorch computation the kernels are
tested against (float64, under ``TRITON_INTERPRET=1`` on a CPU, every candidate
configuration); :class:`TTLinearChain` is the ``autograd.Function``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import configs

__all__ = ["MAX_RANK", "TTLinearChain", "chain", "colsum", "matmul_tn",
           "tt_linear_chain", "tt_linear_chain_reference"]

MAX_RANK = 128
# the default tiles (configs.DEFAULTS): row, reduction and column tiles of chain; output
# tiles and row chunk of matmul_tn
BLOCK_B, BLOCK_K, BLOCK_M = (configs.DEFAULTS["chain"][k] for k in ("BLOCK_B", "BLOCK_K",
                                                                    "BLOCK_M"))
BLOCK_I, BLOCK_J, BLOCK_ROWS = (configs.DEFAULTS["matmul_tn"][k]
                                for k in ("BLOCK_I", "BLOCK_J", "BLOCK_ROWS"))


@triton.jit
def chain_kernel(A, P, Q, BIAS, OUT, MID, n_rows, n_k, n_r, n_m, n_split,
                 s_ab, s_ak, s_pk, s_pr, s_qr, s_qm, s_ob, s_om, s_mb, s_mr,
                 HAS_BIAS: tl.constexpr, SAVE_MID: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr):
    """One block of ``BLOCK_B`` rows and column group ``program_id(1)`` of ``n_split``
    (the column tiles ``g, g + n_split, …``): ``mid = A·P`` then ``out = mid·Q (+ bias)``;
    group 0 stores ``mid``."""
    group = tl.program_id(1)
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
    if SAVE_MID:  # by group 0 alone: the other groups' rows end at 0
        mid_rows = tl.where(group == 0, n_rows, 0)
        tl.store(MID + rows[:, None] * s_mb + rr[None, :] * s_mr,
                 mid.to(MID.dtype.element_ty),
                 mask=(rows[:, None] < mid_rows) & (rr[None, :] < n_r))
    mid_in = mid.to(Q.dtype.element_ty)  # the second product at the inputs' precision
    for m0 in range(group * BLOCK_M, n_m, n_split * BLOCK_M):
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
def matmul_tn_kernel(A, G, C, n_rows, n_i, n_j, rows_per, s_ab, s_ai, s_gb, s_gj, s_cs,
                     s_ci, s_cj, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                     BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """One ``BLOCK_I × BLOCK_J`` tile of ``C[s] = Aᵀ·G`` summed over the rows of group
    ``s = program_id(2)`` (rows ``s·rows_per`` up to the next group's)."""
    ii = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    jj = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    first = tl.program_id(2) * rows_per
    last = tl.minimum(first + rows_per, n_rows)
    C += tl.program_id(2) * s_cs
    acc = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
    for b0 in range(first, last, BLOCK_ROWS):
        bb = b0 + tl.arange(0, BLOCK_ROWS)
        at = tl.load(A + bb[None, :] * s_ab + ii[:, None] * s_ai,
                     mask=(bb[None, :] < last) & (ii[:, None] < n_i), other=0.0)
        g = tl.load(G + bb[:, None] * s_gb + jj[None, :] * s_gj,
                    mask=(bb[:, None] < last) & (jj[None, :] < n_j), other=0.0)
        if UPCAST:
            at, g = at.to(tl.float32), g.to(tl.float32)
        acc += tl.dot(at, g, input_precision=PRECISION, out_dtype=tl.float32)
    tl.store(C + ii[:, None] * s_ci + jj[None, :] * s_cj, acc.to(C.dtype.element_ty),
             mask=(ii[:, None] < n_i) & (jj[None, :] < n_j))


@triton.jit
def colsum_kernel(G, OUT, n_rows, n_m, rows_per, s_gb, s_gm, s_os,
                  BLOCK_ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    """``OUT[s, m] = Σ_b G[b, m]`` for one block of columns over the rows of group
    ``s = program_id(1)``."""
    mm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    first = tl.program_id(1) * rows_per
    last = tl.minimum(first + rows_per, n_rows)
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for b0 in range(first, last, BLOCK_ROWS):
        bb = b0 + tl.arange(0, BLOCK_ROWS)
        g = tl.load(G + bb[:, None] * s_gb + mm[None, :] * s_gm,
                    mask=(bb[:, None] < last) & (mm[None, :] < n_m), other=0.0)
        acc += tl.sum(g.to(tl.float32), axis=0)
    tl.store(OUT + tl.program_id(1) * s_os + mm, acc.to(OUT.dtype.element_ty), mask=mm < n_m)


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


def _dtype_name(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _row_groups(n_rows: int, split: int, block: int) -> tuple[int, int]:
    """``(groups, rows per group)``: at most ``split`` groups of whole ``block``s."""
    per = triton.cdiv(triton.cdiv(n_rows, max(1, split)), block) * block
    return max(1, triton.cdiv(n_rows, per)), per


def chain(a: Tensor, p: Tensor, q: Tensor, bias: Tensor | None = None,
          save_mid: bool = False, cfg: dict | None = None) -> tuple[Tensor, Tensor | None]:
    """``(a·p)·q + bias`` ``[B, M]`` and, with ``save_mid``, ``a·p`` ``[B, r]``.

    Shapes: ``a [B, K]``, ``p [K, r]``, ``q [r, M]``, ``bias [M]``; outputs in ``a``'s dtype.
    ``cfg``: the launch configuration (default :func:`.configs.config` for the shape).
    """
    n_rows, n_k = a.shape
    n_r, n_m = q.shape
    if p.shape != (n_k, n_r):
        raise ValueError(f"p: expected shape {(n_k, n_r)}, got {tuple(p.shape)}")
    cfg = cfg or configs.config("chain", (n_rows, n_k, n_r, n_m), _dtype_name(a))
    out = torch.empty(n_rows, n_m, dtype=a.dtype, device=a.device)
    mid = torch.empty(n_rows, n_r, dtype=a.dtype, device=a.device) if save_mid else out
    split = max(1, min(int(cfg["SPLIT"]), triton.cdiv(n_m, cfg["BLOCK_M"])))
    grid = (triton.cdiv(n_rows, cfg["BLOCK_B"]), split)
    chain_kernel[grid](
        a, p, q, bias if bias is not None else out, out, mid, n_rows, n_k, n_r, n_m, split,
        a.stride(0), a.stride(1), p.stride(0), p.stride(1), q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), mid.stride(0), mid.stride(1),
        HAS_BIAS=bias is not None, SAVE_MID=save_mid, PRECISION=precision(a), UPCAST=upcast(a),
        BLOCK_B=cfg["BLOCK_B"], BLOCK_K=cfg["BLOCK_K"], BLOCK_R=rank_block(n_r),
        BLOCK_M=cfg["BLOCK_M"], **configs.launch_options(cfg))
    return out, (mid if save_mid else None)


def matmul_tn(a: Tensor, g: Tensor, out_dtype: torch.dtype | None = None,
              cfg: dict | None = None) -> Tensor:
    """``aᵀ·g`` ``[I, J]`` for ``a [B, I]``, ``g [B, J]`` (the batch sum in the kernel; with
    ``SPLIT`` row groups, fp32 partial sums added after)."""
    n_rows, n_i = a.shape
    n_j = g.shape[1]
    cfg = cfg or configs.config("matmul_tn", (n_rows, n_i, n_j), _dtype_name(a))
    groups, per = _row_groups(n_rows, int(cfg["SPLIT"]), cfg["BLOCK_ROWS"])
    dtype = out_dtype or a.dtype
    c = torch.empty(groups, n_i, n_j, dtype=dtype if groups == 1 else torch.float32,
                    device=a.device)
    grid = (triton.cdiv(n_i, cfg["BLOCK_I"]), triton.cdiv(n_j, cfg["BLOCK_J"]), groups)
    matmul_tn_kernel[grid](a, g, c, n_rows, n_i, n_j, per, a.stride(0), a.stride(1),
                           g.stride(0), g.stride(1), *c.stride(), PRECISION=precision(a),
                           UPCAST=upcast(a), BLOCK_I=cfg["BLOCK_I"], BLOCK_J=cfg["BLOCK_J"],
                           BLOCK_ROWS=cfg["BLOCK_ROWS"], **configs.launch_options(cfg))
    return c[0] if groups == 1 else c.sum(0).to(dtype)


def colsum(g: Tensor, out_dtype: torch.dtype | None = None, cfg: dict | None = None
           ) -> Tensor:
    """``Σ_rows g`` ``[M]`` for ``g [B, M]``."""
    n_rows, n_m = g.shape
    cfg = cfg or configs.config("colsum", (n_rows, n_m), _dtype_name(g))
    groups, per = _row_groups(n_rows, int(cfg["SPLIT"]), cfg["BLOCK_ROWS"])
    dtype = out_dtype or g.dtype
    out = torch.empty(groups, n_m, dtype=dtype if groups == 1 else torch.float32,
                      device=g.device)
    colsum_kernel[(triton.cdiv(n_m, cfg["BLOCK_M"]), groups)](
        g, out, n_rows, n_m, per, g.stride(0), g.stride(1), out.stride(0),
        BLOCK_ROWS=cfg["BLOCK_ROWS"], BLOCK_M=cfg["BLOCK_M"], **configs.launch_options(cfg))
    return out[0] if groups == 1 else out.sum(0).to(dtype)


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
