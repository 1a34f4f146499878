"""Contraction planning for the TT-linear product ``Y = X · W``, ``X ∈ R^{B×N}``, ``W ∈ R^{N×M}``.

``W`` is held as cores ``G_1..G_{2d}`` of shapes ``(r_{k-1}, s_k, r_k)`` with
``s = (n_1..n_d, m_1..m_d)``. Three paths compute ``Y``:

* ``halves``: ``L = G_1⋯G_d ∈ R^{N×r_d}``, ``R = G_{d+1}⋯G_{2d} ∈ R^{r_d×M}``,
  ``Y = (X·L)·R``. Batch work ``B·r_d·(N+M)`` MACs; merges are batch independent.
  Runs through :class:`TTLinearHalves`, a custom ``autograd.Function`` that saves only
  the input, ``X·L`` and the merge prefixes/suffixes.
* ``sweep``: contract ``X`` with one core at a time (no merged halves); cheapest when the
  batch is small and the ranks are large.
* ``dense``: reconstruct ``W`` and do one GEMM; wins only when ``r_d`` is close to full rank.

A cost model (MACs and bytes moved, forward and backward, plus a per-kernel launch cost)
estimates each path's time on the device and :func:`plan` picks the cheapest, caching the
choice per (shapes, ranks, batch, device, dtype, training). :func:`explain` returns the
numbers behind the choice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache

import torch
from torch import Tensor

from . import gemm
from . import native as native_ops

__all__ = [
    "PATHS",
    "apply_gates",
    "gate_masks",
    "DeviceModel",
    "PathCost",
    "TTLinearHalves",
    "TTLinearSweep",
    "estimate",
    "explain",
    "merge_left",
    "merge_left_grads",
    "merge_right",
    "merge_right_grads",
    "plan",
    "tt_linear",
    "tt_linear_dense",
    "tt_linear_halves",
    "tt_linear_sweep",
]

PATHS = ("halves", "sweep", "dense")


# ---------------------------------------------------------------------------- gates
def apply_gates(cores: Sequence[Tensor], gates: Sequence[Tensor],
                masks: Sequence[Tensor]) -> list[Tensor]:
    """Absorb masked rank gates into the cores' right bonds: ``G_k · diag(g_k ⊙ m_k)``.

    ``cores[k]``: ``(r_{k-1}, …, r_k)`` for ``k < K``; ``gates[k]``, ``masks[k]`` (bool):
    ``(r_k,)`` for the ``K-1`` internal bonds. The last core is returned as is.
    Differentiable in cores and gates; masked entries give and get exactly zero.
    """
    return _scale_bonds(cores, [g * m.to(g.dtype) for g, m in zip(gates, masks)])


def _scale_bonds(cores: Sequence[Tensor], vecs: Sequence[Tensor]) -> list[Tensor]:
    """``G_k · diag(v_k)`` for the first ``len(vecs)`` cores; the rest as they are."""
    return [*(c * v for c, v in zip(cores, vecs)), *cores[len(vecs):]]


@lru_cache(maxsize=16)
def _gate_plan(d: int) -> tuple[tuple[int, bool], ...]:
    """Where each bond ``k`` (0-based, between cores ``k`` and ``k+1`` of ``2d``) is
    absorbed inside the Functions: ``(k, True)``, the right bond of core ``k``, on the
    input half and for the middle bond; ``(k+1, False)``, the left bond of core ``k+1``,
    on the output half (the outer, smaller core of the two)."""
    return tuple((k, True) if k < d else (k + 1, False) for k in range(2 * d - 1))


def _flat_mask(g: Tensor, tau: float, alive: Sequence[Tensor] = ()) -> Tensor:
    """``alive & (|g| > tau)`` over the concatenated gates ``g`` (bool, same length)."""
    m = g.abs() > tau
    if alive:
        m &= torch.cat(list(alive))
    return m


def gate_masks(gates: Sequence[Tensor], tau: float,
               alive: Sequence[Tensor] | None = None) -> list[Tensor]:
    """Per bond, the active gate entries: ``alive_k & (|g_k| > tau)`` (bool ``(r_k,)``).

    ``gates``: the ``K-1`` gate vectors; ``alive``: matching bool vectors (entries pruned
    for good are False) or None for all alive. One pass over all bonds."""
    if not gates:
        return []
    with torch.no_grad():
        m = _flat_mask(torch.cat(list(gates)), tau, alive or ())
    return list(m.split([int(g.shape[0]) for g in gates]))


# ---------------------------------------------------------------------------- merges
def _left_mat(G: Tensor) -> Tensor:
    """A core ``(r0, n, r1)`` as the ``(r0·n, r1)`` matrix (a view when contiguous)."""
    return G.reshape(-1, G.shape[-1])


def _right_mat(G: Tensor) -> Tensor:
    """A core ``(r0, n, r1)`` as the ``(r0, n·r1)`` matrix (a view when contiguous)."""
    return G.reshape(G.shape[0], -1)


def merge_left(cores: Sequence[Tensor]) -> list[Tensor]:
    """Prefixes of the input half: ``P_k = G_1⋯G_k`` as ``(n_1⋯n_k, r_k)`` matrices.

    ``cores[k]`` has shape ``(r_{k-1}, n_k, r_k)``; returns ``[P_1, …, P_d]``, ``P_d = L``.
    """
    P = cores[0].reshape(-1, cores[0].shape[-1])
    out = [P]
    for G in cores[1:]:
        r0, n, r1 = G.shape
        P = (P @ G.reshape(r0, n * r1)).reshape(-1, r1)
        out.append(P)
    return out


def merge_right(cores: Sequence[Tensor]) -> list[Tensor]:
    """Suffixes of the output half: ``Q_j = G_j⋯G_{2d}`` as ``(r_{j-1}, m_j⋯m_d)``.

    ``cores[j]`` has shape ``(r_{j-1}, m_j, r_j)``; returns ``[Q_1, …, Q_d]`` (first = R).
    """
    Q = cores[-1].reshape(cores[-1].shape[0], -1)
    out = [Q]
    for G in reversed(cores[:-1]):
        r0, m, r1 = G.shape
        Q = (G.reshape(r0 * m, r1) @ Q).reshape(r0, -1)
        out.append(Q)
    return out[::-1]


def merge_left_grads(cores: Sequence[Tensor], P: Sequence[Tensor], dL: Tensor
                     ) -> list[Tensor]:
    """Backward of :func:`merge_left`: each core's gradient from ``dL`` (the gradient of
    ``L = P_d``, ``n_1⋯n_d·r_d`` elements), given the prefixes ``P_1..P_{d-1}``.
    ``P_k = P_{k-1}·G_k`` with ``P_{k-1}``: ``(a, r)``, ``G_k``: ``(r, n·r')``."""
    grads: list = [None] * len(cores)  # every entry is filled below
    dP = dL
    for k in range(len(cores) - 1, 0, -1):
        G = cores[k]
        r0, n, r1 = G.shape
        dPk = dP.reshape(-1, n * r1)
        grads[k] = (P[k - 1].t() @ dPk).reshape(G.shape)
        dP = dPk @ G.reshape(r0, n * r1).t()
    grads[0] = dP.reshape(cores[0].shape)
    return grads


def merge_right_grads(cores: Sequence[Tensor], Q: Sequence[Tensor], dR: Tensor
                      ) -> list[Tensor]:
    """Backward of :func:`merge_right`: each core's gradient from ``dR`` (the gradient of
    ``R = Q_1``, ``r_0·m_1⋯m_d`` elements), given the suffixes ``Q_2..Q_d``.
    ``Q_j = G_j·Q_{j+1}`` with ``G_j``: ``(r·m, r')``, ``Q_{j+1}``: ``(r', rest)``."""
    grads: list = [None] * len(cores)  # every entry is filled below
    dQ = dR
    for j in range(len(cores) - 1):
        G = cores[j]
        r0, m, r1 = G.shape
        dQj = dQ.reshape(r0 * m, -1)
        grads[j] = (dQj @ Q[j].t()).reshape(G.shape)
        dQ = G.reshape(r0 * m, r1).t() @ dQj
    grads[-1] = dQ.reshape(cores[-1].shape)
    return grads


# ---------------------------------------------------------------------------- halves
_RANK_ALIGN = 8
_MIN_WIDTH = 16  # MKL runs (B×N)·(N×8) and its transposes several times slower than ×16
_PAD_MIN_BATCH = 128  # below this the batch GEMMs are tiny: padding is pure overhead


def _padded_width(rd: int, bias: bool) -> int:
    """The middle rank ``r_d`` (plus one for a bias row) rounded up to a multiple of 8,
    at least 16: the width of the halves path's batch GEMMs from 128 rows."""
    return max(_MIN_WIDTH, -(-(rd + bias) // _RANK_ALIGN) * _RANK_ALIGN)


def _pad_middle(L: Tensor, R: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Zero-pad the middle rank ``r_d`` to a multiple of 8 (at least 16) and fold the bias
    into ``R``.

    ``L``: ``(N, r_d)``, ``R``: ``(r_d, M)``, ``bias``: ``(M,)`` or None. Returns ``Lp``
    ``(N, r_p)`` and ``Rp`` ``(r_p, M)``. BLAS/tensor-core GEMMs run up to 2× faster on
    aligned widths, and zero columns of ``Lp`` meet zero rows of ``Rp``: exact. With a
    bias, ``r_p >= r_d + 1`` and row ``r_d`` of ``Rp`` is the bias: the caller sets column
    ``r_d`` of ``X·Lp`` to ones, which adds the bias in the same GEMM, and the
    same row of ``(X·Lp)ᵀ·dY`` is the bias gradient ``Σ_b dY``: no broadcast copy for
    ``addmm`` and no separate reduction over the batch.
    """
    rd = L.shape[1]
    rp = _padded_width(rd, bias is not None)
    if rp == rd:
        return L, R
    Lp = torch.nn.functional.pad(L, (0, rp - rd))
    if bias is None:
        return Lp, torch.nn.functional.pad(R, (0, 0, 0, rp - rd))
    Rp = R.new_zeros(rp, R.shape[1])
    Rp[:rd] = R
    Rp[rd] = bias
    return Lp, Rp


class _GatedFunction:
    """Shared by the TT-linear ``autograd.Function``s: absorbing rank gates into the
    cores inside the Function (no autograd node per gate) and running backward under the
    forward's autocast state.

    Bond ``k`` (between cores ``k`` and ``k+1``, 0-based) is absorbed on its outer side:
    into the right bond of core ``k`` on the input half (``k < d``, the middle bond
    included) and into the left bond of core ``k+1`` on the output half. TT ranks grow
    towards the middle, so the outer core is the smaller one (the two outermost cores are
    ``n_1·r_1`` and ``r_{2d-1}·m_d``), and each core carries at most one gate."""

    @staticmethod
    def _split(ctx, tensors: Sequence[Tensor], d: int  # noqa: ANN001
               ) -> tuple[list[Tensor], list[Tensor], list[Tensor], float]:
        """The Function's trailing arguments as (cores, gates, alive, tau): the 2d cores,
        then, when gated, the 2d-1 gates, the 2d-1 ``alive`` vectors and ``tau``
        (else empty lists and 0). Sets ``ctx.gated``."""
        n_g = 2 * d - 1
        ctx.gated = len(tensors) > 2 * d
        if not ctx.gated:
            return list(tensors[: 2 * d]), [], [], 0.0
        return (list(tensors[: 2 * d]), list(tensors[2 * d : 2 * d + n_g]),
                list(tensors[2 * d + n_g : -1]), float(tensors[-1]))

    @staticmethod
    def _absorb(ctx, tensors: Sequence[Tensor], d: int) -> list[Tensor]:  # noqa: ANN001
        """``tensors``: the 2d cores, optionally followed by the 2d-1 gates, the 2d-1
        bool ``alive`` vectors and the threshold ``tau`` (a float). Returns the gated
        cores and keeps what :meth:`_gate_grads` needs on ``ctx`` (the raw cores are
        saved last). The masks ``alive_k & (|g_k| > tau)`` are computed here, in one pass
        over all bonds: no mask tensors are built outside the step."""
        raw, gates, alive, tau = _GatedFunction._split(ctx, tensors, d)
        if not ctx.gated:
            return raw
        # g where |g| > tau, else 0 (hardshrink: one op), then the dead entries zeroed
        gm = torch.nn.functional.hardshrink(torch.cat(gates), tau)
        if alive:
            gm = torch.where(torch.cat(alive), gm, 0.0)
        ctx.m = gm != 0  # the mask: alive and |g| > tau (> 0, so never a kept zero)
        ctx.sizes = [int(v.shape[0]) for v in gates]
        # per gate, its vector shaped to broadcast over its core: (r,) on the right bond,
        # (r, 1, 1) on the left
        ctx.gv = [v if right else v.view(-1, 1, 1)
                  for v, (_, right) in zip(gm.split(ctx.sizes), _gate_plan(d))]
        eff = list(raw)
        for v, (j, _) in zip(ctx.gv, _gate_plan(d)):
            eff[j] = raw[j] * v
        return eff

    @staticmethod
    def _gate_grads(ctx, d_eff: list[Tensor | None], need: Sequence[bool],  # noqa: ANN001
                    raw: Sequence[Tensor]) -> list[Tensor | None]:
        """From gradients of the gated cores to the raw cores ``raw`` and the gates. For a
        gate on the right bond, ``E = G · diag(gm)``: ``dG = dE · diag(gm)`` and
        ``dg = m ⊙ Σ_{all but last} dE ⊙ G``; on the left bond the same over all but the
        first axis. Returns grads for (cores, gates, alive, tau) in the order they were
        passed."""
        K = len(d_eff)
        n_g = K - 1
        d_cores: list[Tensor | None] = [dE if need[k] else None for k, dE in enumerate(d_eff)]
        want_g = any(need[K : K + n_g])
        sums: list[Tensor] = []
        for v, (j, right) in zip(ctx.gv, _gate_plan(K // 2)):
            dE = d_eff[j]
            if dE is None:  # no gradient reached this core: zero for its gate
                sums.append(v.new_zeros(v.shape[0]))
                continue
            if need[j]:
                d_cores[j] = dE * v
            if want_g:
                sums.append((dE * raw[j]).sum((0, 1) if right else (1, 2)))
        d_gates: list[Tensor | None] = [None] * n_g
        if want_g:
            flat = torch.where(ctx.m, torch.cat(sums), 0.0).split(ctx.sizes)
            d_gates = [g if need[K + k] else None for k, g in enumerate(flat)]
        return [*d_cores, *d_gates, *([None] * n_g), None]

    @staticmethod
    def _keep_autocast(ctx, x: Tensor) -> None:  # noqa: ANN001
        dev = x.device.type  # backward runs under the forward's autocast state (bf16)
        ctx.amp = (dev, torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else None

    @classmethod
    def backward(cls, ctx, dy: Tensor):  # type: ignore[override]  # noqa: ANN001, ANN206
        if ctx.amp is None:
            return cls._backward(ctx, dy)
        with torch.autocast(ctx.amp[0], dtype=ctx.amp[1]):
            return cls._backward(ctx, dy)

    @classmethod
    def _finish(cls, ctx, dx: Tensor | None, dbias: Tensor | None,  # noqa: ANN001
                grads: list[Tensor | None], saved: Sequence[Tensor]
                ) -> tuple[Tensor | None, ...]:
        """The Function's return value; ``saved``: ``ctx.saved_tensors``, the raw cores
        last when gated."""
        need_cores = ctx.needs_input_grad[3:]
        if ctx.gated:
            return (dx, None, dbias,
                    *cls._gate_grads(ctx, grads, need_cores, saved[-len(grads):]))
        return (dx, None, dbias, *(g if need else None for g, need in zip(grads, need_cores)))


class TTLinearHalves(_GatedFunction, torch.autograd.Function):
    """``Y = (X·L)·R + b`` with ``L``/``R`` merged from the cores; any ``d >= 1``.

    From 128 rows up, the middle rank is zero-padded to a multiple of 8 (at least 16)
    for the batch GEMMs (exact) and the bias rides in that padding (:func:`_pad_middle`),
    so the forward is two GEMMs and nothing else at batch size; smaller batches skip the
    padding (it would cost more than it saves). Given gates, alive vectors and ``tau``
    after the cores, it absorbs them itself (:class:`_GatedFunction`) instead of leaving
    an autograd node per gate. Saved for backward: ``X``, ``X·L``, the left prefixes
    ``P_1..P_{d-1}``, the right suffixes ``Q_2..Q_d``, the padded ``L``/``R`` and the
    (gated) cores. Backward:
    ``dXL = dY·Rᵀ``, then ``dR = (XL)ᵀ·dY`` while ``dY`` is still in cache (its bias row
    is ``db``), ``dX = dXL·Lᵀ``, ``dL = Xᵀ·dXL``, then back through the merge chains
    into each core. The six batch GEMMs run one by one through :mod:`.gemm` (each the
    faster of two ways on this CPU) or, where that is faster still, row-blocked in C++
    (:func:`_batch_forward`, :func:`_batch_backward`). On CPU tensors (fp32/fp64, no
    autocast) the batch-independent parts (gates, merge chains, padding, and back from
    ``dL``, ``dR`` to cores and gates) run as one C++ call each way
    (``csrc/tt_halves.cpp`` through :mod:`.native`).
    """

    @staticmethod
    def forward(ctx, x: Tensor, d: int, bias: Tensor | None,  # type: ignore[override]
                *tensors: Tensor) -> Tensor:
        # tensors: the 2d cores, optionally followed by 2d-1 gates, 2d-1 alive vectors, tau
        pad = x.shape[0] >= _PAD_MIN_BATCH
        ctx.native = native_ops.usable(x)
        if ctx.native is not None:  # gates, merges and padding in one C++ call
            raw, gates, alive, tau = TTLinearHalves._split(ctx, tensors, d)
            rd = raw[d - 1].shape[-1]  # the middle rank: the last input-half core's right
            rp = _padded_width(rd, bias is not None) if pad else 0
            out = ctx.native.halves_prepare(raw, gates, alive, tau, bias if pad else None,
                                            d, rp)
            Lp, Rp = out[0], out[1]
            keep = [*out[4:], *((*raw, *out[2:4]) if ctx.gated else ())]
        else:
            cores = TTLinearHalves._absorb(ctx, tensors, d)
            P = merge_left(cores[:d])
            Q = merge_right(cores[d:])
            rd = P[-1].shape[1]
            Lp, Rp = _pad_middle(P[-1], Q[0], bias) if pad else (P[-1], Q[0])
            keep = [*cores, *P[:-1], *Q[1:], *(tensors[: 2 * d] if ctx.gated else ())]
        ctx.bias_in_r = bias is not None and pad
        if pad:  # the bias, if any, rides in the padding: column rd of XL is ones
            y, XL = _batch_forward(x, Lp, Rp, rd if ctx.bias_in_r else -1, ctx.native)
        else:
            XL = x @ Lp
            y = torch.addmm(bias, XL, Rp) if bias is not None else XL @ Rp
        ctx.d, ctx.rd = d, rd
        ctx.has_bias = bias is not None
        TTLinearHalves._keep_autocast(ctx, x)
        ctx.save_for_backward(x, XL, Lp, Rp, *keep)
        return y

    @staticmethod
    def _backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ANN001
        d, rd = ctx.d, ctx.rd
        saved = ctx.saved_tensors
        x, XL, Lp, Rp = saved[:4]
        need_x = ctx.needs_input_grad[0]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        need_cores = any(ctx.needs_input_grad[3:])
        dx = dbias = dRp = dL = None
        if need_x or need_cores:
            dx, dL, dRp = _batch_backward(dy, x, XL, Lp, Rp, need_x, need_cores, ctx.native)
            if dL is not None:
                dL = dL[:, :rd]  # (N, r_d)
        if need_b:
            dbias = dRp[rd] if dRp is not None and ctx.bias_in_r else dy.sum(0)
        if ctx.native is not None:
            return TTLinearHalves._native_grads(ctx, dx, dbias, dL, dRp, saved[4:])
        cores = saved[4 : 4 + 2 * d]
        P = saved[4 + 2 * d : 3 + 3 * d]  # P_1..P_{d-1}
        Q = saved[3 + 3 * d : 2 + 4 * d]  # Q_2..Q_d
        grads: list[Tensor | None] = [None] * (2 * d)
        if need_cores:
            grads = [*merge_left_grads(cores[:d], P, dL),
                     *merge_right_grads(cores[d:], Q, dRp[:rd])]
        return TTLinearHalves._finish(ctx, dx, dbias, grads, saved)

    @staticmethod
    def _native_grads(ctx, dx: Tensor | None, dbias: Tensor | None,  # noqa: ANN001
                      dL: Tensor | None, dRp: Tensor | None, saved: Sequence[Tensor]
                      ) -> tuple[Tensor | None, ...]:
        """The Function's return value from the batch gradients, the core and gate
        gradients in one C++ call. ``saved``: the (gated) cores, ``P_1..P_{d-1}``,
        ``Q_2..Q_d``, then, when gated, the raw cores, the gate values and their mask."""
        d, n_g = ctx.d, 2 * ctx.d - 1
        need = ctx.needs_input_grad
        n_cores = 2 * d + n_g if ctx.gated else 2 * d
        if dL is None:
            return (dx, None, dbias, *([None] * n_cores),
                    *(([None] * (n_g + 1)) if ctx.gated else ()))
        eff = saved[: 2 * d]
        P, Q = saved[2 * d : 3 * d - 1], saved[3 * d - 1 : 4 * d - 2]
        raw = saved[4 * d - 2 : 6 * d - 2] if ctx.gated else eff
        gm, m = saved[6 * d - 2 :] if ctx.gated else (None, None)
        need_gates = ctx.gated and any(need[3 + 2 * d : 3 + 2 * d + n_g])
        g = ctx.native.halves_core_grads(dL, dRp[: ctx.rd], list(raw), list(eff), list(P),
                                         list(Q), gm, m, d, any(need[3 : 3 + 2 * d]),
                                         need_gates)
        cores = [gc if need[3 + k] else None for k, gc in enumerate(g[: 2 * d])]
        if not ctx.gated:
            return (dx, None, dbias, *cores)
        gates = [gg if need[3 + 2 * d + b] else None for b, gg in enumerate(g[2 * d :])]
        return (dx, None, dbias, *cores, *gates, *([None] * n_g), None)


_BLOCK_ROWS = 512  # rows per block of the row-blocked batch step; at 768x768, rank 30,
# 4096 rows, blocks of 256-1024 rows timed within 0.1 ms of each other (BENCHMARKS.md)


def _step_way(kind: str, x: Tensor, native, run, *dims: int):  # noqa: ANN001, ANN202
    """``run(0)`` (the products one by one) where the blocked way cannot run (no native
    module, or not a large contiguous fp32 CPU batch), else ``run`` the way this machine
    takes for a step of ``kind`` with these dimensions (:func:`.gemm.choose`)."""
    if native is None or not gemm.step_tunable(x):
        return run(0)
    return gemm.choose(kind, gemm.step_key(kind, *dims), run)


def _batch_forward(x: Tensor, Lp: Tensor, Rp: Tensor, ones_col: int,
                   native) -> tuple[Tensor, Tensor]:  # noqa: ANN001
    """The halves forward's batch GEMMs: ``XL = X·Lp`` (column ``ones_col`` set to one
    where ``>= 0``), ``Y = XL·Rp``; returns ``(Y, XL)``. Way 0: the two products through
    :mod:`.gemm`; way 1: row-blocked in C++ (``csrc/tt_halves_batch.cpp``). Where both
    can run, the faster on this machine (:func:`.gemm.choose`)."""

    def run(way: int) -> tuple[Tensor, Tensor]:
        if way == 1:
            y, XL = native.halves_batch_forward(x, Lp, Rp, ones_col, _BLOCK_ROWS)
            return y, XL
        XL = gemm.nn(x, Lp)
        if ones_col >= 0:
            XL[:, ones_col] = 1.0  # meets the bias row of Rp
        return gemm.nn(XL, Rp), XL

    return _step_way("halves-fwd", x, native, run, *x.shape, *Rp.shape, int(ones_col >= 0))


def _batch_backward(dy: Tensor, x: Tensor, XL: Tensor, Lp: Tensor, Rp: Tensor,
                    need_x: bool, need_w: bool, native  # noqa: ANN001
                    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The halves backward's batch GEMMs: ``dXL = dY·Rpᵀ``, then ``dX = dXL·Lpᵀ`` (if
    ``need_x``), ``dRp = XLᵀ·dY`` and ``dLp = Xᵀ·dXL`` (``(N, r_p)``, if ``need_w``);
    returns ``(dX, dLp, dRp)``, None where not asked for. Ways as in
    :func:`_batch_forward`."""

    def run(way: int) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        if way == 1:
            dx, dL, dR, _ = native.halves_batch_backward(dy, x, XL, Lp, Rp, need_x, need_w,
                                                         _BLOCK_ROWS)
            return dx, dL, dR
        dXL = gemm.nt(dy, Rp)
        # dR while dY is hot. Fixed rule (small batches): MKL runs (dYᵀ·XL)ᵀ faster when
        # the width is a multiple of 16 (the padded case) and up to 5× slower otherwise
        # on Zen 4 (BENCHMARKS.md); large ones take the faster on this CPU
        dR = gemm.tn(XL, dy, default=int(XL.shape[1] % 16 == 0)) if need_w else None
        dx = gemm.nt(dXL, Lp) if need_x else None
        dL = gemm.tn(x, dXL) if need_w else None
        return dx, dL, dR

    return _step_way("halves-bwd", x, native, run, *x.shape, *Rp.shape, int(need_x),
                     int(need_w))


def _gate_args(gates: Sequence[Tensor], tau: float, alive: Sequence[Tensor]) -> tuple:
    """The trailing Function arguments for gates: ``(*gates, *alive, tau)``, alive
    defaulting to all True; nothing without gates."""
    if not gates:
        return ()
    if not alive:
        alive = [torch.ones(g.shape, dtype=torch.bool, device=g.device) for g in gates]
    elif len(alive) != len(gates):
        raise ValueError(f"alive: expected {len(gates)} vectors (one per gate), got {len(alive)}")
    return (*gates, *alive, float(tau))


def tt_linear_halves(x: Tensor, cores: Sequence[Tensor], d: int,
                     bias: Tensor | None = None, gates: Sequence[Tensor] = (),
                     tau: float = 0.0, alive: Sequence[Tensor] = ()) -> Tensor:
    """Two-half path. ``x``: ``(B, N)``; returns ``(B, M)`` (``+ bias``, fused into the
    batch GEMMs). ``gates`` (with ``tau`` and optional ``alive``, as in :func:`tt_linear`)
    are absorbed inside the Function."""
    return TTLinearHalves.apply(x, d, bias, *cores, *_gate_args(gates, tau, alive))


# ---------------------------------------------------------------------------- sweep
def _sweep_merges(B: int, ins: Sequence[int], outs: Sequence[int], r: Sequence[int]
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
    """:func:`_sweep_merges` for the cores of these ``shapes`` (cached per step shape)."""
    return _sweep_merges(B, *_layout(shapes, d))


class TTLinearSweep(_GatedFunction, torch.autograd.Function):
    """Core-by-core path: ``X`` meets one core at a time, ``L``/``R`` are never formed.

    Input half, on ``T = Xᵀ`` laid out ``(r_{k-1}·n_k, rest·B)`` (the batch folded into
    the columns, so each core is one plain GEMM):
    ``T_k = G_kᵀ (r_k × r_{k-1}n_k) · T_{k-1}`` -> ``(r_k, rest·B)``, which is already
    ``(r_k·n_{k+1}, rest'·B)`` for the next core; ``T_d = (X·L)ᵀ``. Output half, rows
    ``(B, m_1…m_{j-1})``: ``S_j = S_{j-1} (·, r_{j-1}) · G_j (r_{j-1}, m_j·r_j)``. Batch work
    ``B·Σ_k r_{k-1}n_k r_k·(rest)``: cheapest for small batches with large ranks, where
    merging the halves would cost more than the batch GEMMs. The two outermost cores of
    a side are merged first where that is cheaper (:func:`_sweep_merges`). Saves ``Xᵀ``,
    every intermediate (all batch × rank sized), the (gated) cores and the swept
    matrices (views of the cores, or the merged outer pairs), so backward reshapes
    nothing but the running gradient; gates as in :class:`TTLinearHalves`.
    """

    @staticmethod
    def forward(ctx, x: Tensor, d: int, bias: Tensor | None,  # type: ignore[override]
                *tensors: Tensor) -> Tensor:
        ctx.native = native_ops.usable(x)
        if ctx.native is not None:
            return TTLinearSweep._native_forward(ctx, x, d, bias, tensors)
        cores = TTLinearSweep._absorb(ctx, tensors, d)
        B = x.shape[0]
        ctx.head, ctx.tail = _sweep_plan(B, tuple(c.shape for c in cores), d)
        # the swept cores as matrices: input half (r0·n, r1), output half (r0, m·r1);
        # views, built once and saved for backward (no reshapes there)
        ml = [_left_mat(c) for c in cores[:d]]
        mr = [_right_mat(c) for c in cores[d:]]
        if ctx.head:  # H = G_1·G_2, one (n_1·n_2, r_2) matrix
            ml[:2] = [torch.mm(ml[0], _right_mat(cores[1])).view(-1, ml[1].shape[1])]
        if ctx.tail:  # G_{2d-1}·G_{2d}, one (r, m_{d-1}·m_d) matrix
            mr[-2:] = [torch.mm(_left_mat(cores[-2]), mr[-1]).view(mr[-2].shape[0], -1)]
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
        ctx.save_for_backward(*cores, *ml, *mr, *ins,
                              *(tensors[: 2 * d] if ctx.gated else ()))
        return y

    @staticmethod
    def _native_forward(ctx, x: Tensor, d: int, bias: Tensor | None,  # noqa: ANN001
                        tensors: Sequence[Tensor]) -> Tensor:
        """The same forward in C++ (:mod:`.native`): one call instead of ~30 Python-level
        ops. Saves the raw cores, the gated ones, the swept matrices, their inputs and,
        when gated, the gate values and mask."""
        raw, gates, alive, tau = TTLinearSweep._split(ctx, tensors, d)
        ctx.head, ctx.tail = _sweep_plan(x.shape[0], tuple(c.shape for c in raw), d)
        out = ctx.native.sweep_forward(x, raw, gates, alive, tau, bias, d, ctx.head, ctx.tail)
        ctx.d, ctx.nl, ctx.has_bias = d, d - ctx.head, bias is not None
        TTLinearSweep._keep_autocast(ctx, x)
        ctx.save_for_backward(*raw, *out[3:], *(out[1:3] if ctx.gated else ()))
        return out[0]

    @staticmethod
    def _native_backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ANN001
        d, n_g = ctx.d, 2 * ctx.d - 1
        ne = 2 * d - ctx.head - ctx.tail
        s = ctx.saved_tensors
        raw, eff = s[: 2 * d], s[2 * d : 4 * d]
        mats, ins = s[4 * d : 4 * d + ne], s[4 * d + ne : 4 * d + 2 * ne]
        gm, m = s[4 * d + 2 * ne :] if ctx.gated else (None, None)
        need = ctx.needs_input_grad
        need_gates = ctx.gated and any(need[3 + 2 * d : 3 + 2 * d + n_g])
        g = ctx.native.sweep_backward(
            dy, list(raw), list(eff), list(mats), list(ins), gm, m, d, ctx.nl, ctx.head,
            ctx.tail, need[0], ctx.has_bias and need[2], any(need[3 : 3 + 2 * d]), need_gates)
        cores = [gc if need[3 + k] else None for k, gc in enumerate(g[2 : 2 + 2 * d])]
        if not ctx.gated:
            return (g[0], None, g[1], *cores)
        gates = [gg if need[3 + 2 * d + b] else None for b, gg in enumerate(g[2 + 2 * d :])]
        return (g[0], None, g[1], *cores, *gates, *([None] * n_g), None)

    @staticmethod
    def _backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ANN001
        if ctx.native is not None:
            return TTLinearSweep._native_backward(ctx, dy)
        d, nl = ctx.d, ctx.nl  # nl: input-side matrices actually swept
        ne = 2 * d - ctx.head - ctx.tail  # matrices swept in all
        saved = ctx.saved_tensors
        cores = saved[: 2 * d]
        mats, ins = saved[2 * d : 2 * d + ne], saved[2 * d + ne : 2 * d + 2 * ne]
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
                P1 = _left_mat(G1)
                lg = [torch.mm(dH, _right_mat(G2).t()), torch.mm(P1.t(), dH), *lg[1:]]
            if ctx.tail:  # back through G_a·G_b = G_a·Q_b (Q_b = G_b as a matrix)
                Ga, Gb = cores[-2], cores[-1]
                dT2 = rg[-1].view(-1, Gb.shape[1])  # (r_a·m_a, m_b)
                Qb = _right_mat(Gb)
                rg = [*rg[:-1], torch.mm(dT2, Qb.t()), torch.mm(_left_mat(Ga).t(), dT2)]
            grads = [g.view(c.shape) for g, c in zip([*lg, *rg], cores)]
        return TTLinearSweep._finish(ctx, dx, dbias, grads, saved)


def tt_linear_sweep(x: Tensor, cores: Sequence[Tensor], d: int,
                    bias: Tensor | None = None, gates: Sequence[Tensor] = (),
                    tau: float = 0.0, alive: Sequence[Tensor] = ()) -> Tensor:
    """Core-by-core path (:class:`TTLinearSweep`). ``x``: ``(B, N)``; returns ``(B, M)``
    (``+ bias``). ``gates`` (with ``tau`` and optional ``alive``, as in :func:`tt_linear`)
    are absorbed inside the Function."""
    return TTLinearSweep.apply(x, d, bias, *cores, *_gate_args(gates, tau, alive))


# ---------------------------------------------------------------------------- dense
def tt_linear_dense(x: Tensor, cores: Sequence[Tensor], d: int) -> Tensor:
    """Reconstruct ``W = L·R`` then one GEMM. ``x``: ``(B, N)``; returns ``(B, M)``."""
    W = merge_left(cores[:d])[-1] @ merge_right(cores[d:])[0]
    return x @ W


_IMPL = {"halves": tt_linear_halves, "sweep": tt_linear_sweep, "dense": tt_linear_dense}


# ---------------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class DeviceModel:
    """Roofline-style device constants: MAC rate (MAC/s) for large GEMMs, memory
    bandwidth (B/s), and a fixed cost per kernel/op (s). A GEMM whose smallest dimension
    ``k`` is below ``full_eff_dim`` runs at ``k/full_eff_dim`` of the peak rate (skinny
    GEMMs are bandwidth-limited)."""

    name: str
    mac_rate: float
    bandwidth: float
    op_overhead: float
    full_eff_dim: int = 32

    @staticmethod
    def for_device(device: torch.device | str) -> DeviceModel:
        dev = torch.device(device)
        if dev.type == "cuda":
            return DeviceModel("cuda", mac_rate=2.5e13, bandwidth=2.0e12, op_overhead=6e-6,
                               full_eff_dim=64)
        return DeviceModel("cpu", mac_rate=4.0e10, bandwidth=1.2e10, op_overhead=8e-6,
                           full_eff_dim=16)


@dataclass(frozen=True)
class PathCost:
    """Estimated work of one path. MACs and bytes are totals for the direction(s)."""

    path: str
    macs_fwd: int
    macs_bwd: int
    bytes_fwd: int
    bytes_bwd: int
    ops_fwd: int
    ops_bwd: int
    seconds: float  # estimated (fwd, plus bwd when training)


class _Acc:
    """Accumulates GEMM-like ops: MACs, bytes, op count and modelled time."""

    def __init__(self, dm: DeviceModel, elt: int) -> None:
        self.dm, self.elt = dm, elt
        self.macs = self.bytes = self.ops = 0
        self.t = 0.0

    def gemm(self, a: int, k: int, b: int) -> None:
        """``(a×k)·(k×b)``."""
        macs = a * k * b
        byts = (a * k + k * b + a * b) * self.elt
        eff = min(1.0, max(1, min(a, k, b)) / self.dm.full_eff_dim)
        self.macs += macs
        self.bytes += byts
        self.ops += 1
        self.t += max(macs / (self.dm.mac_rate * eff), byts / self.dm.bandwidth)
        self.t += self.dm.op_overhead

    def copy(self, numel: int) -> None:
        self.bytes += 2 * numel * self.elt
        self.ops += 1
        self.t += 2 * numel * self.elt / self.dm.bandwidth + self.dm.op_overhead


def _merge_costs(acc: _Acc, ins: Sequence[int], outs: Sequence[int], r: Sequence[int]) -> None:
    d = len(ins)
    a = ins[0]
    for k in range(1, d):
        acc.gemm(a, r[k], ins[k] * r[k + 1])
        a *= ins[k]
    b = outs[-1]
    for j in range(d - 2, -1, -1):
        acc.gemm(r[d + j] * outs[j], r[d + j + 1], b)
        b *= outs[j]


def _path_cost(path: str, B: int, ins: Sequence[int], outs: Sequence[int], r: Sequence[int],
               dm: DeviceModel, elt: int, training: bool, need_dx: bool) -> PathCost:
    d = len(ins)
    N, M, rd = math.prod(ins), math.prod(outs), r[d]
    f, g = _Acc(dm, elt), _Acc(dm, elt)
    for _ in range(len(r) - 2):  # gate scaling of each core (both paths pay it)
        f.copy(0)
    if path == "halves":
        _merge_costs(f, ins, outs, r)
        f.gemm(B, N, rd)
        f.gemm(B, rd, M)
        g.gemm(B, M, rd)  # dXL
        g.gemm(rd, B, M)  # dR
        if need_dx:
            g.gemm(B, rd, N)
        g.gemm(N, B, rd)  # dL
        _merge_costs(g, ins, outs, r)
        _merge_costs(g, ins, outs, r)
    elif path == "sweep":
        head, tail = _sweep_merges(B, ins, outs, r)
        # the swept cores as (r_in, mode, r_out), after the merges of the outer ones
        left = [(r[k], ins[k], r[k + 1]) for k in range(d)]
        right = [(r[d + j], outs[j], r[d + j + 1]) for j in range(d)]
        for on, side, a in ((head, left, 0), (tail, right, d - 2)):
            if not on:
                continue
            b = a + 1
            (ra, na, rm), (_, nb, rb) = side[a], side[b]
            f.gemm(ra * na, rm, nb * rb)  # the merge, and its two backward GEMMs
            g.gemm(ra * na, nb * rb, rm)
            g.gemm(rm, ra * na, nb * rb)
            side[a:b + 1] = [(ra, na * nb, rb)]
        f.copy(B * N)  # Xᵀ
        rest = N
        for k, (r0, n, r1) in enumerate(left):
            rest //= n
            # the batch folded into the columns: (r_k × r_{k-1}n_k) · (r_{k-1}n_k × rest·B)
            f.gemm(r1, r0 * n, rest * B)
            if k > 0 or need_dx:
                g.gemm(r0 * n, r1, rest * B)  # dT
            g.gemm(r0 * n, rest * B, r1)  # dG
        done = 1
        for r0, m, r1 in right:
            f.gemm(B * done, r0, m * r1)
            g.gemm(B * done, m * r1, r0)
            g.gemm(r0, B * done, m * r1)
            done *= m
    elif path == "dense":
        _merge_costs(f, ins, outs, r)
        f.gemm(N, rd, M)
        f.gemm(B, N, M)
        g.gemm(N, B, M)  # dW
        if need_dx:
            g.gemm(B, M, N)
        g.gemm(N, M, rd)
        g.gemm(rd, N, M)
        _merge_costs(g, ins, outs, r)
        _merge_costs(g, ins, outs, r)
    else:
        raise ValueError(f"path: unknown path {path!r}; choose one of {PATHS}")
    secs = f.t + (g.t if training else 0.0)
    return PathCost(path, f.macs, g.macs, f.bytes, g.bytes, f.ops, g.ops, secs)


@lru_cache(maxsize=8192)
def _estimate_cached(B: int, ins: tuple[int, ...], outs: tuple[int, ...], r: tuple[int, ...],
                     dm: DeviceModel, elt: int, training: bool, need_dx: bool
                     ) -> tuple[PathCost, ...]:
    return tuple(_path_cost(p, B, ins, outs, r, dm, elt, training, need_dx) for p in PATHS)


def estimate(B: int, in_factors: Sequence[int], out_factors: Sequence[int],
             ranks: Sequence[int], device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32, training: bool = True,
             need_dx: bool = True) -> dict[str, PathCost]:
    """Cost of every path for batch ``B``; ``ranks`` is ``[1, r_1, …, r_{2d-1}, 1]``."""
    if len(in_factors) != len(out_factors) or len(ranks) != 2 * len(in_factors) + 1:
        raise ValueError(
            f"ranks: need 2d+1 = {2 * len(in_factors) + 1} ranks for d = {len(in_factors)}, "
            f"got {len(ranks)}"
        )
    dm = DeviceModel.for_device(device)
    elt = torch.empty((), dtype=dtype).element_size()
    costs = _estimate_cached(int(B), tuple(in_factors), tuple(out_factors), tuple(ranks), dm,
                             elt, bool(training), bool(need_dx))
    return {c.path: c for c in costs}


@lru_cache(maxsize=8192)
def _plan_cached(B: int, ins: tuple[int, ...], outs: tuple[int, ...], r: tuple[int, ...],
                 dev: str, dtype: torch.dtype, training: bool, need_dx: bool) -> str:
    costs = estimate(B, ins, outs, r, dev, dtype, training, need_dx)
    if min(r) == 0:
        return "halves"
    return min(costs.values(), key=lambda c: c.seconds).path


def plan(B: int, in_factors: Sequence[int], out_factors: Sequence[int], ranks: Sequence[int],
         device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
         training: bool = True, need_dx: bool = True) -> str:
    """The cheapest path name for these shapes (cached)."""
    dev = torch.device(device).type
    return _plan_cached(int(B), tuple(in_factors), tuple(out_factors), tuple(ranks), dev,
                        dtype, bool(training), bool(need_dx))


def explain(B: int, in_factors: Sequence[int], out_factors: Sequence[int],
            ranks: Sequence[int], device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32, training: bool = True) -> dict:
    """What the planner sees: the chosen path and, per path, MACs, bytes and modelled
    seconds; plus the dense ``nn.Linear`` reference MACs (``B·N·M`` forward)."""
    costs = estimate(B, in_factors, out_factors, ranks, device, dtype, training)
    N, M = math.prod(in_factors), math.prod(out_factors)
    return {
        "path": plan(B, in_factors, out_factors, ranks, device, dtype, training),
        "batch": int(B),
        "ranks": list(ranks),
        "dense_linear_macs_fwd": B * N * M,
        "dense_linear_macs_fwd_bwd": 3 * B * N * M,
        "paths": {p: asdict(c) for p, c in costs.items()},
    }


# ---------------------------------------------------------------------------- entry
@lru_cache(maxsize=4096)
def _layout(shapes: tuple[torch.Size, ...], d: int
            ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Input factors, output factors and ranks ``(1, r_1, …, r_{2d-1}, 1)`` of cores with
    these shapes (cached: read every forward)."""
    ins = tuple(int(s[1]) for s in shapes[:d])
    outs = tuple(int(s[1]) for s in shapes[d:])
    return ins, outs, (1, *(int(s[-1]) for s in shapes[:-1]), 1)


def tt_linear(x: Tensor, cores: Sequence[Tensor], d: int, path: str | None = None,
              bias: Tensor | None = None, gates: Sequence[Tensor] | None = None,
              tau: float = 0.0, alive: Sequence[Tensor] | None = None) -> Tensor:
    """``Y = X·W (+ bias)`` for the TT weight given by ``cores``.

    ``x``: ``(..., N)``; ``bias``: ``(M,)`` (the padded output width) or None; returns
    ``(..., M)``. ``path=None`` lets the planner choose. ``gates``: the ``2d-1`` rank
    gates; entry ``i`` of bond ``k`` is active where ``alive[k][i]`` (bool vectors,
    default all True) and ``|g_k[i]| > tau``, and inactive entries act as removed ranks
    (:func:`gate_masks`, :func:`apply_gates`). Pass the raw gates rather than pre-gated
    cores: the halves and sweep Functions absorb them inside, masks included, with no
    autograd node per gate.
    """
    if len(cores) != 2 * d:
        raise ValueError(f"cores: expected 2d = {2 * d} cores, got {len(cores)}")
    ins, outs, ranks = _layout(tuple(c.shape for c in cores), d)
    N = math.prod(ins)
    if x.shape[-1] != N:
        raise ValueError(f"x: last dimension {x.shape[-1]} != N = {N}")
    lead = x.shape[:-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, N)  # a no-op view is still an autograd node
    if min(ranks) == 0:  # a bond of rank 0: the zero map
        y0 = x.new_zeros(*lead, math.prod(outs))
        return y0 + bias if bias is not None else y0
    if path is None:
        training = torch.is_grad_enabled() and (
            x.requires_grad or any(c.requires_grad for c in cores))
        path = plan(x2.shape[0], ins, outs, ranks, x.device, x.dtype, training,
                    x.requires_grad)
    try:
        impl = _IMPL[path]
    except KeyError:
        raise ValueError(f"path: unknown path {path!r}; choose one of {PATHS}") from None
    if gates is not None and len(gates) != 2 * d - 1:
        raise ValueError(f"gates: expected 2d-1 = {2 * d - 1} gate vectors, got {len(gates)}")
    if path in ("halves", "sweep"):
        y = impl(x2, cores, d, bias, gates or (), tau, alive or ())
    else:
        if gates is not None:
            cores = apply_gates(cores, gates, gate_masks(gates, tau, alive))
        y = impl(x2, cores, d)
        if bias is not None:
            y = y + bias.to(y.dtype)  # keeps autocast's dtype, as nn.Linear does
    return y if x.dim() == 2 else y.reshape(*lead, -1)
