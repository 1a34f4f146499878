"""The halves of many TT linears of one structure at once: ``L_i = G_1⋯G_d``,
``R_i = G_{d+1}⋯G_{2d}`` of ``n`` trains with the same core shapes, gated, in one pass.

A transformer's TT linears come in a few shapes (the paper's: 24 of 768×768, 6 of
768×3072, 6 of 3072×768), and every one of them merges its cores the same way: per
train, the gating (a few kernels), ``2(d-1)`` merge products forward and twice that
backward, each a tiny kernel. Done for all trains of a shape at once, the gating is one
pass over all their cores and each merge one batched product (``torch.bmm`` over the
trains), forward and backward: the kernels a step launches for the merges stop growing
with the number of layers. :class:`HalvesGroup` is the ``autograd.Function`` (gates
absorbed inside as :class:`.gates.GatedFunction` does for one train, the cores laid out
by :func:`.gates.flat_plan`), :func:`tt_halves_group` its entry point and
:func:`tt_halves_group_reference` the plain PyTorch reference it is tested against
(tests/test_op_tt_halves_group.py). A layer then runs its batch products on its own
``(L_i, R_i)`` (:func:`comera_engine.tensor.planner.tt_linear` inside
:func:`comera_engine.tensor.grouped.grouped_halves`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .gates import apply_gates, flat_plan, gate_flat, gate_masks, gate_sums, masked_gates
from .merges import merge_left, merge_right
from .tt_linear_halves import padded_width

__all__ = ["HalvesGroup", "tt_halves_group", "tt_halves_group_reference"]


def _bmerge_left(cores: Sequence[Tensor]) -> list[Tensor]:
    """:func:`.merges.merge_left` over a leading axis of ``b`` trains: ``cores[k]``
    ``(b, r_{k-1}, n_k, r_k)``; returns the prefixes ``(b, n_1⋯n_k, r_k)``."""
    b = cores[0].shape[0]
    P = cores[0].reshape(b, -1, cores[0].shape[-1])
    out = [P]
    for G in cores[1:]:
        _, r0, n, r1 = G.shape
        P = torch.bmm(P, G.reshape(b, r0, n * r1)).reshape(b, -1, r1)
        out.append(P)
    return out


def _bmerge_right(cores: Sequence[Tensor]) -> list[Tensor]:
    """:func:`.merges.merge_right` over a leading axis of ``b`` trains: returns the
    suffixes ``(b, r_{j-1}, m_j⋯m_d)``."""
    b = cores[-1].shape[0]
    Q = cores[-1].reshape(b, cores[-1].shape[1], -1)
    out = [Q]
    for G in reversed(cores[:-1]):
        _, r0, m, r1 = G.shape
        Q = torch.bmm(G.reshape(b, r0 * m, r1), Q).reshape(b, r0, -1)
        out.append(Q)
    return out[::-1]


def _bmerge_left_grads(cores: Sequence[Tensor], P: Sequence[Tensor], dL: Tensor
                       ) -> list[Tensor]:
    """Backward of :func:`_bmerge_left` (``P``: the prefixes ``P_1..P_{d-1}``)."""
    b = dL.shape[0]
    grads: list = [None] * len(cores)
    dP = dL
    for k in range(len(cores) - 1, 0, -1):
        _, r0, n, r1 = cores[k].shape
        dPk = dP.reshape(b, -1, n * r1)
        grads[k] = torch.bmm(P[k - 1].transpose(1, 2), dPk)
        dP = torch.bmm(dPk, cores[k].reshape(b, r0, n * r1).transpose(1, 2))
    grads[0] = dP
    return grads


def _bmerge_right_grads(cores: Sequence[Tensor], Q: Sequence[Tensor], dR: Tensor
                        ) -> list[Tensor]:
    """Backward of :func:`_bmerge_right` (``Q``: the suffixes ``Q_2..Q_d``)."""
    b = dR.shape[0]
    grads: list = [None] * len(cores)
    dQ = dR
    for j in range(len(cores) - 1):
        _, r0, m, r1 = cores[j].shape
        dQj = dQ.reshape(b, r0 * m, -1)
        grads[j] = torch.bmm(dQj, Q[j].transpose(1, 2))
        dQ = torch.bmm(cores[j].reshape(b, r0 * m, r1).transpose(1, 2), dQj)
    grads[-1] = dQ
    return grads


class HalvesGroup(torch.autograd.Function):
    """``(L_1, …, L_n, R_1, …, R_n)`` of ``n`` trains of ``2d`` cores each, the same
    shapes: train ``i``'s cores ``(r_{k-1}, s_k, r_k)`` gated by its one gate vector and
    ``alive`` flags (entry active where alive and ``|g| > tau``), ``L_i``: ``(N, r_p)``,
    ``R_i``: ``(r_p, M)``, in the autocast dtype where autocast is on, with the middle
    rank ``r_d`` zero-padded to ``r_p`` (:func:`.tt_linear_halves.padded_width`: a
    multiple of 8, at least 16): ``L_i·R_i`` is the weight exactly, and the GEMMs a layer
    runs on them are aligned.

    Forward: the trains' gates stacked ``(n, E)`` and masked, their cores laid end to end
    ``(n, P)`` (one copy), scaled by the gates through the layout's index and cast, once;
    then each merge one ``bmm`` over the trains. Backward: the ``n`` gradients of ``L``
    and of ``R`` stacked, back through the batched merges, then to the raw cores
    (``dE ⊙ v``) and the gates (``dE ⊙ raw`` summed over the entries each gate scales,
    zero where masked), as one vector each, cut into the trains' tensors (views)."""

    @staticmethod
    def forward(ctx, d: int, n: int, tau: float,  # type: ignore[override]  # noqa: ANN001
                *tensors: Tensor) -> tuple[Tensor, ...]:
        K = 2 * d
        cores = tensors[: n * K]
        gm = masked_gates(torch.stack(tensors[n * K : n * K + n]),
                          torch.stack(tensors[n * K + n :]), tau)  # (n, E)
        plan = flat_plan(tuple(c.shape for c in cores[:K]), d, gm.device)
        flat = _flatten_dense_tensors(cores).view(n, -1)  # (n, P), train-major
        gexp, eff = gate_flat(flat, gm, plan)
        views = [eff[:, s : s + shp.numel()].view(n, *shp)
                 for s, shp in zip(plan.starts, plan.shapes)]
        P, Q = _bmerge_left(views[:d]), _bmerge_right(views[d:])
        ctx.d, ctx.n, ctx.plan = d, n, plan
        ctx.m = gm != 0
        # intermediates, kept on ctx (the Function saves none of its inputs)
        ctx.keep = (flat, gexp, views, P[:-1], Q[1:], cores[:K])
        # the middle rank zero-padded (one pad per structure): every batch GEMM of the
        # layers then has a width and leading dimension that are multiples of 8 (on a GPU
        # cuBLAS otherwise falls back to its slow misaligned kernels)
        rd = P[-1].shape[-1]
        ctx.rd = rd
        pad = padded_width(rd, False) - rd
        Lp = torch.nn.functional.pad(P[-1], (0, pad)) if pad else P[-1]
        Rp = torch.nn.functional.pad(Q[0], (0, 0, 0, pad)) if pad else Q[0]
        return (*Lp.unbind(0), *Rp.unbind(0))

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]  # noqa: ANN001
        d, n, plan = ctx.d, ctx.n, ctx.plan
        flat, gexp, views, P, Q, like = ctx.keep
        rd = ctx.rd  # the padding's gradient is dropped: those entries are constant zeros
        dL = torch.stack(grads[:n])[..., :rd].to(views[0].dtype)
        dR = torch.stack(grads[n:])[:, :rd].to(views[0].dtype)
        d_eff = torch.cat([g.reshape(n, -1) for g in (*_bmerge_left_grads(views[:d], P, dL),
                                                        *_bmerge_right_grads(views[d:], Q, dR))],
                          dim=1)
        if d_eff.dtype != flat.dtype:
            d_eff = d_eff.to(flat.dtype)
        K = 2 * d
        need = ctx.needs_input_grad[3:]
        d_cores: list[Tensor | None] = [None] * (n * K)
        if any(need[: n * K]):
            d_cores = list(_unflatten_dense_tensors((d_eff * gexp).view(-1), list(like) * n))
            d_cores = [g if need[i] else None for i, g in enumerate(d_cores)]
        d_gates: list[Tensor | None] = [None] * n
        if any(need[n * K : n * K + n]):
            d_gate = torch.where(ctx.m, gate_sums(d_eff * flat, plan), 0.0)
            d_gates = [g if need[n * K + i] else None for i, g in enumerate(d_gate.unbind(0))]
        return (None, None, None, *d_cores, *d_gates, *([None] * n))


