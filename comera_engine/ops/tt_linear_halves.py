"""The TT-linear halves op: ``Y = (X·L)·R + b`` with the halves merged from the cores.

``W = L·R`` with ``L = G_1⋯G_d ∈ R^{N×r_d}`` and ``R = G_{d+1}⋯G_{2d} ∈ R^{r_d×M}``;
batch work ``B·r_d·(N+M)`` MACs, merges batch independent. :class:`TTLinearHalves` is
the ``autograd.Function`` (gates absorbed inside, tensors saved by name),
:func:`tt_linear_halves` its entry point and :func:`tt_linear_halves_reference` the plain
PyTorch reference it is tested against (tests/test_op_tt_linear_halves.py; benchmark:
experiments/bench_op_tt_linear_halves.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .. import backends
from .gates import GatedFunction, apply_gates, gate_args, gate_masks, save, saved, to_autocast
from .merges import merge_left, merge_left_grads, merge_right, merge_right_grads

__all__ = ["TTLinearHalves", "TTLinearReconstructed", "batch_backward", "batch_forward",
           "padded_width", "tt_linear_halves", "tt_linear_halves_reference",
           "tt_linear_reconstructed"]

_RANK_ALIGN = 8
_MIN_WIDTH = 16  # MKL runs (B×N)·(N×8) and its transposes several times slower than ×16
_PAD_MIN_BATCH = 128  # below this the batch GEMMs are tiny: padding is pure overhead


def padded_width(rd: int, bias: bool) -> int:
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
    rp = padded_width(rd, bias is not None)
    if rp == rd:
        return L, R
    Lp = torch.nn.functional.pad(L, (0, rp - rd))
    if bias is None:
        return Lp, torch.nn.functional.pad(R, (0, 0, 0, rp - rd))
    Rp = R.new_zeros(rp, R.shape[1])
    Rp[:rd] = R
    Rp[rd] = bias
    return Lp, Rp


class TTLinearHalves(GatedFunction, torch.autograd.Function):
    """``Y = (X·L)·R + b`` with ``L``/``R`` merged from the cores; any ``d >= 1``.

    From 128 rows up, the middle rank is zero-padded to a multiple of 8 (at least 16)
    for the batch GEMMs (exact) and the bias rides in that padding (:func:`_pad_middle`),
    so the forward is two GEMMs and nothing else at batch size; smaller batches skip the
    padding (it would cost more than it saves). Given gates, alive vectors and ``tau``
    after the cores, it absorbs them itself (:class:`.gates.GatedFunction`) instead of leaving
    an autograd node per gate. Saved for backward: ``X``, ``X·L``, the left prefixes
    ``P_1..P_{d-1}``, the right suffixes ``Q_2..Q_d``, the padded ``L``/``R`` and the
    (gated) cores. Backward:
    ``dXL = dY·Rᵀ``, then ``dR = (XL)ᵀ·dY`` while ``dY`` is still in cache (its bias row
    is ``db``), ``dX = dXL·Lᵀ``, ``dL = Xᵀ·dXL``, then back through the merge chains
    into each core. The pure path is ``torch.mm`` throughout. Where the CPU backend is in
    use (:func:`comera_engine.backends.cpu_backend`), the six batch GEMMs take the install's way
    each, or run row-blocked in C++ (:func:`batch_forward`, :func:`batch_backward`), and
    the batch-independent parts (gates, merge chains, padding, and back from ``dL``,
    ``dR`` to cores and gates) run as one C++ call each way.
    """

    @staticmethod
    def forward(ctx, x: Tensor, d: int, bias: Tensor | None,  # type: ignore[override]
                *tensors: Tensor) -> Tensor:
        # tensors: the 2d cores, optionally followed by 2d-1 gates, 2d-1 alive vectors, tau
        pad = x.shape[0] >= _PAD_MIN_BATCH
        ctx.backend = backend = backends.cpu_backend(x, tensors[0])
        if backend is not None:  # gates, merges and padding in one C++ call
            raw, gates, alive, tau = TTLinearHalves._split(ctx, tensors, d)
            rd = raw[d - 1].shape[-1]  # the middle rank: the last input-half core's right
            rp = padded_width(rd, bias is not None) if pad else 0
            out = backend.ops.halves_prepare(raw, gates, alive, tau, bias if pad else None,
                                             d, rp)
            Lp, Rp = out[0], out[1]
            eff, P, Q = out[4 : 4 + 2 * d], out[4 + 2 * d : 3 + 3 * d], out[3 + 3 * d :]
            gm, m = out[2:4] if ctx.gated else (None, None)
        else:
            eff = TTLinearHalves._absorb(ctx, tensors, d)
            x = to_autocast(x)  # saved cast: half the bytes, no second cast in backward
            P, Q = merge_left(eff[:d]), merge_right(eff[d:])
            rd = P[-1].shape[1]
            Lp, Rp = _pad_middle(P[-1], Q[0], bias) if pad else (P[-1], Q[0])
            P, Q, gm, m = P[:-1], Q[1:], None, None
        ctx.bias_in_r = bias is not None and pad
        if pad:  # the bias, if any, rides in the padding: column rd of XL is ones
            y, XL = batch_forward(x, Lp, Rp, rd if ctx.bias_in_r else -1, backend)
        else:
            XL = x @ Lp
            y = torch.addmm(bias, XL, Rp) if bias is not None else XL @ Rp
        ctx.d, ctx.rd = d, rd
        ctx.has_bias = bias is not None
        TTLinearHalves._keep_autocast(ctx, x)
        save(ctx, x=x, XL=XL, Lp=Lp, Rp=Rp, eff=eff, P=P, Q=Q,  # raw: the C++ backward's
             raw=tensors[: 2 * d] if ctx.gated and backend is not None else None, gm=gm, m=m)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]  # noqa: ANN001
        return GatedFunction._run_backward(TTLinearHalves._backward, ctx, dy)

    @staticmethod
    def _backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ANN001
        d, rd = ctx.d, ctx.rd
        s = saved(ctx)
        need_x = ctx.needs_input_grad[0]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        need_cores = any(ctx.needs_input_grad[3:])
        dx = dbias = dRp = dL = None
        if need_x or need_cores:
            dx, dL, dRp = batch_backward(dy, s["x"], s["XL"], s["Lp"], s["Rp"], need_x,
                                         need_cores, ctx.backend)
            if dL is not None:
                dL = dL[:, :rd]  # (N, r_d)
        if need_b:
            dbias = dRp[rd] if dRp is not None and ctx.bias_in_r else dy.sum(0)
        if ctx.backend is not None:
            return TTLinearHalves._backend_grads(ctx, dx, dbias, dL, dRp, s)
        eff = s["eff"]
        grads: list[Tensor | None] = [None] * (2 * d)
        if need_cores:
            grads = [*merge_left_grads(eff[:d], s["P"], dL),
                     *merge_right_grads(eff[d:], s["Q"], dRp[:rd])]
        return TTLinearHalves._finish(ctx, dx, dbias, grads)

    @staticmethod
    def _backend_grads(ctx, dx: Tensor | None, dbias: Tensor | None,  # noqa: ANN001
                       dL: Tensor | None, dRp: Tensor | None, s: dict
                       ) -> tuple[Tensor | None, ...]:
        """The Function's return value from the batch gradients, the core and gate
        gradients in one C++ call (``s``: the saved tensors by name)."""
        d, n_g = ctx.d, 2 * ctx.d - 1
        need = ctx.needs_input_grad
        if dL is None:
            return TTLinearHalves._finish_backend(ctx, dx, dbias, [None] * (2 * d),
                                                  [None] * n_g)
        eff = s["eff"]
        raw = s["raw"] if ctx.gated else eff
        need_gates = ctx.gated and any(need[3 + 2 * d : 3 + 2 * d + n_g])
        g = ctx.backend.ops.halves_core_grads(dL, dRp[: ctx.rd], list(raw), list(eff),
                                              list(s["P"]), list(s["Q"]), s["gm"], s["m"],
                                              d, any(need[3 : 3 + 2 * d]), need_gates)
        return TTLinearHalves._finish_backend(ctx, dx, dbias, g[: 2 * d], g[2 * d :])


def batch_forward(x: Tensor, Lp: Tensor, Rp: Tensor, ones_col: int,
                  backend) -> tuple[Tensor, Tensor]:  # noqa: ANN001
    """The halves forward's batch GEMMs: ``XL = X·Lp`` (``(B, r_p)``, column ``ones_col``
    set to one where ``>= 0``), ``Y = XL·Rp`` (``(B, M)``); returns ``(Y, XL)``. Without a
    backend, ``torch.mm``; with one, its ways or its row-blocked step
    (:mod:`comera_engine.backends.cpu.step`)."""
    if backend is not None:
        return backend.batch_forward(x, Lp, Rp, ones_col)
    XL = x @ Lp
    if ones_col >= 0:
        XL[:, ones_col] = 1.0  # meets the bias row of Rp
    return XL @ Rp, XL


def batch_backward(dy: Tensor, x: Tensor, XL: Tensor, Lp: Tensor, Rp: Tensor,
                   need_x: bool, need_w: bool, backend  # noqa: ANN001
                   ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The halves backward's batch GEMMs: ``dXL = dY·Rpᵀ``, then ``dX = dXL·Lpᵀ`` (if
    ``need_x``), ``dRp = XLᵀ·dY`` and ``dLp = Xᵀ·dXL`` (``(N, r_p)``, if ``need_w``);
    returns ``(dX, dLp, dRp)``, None where not asked for. Backend as in
    :func:`batch_forward`."""
    if backend is not None:
        return backend.batch_backward(dy, x, XL, Lp, Rp, need_x, need_w)
    dXL = dy @ Rp.t()
    dR = XL.t() @ dy if need_w else None  # dR while dY is hot
    dx = dXL @ Lp.t() if need_x else None
    dL = x.t() @ dXL if need_w else None
    return dx, dL, dR


