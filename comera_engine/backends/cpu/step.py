"""CPU backend, the halves step's batch GEMMs: the six products in the install's ways, or
row-blocked in C++ (``csrc/tt_halves_batch.cpp``) where the install chose that.

Called by :mod:`comera_engine.ops.tt_linear_halves` through the backend
(:meth:`.CPUBackend.batch_forward`, :meth:`.CPUBackend.batch_backward`) and by the
build's timing (:mod:`.tune`); shapes as there: ``x`` ``(B, N)``, ``Lp`` ``(N, r_p)``,
``Rp`` ``(r_p, M)``, ``dy`` ``(B, M)``.
"""

from __future__ import annotations

from types import ModuleType

from torch import Tensor

from .gemm import Ways

__all__ = ["BLOCK_ROWS", "batch_backward", "batch_forward"]

BLOCK_ROWS = 512
"""Rows per block of the row-blocked step (blocks of 256-1024 rows timed within 0.1 ms
of each other at 768×768, rank 30, 4096 rows; git show 1127e36:docs/BENCHMARKS.md)."""


def batch_forward(ops: ModuleType, ways: Ways, x: Tensor, Lp: Tensor, Rp: Tensor,
                  ones_col: int) -> tuple[Tensor, Tensor]:
    """``XL = X·Lp`` (column ``ones_col`` set to one where ``>= 0``: it meets the bias
    row of ``Rp``), ``Y = XL·Rp``; returns ``(Y, XL)``."""
    if ways.blocked("halves-fwd", x):
        y, XL = ops.halves_batch_forward(x, Lp, Rp, ones_col, BLOCK_ROWS)
        return y, XL
    XL = ways.product("xl", x, Lp)
    if ones_col >= 0:
        XL[:, ones_col] = 1.0
    return ways.product("y", XL, Rp), XL


def batch_backward(ops: ModuleType, ways: Ways, dy: Tensor, x: Tensor, XL: Tensor,
                   Lp: Tensor, Rp: Tensor, need_x: bool, need_w: bool
                   ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``dXL = dY·Rpᵀ``, then ``dX = dXL·Lpᵀ`` (if ``need_x``), ``dRp = XLᵀ·dY`` and
    ``dLp = Xᵀ·dXL`` (if ``need_w``); returns ``(dX, dLp, dRp)``, None where not asked
    for."""
    if ways.blocked("halves-bwd", x):
        dx, dL, dR, _ = ops.halves_batch_backward(dy, x, XL, Lp, Rp, need_x, need_w,
                                                  BLOCK_ROWS)
        return dx, dL, dR
    dXL = ways.product("dxl", dy, Rp)
    # dR while dY is hot. Fixed rule (small batches): MKL runs (dYᵀ·XL)ᵀ faster when the
    # width is a multiple of 16 (the padded case) and up to 5× slower otherwise on Zen 4
    dR = ways.product("dr", XL, dy, default=int(XL.shape[1] % 16 == 0)) if need_w else None
    dx = ways.product("dx", dXL, Lp) if need_x else None
    dL = ways.product("dl", x, dXL) if need_w else None
    return dx, dL, dR
