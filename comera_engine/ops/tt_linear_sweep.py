"""The TT-linear sweep op: ``X`` meets one core at a time; ``L``/``R`` are never formed.

Cheapest for small batches with large ranks. :class:`TTLinearSweep` is the
``autograd.Function`` (gates absorbed inside, tensors saved by name),
:func:`tt_linear_sweep` its entry point and :func:`tt_linear_sweep_reference` the plain
PyTorch reference it is tested against (tests/test_op_tt_linear_sweep.py; benchmark:
experiments/bench_op_tt_linear_sweep.py). Where the CPU backend is in use
(:func:`comera_engine.backends.cpu_backend`), forward and backward are one C++ call each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import torch
from torch import Tensor

from .. import backends
from .gates import GatedFunction, apply_gates, gate_args, gate_masks, save, saved
from .merges import layout, left_mat, right_mat

__all__ = ["TTLinearSweep", "sweep_merges", "tt_linear_sweep", "tt_linear_sweep_reference"]


def sweep_merges(B: int, ins: Sequence[int], outs: Sequence[int], r: Sequence[int]
                  ) -> tuple[bool, bool]:
    """Whether the sweep merges its two outermost cores on each side first.

    Head: ``H = G_1·G_2`` (``n_1·r_1·n_2·r_2`` MACs, batch independent) replaces the
    steps of ``G_1`` (``r_1·N·B``) and ``G_2`` (``r_2·r_1n_2·rest_2·B``) by one step of
    ``r_2·n_1n_2·rest_2·B``; tail likewise with ``G_{2d-1}·G_{2d}``. Merged when that
    costs no more MACs: one GEMM less per direction, and the first/last steps (inner
    dimension ``n_1`` or output width ``m_d``, slow shapes for BLAS) are gone.
    ``r``: ``[1, r_1, …, r_{2d-1}, 1]``."""
    d = len(ins)
    if d < 2:
        return False, False
    N, M = math.prod(ins), math.prod(outs)
    rest2 = N // (ins[0] * ins[1])
    head_merged = ins[0] * r[1] * ins[1] * r[2] + r[2] * ins[0] * ins[1] * rest2 * B
    head_plain = r[1] * N * B + r[2] * r[1] * ins[1] * rest2 * B
    rows = B * M // (outs[-2] * outs[-1])  # rows meeting G_{2d-1}
    ra, rb = r[2 * d - 2], r[2 * d - 1]
    tail_merged = ra * outs[-2] * rb * outs[-1] + rows * ra * outs[-2] * outs[-1]
    tail_plain = rows * ra * outs[-2] * rb + rows * outs[-2] * rb * outs[-1]
    return head_merged <= head_plain, tail_merged <= tail_plain


@lru_cache(maxsize=4096)
def _sweep_plan(B: int, shapes: tuple[torch.Size, ...], d: int) -> tuple[bool, bool]:
    """:func:`sweep_merges` for the cores of these ``shapes`` (cached per step shape;
    ``torch.compile`` traces the uncached functions, whose caches it would skip with a
    warning)."""
    if torch.compiler.is_compiling():
        return sweep_merges(B, *layout.__wrapped__(shapes, d))
    return sweep_merges(B, *layout(shapes, d))


class TTLinearSweep(GatedFunction, torch.autograd.Function):
    """Core-by-core path: ``X`` meets one core at a time, ``L``/``R`` are never formed.

    Input half, on ``T = Xᵀ`` laid out ``(r_{k-1}·n_k, rest·B)`` (the batch folded into
    the columns, so each core is one plain GEMM):
    ``T_k = G_kᵀ (r_k × r_{k-1}n_k) · T_{k-1}`` -> ``(r_k, rest·B)``, which is already
    ``(r_k·n_{k+1}, rest'·B)`` for the next core; ``T_d = (X·L)ᵀ``. Output half, rows
    ``(B, m_1…m_{j-1})``: ``S_j = S_{j-1} (·, r_{j-1}) · G_j (r_{j-1}, m_j·r_j)``. Batch work
    ``B·Σ_k r_{k-1}n_k r_k·(rest)``: cheapest for small batches with large ranks, where
    merging the halves would cost more than the batch GEMMs. The two outermost cores of
    a side are merged first where that is cheaper (:func:`sweep_merges`). Saves ``Xᵀ``,
    every intermediate (all batch × rank sized), the (gated) cores and the swept
    matrices (views of the cores, or the merged outer pairs), so backward reshapes
    nothing but the running gradient; gates as in :class:`TTLinearHalves`.
    """

    @staticmethod
    def forward(ctx, x: Tensor, d: int, bias: Tensor | None,  # type: ignore[override]
                *tensors: Tensor) -> Tensor:
        ctx.backend = backends.cpu_backend(x, tensors[0])
        if ctx.backend is not None:
            return TTLinearSweep._backend_forward(ctx, x, d, bias, tensors)
        cores = TTLinearSweep._absorb(ctx, tensors, d)
        B = x.shape[0]
        plan = _sweep_plan.__wrapped__ if torch.compiler.is_compiling() else _sweep_plan
        ctx.head, ctx.tail = plan(B, tuple(c.shape for c in cores), d)
        # the swept cores as matrices: input half (r0·n, r1), output half (r0, m·r1);
        # views, built once and saved for backward (no reshapes there)
        ml = [left_mat(c) for c in cores[:d]]
        mr = [right_mat(c) for c in cores[d:]]
        if ctx.head:  # H = G_1·G_2, one (n_1·n_2, r_2) matrix
            ml[:2] = [torch.mm(ml[0], right_mat(cores[1])).view(-1, ml[1].shape[1])]
        if ctx.tail:  # G_{2d-1}·G_{2d}, one (r, m_{d-1}·m_d) matrix
            mr[-2:] = [torch.mm(left_mat(cores[-2]), mr[-1]).view(mr[-2].shape[0], -1)]
        T = x.t().contiguous()  # (N, B)
        ins: list[Tensor] = []
        for A in ml:
            T = T.view(A.shape[0], -1)
            ins.append(T)
            T = torch.mm(A.t(), T)  # (r1, rest·B)
        S = T.t()  # (B, r_d)
        for A in mr:
            S = S.reshape(-1, A.shape[0])  # a view: S is T.t() or a GEMM's output
            ins.append(S)
            S = torch.mm(S, A)  # (B·m_1…m_j, r_j) once reshaped
        y = S.view(B, -1)
        if bias is not None:
            y += bias
        ctx.d, ctx.has_bias, ctx.nl = d, bias is not None, len(ml)
        TTLinearSweep._keep_autocast(ctx, x)
        save(ctx, eff=cores, mats=[*ml, *mr], ins=ins)
        return y

    @staticmethod
    def _backend_forward(ctx, x: Tensor, d: int, bias: Tensor | None,  # noqa: ANN001
                         tensors: Sequence[Tensor]) -> Tensor:
        """The same forward in C++ (the CPU backend): one call instead of ~30 Python-level
        ops. Saves the raw cores, the gated ones, the swept matrices, their inputs and,
        when gated, the gate values and mask."""
        raw, gates, alive, tau = TTLinearSweep._split(ctx, tensors, d)
        ctx.head, ctx.tail = _sweep_plan(x.shape[0], tuple(c.shape for c in raw), d)
        out = ctx.backend.ops.sweep_forward(x, raw, gates, alive, tau, bias, d, ctx.head,
                                            ctx.tail)
        ctx.d, ctx.nl, ctx.has_bias = d, d - ctx.head, bias is not None
        ne = 2 * d - ctx.head - ctx.tail  # matrices swept in all
        TTLinearSweep._keep_autocast(ctx, x)
        save(ctx, raw=raw, eff=out[3 : 3 + 2 * d], mats=out[3 + 2 * d : 3 + 2 * d + ne],
             ins=out[3 + 2 * d + ne :], gm=out[1] if ctx.gated else None,
             m=out[2] if ctx.gated else None)
        return out[0]

    @staticmethod
    def _backend_backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ANN001
        d, n_g = ctx.d, 2 * ctx.d - 1
        s = saved(ctx)
        need = ctx.needs_input_grad
        need_gates = ctx.gated and any(need[3 + 2 * d : 3 + 2 * d + n_g])
        g = ctx.backend.ops.sweep_backward(
            dy, s["raw"], s["eff"], s["mats"], s["ins"], s["gm"], s["m"], d, ctx.nl,
            ctx.head, ctx.tail, need[0], ctx.has_bias and need[2], any(need[3 : 3 + 2 * d]),
            need_gates)
        return TTLinearSweep._finish_backend(ctx, g[0], g[1], g[2 : 2 + 2 * d], g[2 + 2 * d :])

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]  # noqa: ANN001
        return GatedFunction._run_backward(TTLinearSweep._backward, ctx, dy)

    @staticmethod
    def _backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ANN001
        if ctx.backend is not None:
            return TTLinearSweep._backend_backward(ctx, dy)
        d, nl = ctx.d, ctx.nl  # nl: input-side matrices actually swept
        ne = 2 * d - ctx.head - ctx.tail  # matrices swept in all
        s = saved(ctx)
        cores, mats, ins = s["eff"], s["mats"], s["ins"]
        need_x = ctx.needs_input_grad[0]
        need_cores = any(ctx.needs_input_grad[3:])
        dbias = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        d_mat: list[Tensor | None] = [None] * ne
        dS = dy
        for k in range(ne - 1, nl - 1, -1):  # output half, last core first
            A = mats[k]
            dS = dS.reshape(-1, A.shape[1])
            if need_cores:
                d_mat[k] = torch.mm(ins[k].t(), dS)  # (r0, m·r1)
            dS = torch.mm(dS, A.t())  # (rows, r0)
        dT = dS.t()  # (r_d, B)
        for k in range(nl - 1, -1, -1):  # input half
            A = mats[k]
            dT = dT.reshape(A.shape[1], -1)  # a view: dT is dS.t() or a GEMM's output
            if need_cores:
                d_mat[k] = torch.mm(ins[k], dT.t())  # (r0·n, r1)
            if k > 0 or need_x:
                dT = torch.mm(A, dT)  # (r0·n, rest·B)
        dx = dT.view(-1, dy.shape[0]).t() if need_x else None
        grads: list[Tensor | None] = [None] * (2 * d)
        if need_cores:
            lg, rg = d_mat[:nl], d_mat[nl:]
            if ctx.head:  # back through H = G_1·G_2 = P_1·G_2 (P_1 = G_1 as a matrix)
                G1, G2 = cores[0], cores[1]
                dH = lg[0].view(-1, G2.shape[1] * G2.shape[2])  # (n_1, n_2·r_2)
                P1 = left_mat(G1)
                lg = [torch.mm(dH, right_mat(G2).t()), torch.mm(P1.t(), dH), *lg[1:]]
            if ctx.tail:  # back through G_a·G_b = G_a·Q_b (Q_b = G_b as a matrix)
                Ga, Gb = cores[-2], cores[-1]
                dT2 = rg[-1].view(-1, Gb.shape[1])  # (r_a·m_a, m_b)
                Qb = right_mat(Gb)
                rg = [*rg[:-1], torch.mm(dT2, Qb.t()), torch.mm(left_mat(Ga).t(), dT2)]
            grads = [g.view(c.shape) for g, c in zip([*lg, *rg], cores)]
        return TTLinearSweep._finish(ctx, dx, dbias, grads)


def tt_linear_sweep(x: Tensor, cores: Sequence[Tensor], d: int,
                    bias: Tensor | None = None, gates: Sequence[Tensor] | Tensor = (),
                    tau: float = 0.0, alive: Sequence[Tensor] | Tensor = ()) -> Tensor:
    """Core-by-core path (:class:`TTLinearSweep`). ``x``: ``(B, N)``; returns ``(B, M)``
    (``+ bias``). ``gates`` (with ``tau`` and optional ``alive``, as in :func:`tt_linear`)
    are absorbed inside the Function."""
    return TTLinearSweep.apply(x, d, bias, *cores, *gate_args(gates, tau, alive))


def tt_linear_sweep_reference(x: Tensor, cores: Sequence[Tensor], d: int,
                              bias: Tensor | None = None, gates: Sequence[Tensor] = (),
                              tau: float = 0.0, alive: Sequence[Tensor] = ()) -> Tensor:
    """Plain PyTorch (autograd through every op), core by core with ``einsum``: the input
    ``(B, n_1, …, n_d)`` contracted with ``G_1..G_d`` in turn, then expanded through
    ``G_{d+1}..G_{2d}``. ``x``: ``(B, N)``; returns ``(B, M)`` (``+ bias``)."""
    if gates:
        cores = apply_gates(cores, gates, gate_masks(gates, tau, alive or None))
    B = x.shape[0]
    T = x.reshape(B, 1, -1)  # (B, r_0, rest)
    for G in cores[:d]:  # (B, r_{k-1}, n_k, rest) -> (B, r_k, rest)
        r0, n, _ = G.shape
        T = torch.einsum("brnk,rns->bsk", T.reshape(B, r0, n, -1), G)
    S = T.reshape(B, -1)  # (B, r_d)
    for G in cores[d:]:
        r0 = G.shape[0]
        S = torch.einsum("bur,rms->bums", S.reshape(B, -1, r0), G).reshape(B, -1)
    y = S.reshape(B, math.prod(c.shape[1] for c in cores[d:]))
    return y + bias if bias is not None else y