def tt_linear_halves(x: Tensor, cores: Sequence[Tensor], d: int,
                     bias: Tensor | None = None, gates: Sequence[Tensor] | Tensor = (),
                     tau: float = 0.0, alive: Sequence[Tensor] | Tensor = ()) -> Tensor:
    """Two-half path. ``x``: ``(B, N)``; returns ``(B, M)`` (``+ bias``, fused into the
    batch GEMMs). ``gates`` (with ``tau`` and optional ``alive``, as in
    :func:`comera_engine.tensor.tt_linear`) are absorbed inside the Function: per bond,
    or all bonds' as one vector (a train's ``gate`` and ``alive``: its gradient is then
    one vector, with no split views and no concatenation after)."""
    return TTLinearHalves.apply(x, d, bias, *cores, *gate_args(gates, tau, alive))


class TTLinearReconstructed(GatedFunction, torch.autograd.Function):
    """The reconstructed path: ``W = L·R`` from the (gated) cores, then
    ``Y = X·W + b``, as one Function (gates absorbed inside, :class:`.gates.GatedFunction`).

    Forward: the gate mask and scaling, the merge chains, ``W = L·R`` and one ``addmm``.
    Backward: ``dX = dY·Wᵀ``, ``dW = Xᵀ·dY``, ``db = Σ_b dY``, ``dL = dW·Rᵀ``,
    ``dR = Lᵀ·dW`` and back through the merge chains into each core and gate. The same
    products autograd records for the module-level path, without its per-gate mask and
    cast ops (experiments/bench_launches.py counts them). Saves ``X``, ``L``, ``R``,
    ``W``, the prefixes, the suffixes and the (gated and raw) cores."""

    @staticmethod
    def forward(ctx, x: Tensor, d: int, bias: Tensor | None,  # type: ignore[override]
                *tensors: Tensor) -> Tensor:
        eff = TTLinearReconstructed._absorb(ctx, tensors, d)
        x = to_autocast(x)  # saved cast: half the bytes, no second cast in backward
        P, Q = merge_left(eff[:d]), merge_right(eff[d:])
        L, R = P[-1], Q[0]
        W = L @ R
        y = torch.addmm(bias.to(W.dtype), x, W) if bias is not None else x @ W
        ctx.d, ctx.has_bias = d, bias is not None
        TTLinearReconstructed._keep_autocast(ctx, x)
        save(ctx, x=x, L=L, R=R, W=W, eff=eff, P=P[:-1], Q=Q[1:])
        return y

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]  # noqa: ANN001
        return GatedFunction._run_backward(TTLinearReconstructed._backward, ctx, dy)

    @staticmethod
    def _backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ANN001
        d = ctx.d
        s = saved(ctx)
        need = ctx.needs_input_grad
        dx = dy @ s["W"].t() if need[0] else None
        dbias = dy.sum(0) if ctx.has_bias and need[2] else None
        grads: list[Tensor | None] = [None] * (2 * d)
        if any(need[3:]):
            dW = s["x"].t() @ dy
            eff = s["eff"]
            grads = [*merge_left_grads(eff[:d], s["P"], dW @ s["R"].t()),
                     *merge_right_grads(eff[d:], s["Q"], s["L"].t() @ dW)]
        return TTLinearReconstructed._finish(ctx, dx, dbias, grads)