def tt_halves_group(trains: Sequence[tuple[Sequence[Tensor], Tensor, Tensor]], d: int,
                    tau: float) -> list[tuple[Tensor, Tensor]]:
    """``[(L_i, R_i)]`` of trains given as ``(cores, gate, alive)`` (a train's
    :meth:`~comera_engine.tensor.tt.TensorTrain.flat_parts`), all with the same core
    shapes and ``tau`` (:class:`HalvesGroup`), the middle rank zero-padded: ``L_i[:, :r_d]``
    and ``R_i[:r_d]`` are the halves, the rest zeros."""
    n = len(trains)
    out = HalvesGroup.apply(d, n, float(tau), *(c for cores, _, _ in trains for c in cores),
                            *(g for _, g, _ in trains), *(a for _, _, a in trains))
    return list(zip(out[:n], out[n:]))


def tt_halves_group_reference(trains: Sequence[tuple[Sequence[Tensor], Tensor, Tensor]],
                              d: int, tau: float) -> list[tuple[Tensor, Tensor]]:
    """Plain PyTorch, train by train (autograd through every op): the gates applied to
    the cores per bond, ``L`` and ``R`` merged."""
    out = []
    for cores, gate, alive in trains:
        sizes = [int(c.shape[-1]) for c in cores[:-1]]
        gates, flags = list(gate.split(sizes)), list(alive.split(sizes))
        eff = apply_gates(cores, gates, gate_masks(gates, tau, flags))
        out.append((merge_left(eff[:d])[-1], merge_right(eff[d:])[0]))
    return out