def tt_linear_reconstructed(x: Tensor, cores: Sequence[Tensor], d: int,
                            bias: Tensor | None = None, gates: Sequence[Tensor] | Tensor = (),
                            tau: float = 0.0, alive: Sequence[Tensor] | Tensor = ()
                            ) -> Tensor:
    """The reconstructed path (:class:`TTLinearReconstructed`): ``W`` from the gated
    cores, one GEMM. ``x``: ``(B, N)``; returns ``(B, M)`` (``+ bias``). ``gates`` as in
    :func:`tt_linear_halves` (per bond, or all bonds as one vector)."""
    return TTLinearReconstructed.apply(x, d, bias, *cores, *gate_args(gates, tau, alive))


def tt_linear_halves_reference(x: Tensor, cores: Sequence[Tensor], d: int,
                               bias: Tensor | None = None, gates: Sequence[Tensor] = (),
                               tau: float = 0.0, alive: Sequence[Tensor] = ()) -> Tensor:
    """Plain PyTorch (autograd through every op): gates applied to the cores, ``W = L·R``
    formed, ``Y = X·W (+ bias)``. ``x``: ``(B, N)``; returns ``(B, M)``."""
    if gates:
        cores = apply_gates(cores, gates, gate_masks(gates, tau, alive or None))
    W = merge_left(cores[:d])[-1] @ merge_right(cores[d:])[0]
    y = x @ W
    return y + bias if bias is not None else y
