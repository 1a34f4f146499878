"""The TT-matrix linear, factorised: ``Y = X·W`` with ``X`` contracted with one core at a
time, ``W`` never formed.

``W[(i_1..i_d), (j_1..j_d)] = E_1[:, i_1, j_1, :] ⋯ E_d[:, i_d, j_d, :]`` for the gated
cores ``E_k`` ``(r_{k-1}, n_k, m_k, r_k)`` (``E_k = G_k · diag(g_k)``, masked as
:func:`comera_engine.ops.gates.absorb_gates`). The state before core ``k`` holds, per row
``b`` and output modes ``j_1..j_{k-1}`` done so far, a ``(r_{k-1}, i_k, …, i_d)`` block::

    S_k[(b, j_<k), (r_{k-1}, i_k), i_>k]
    S_{k+1}[(b, j_<k, j_k), (r_k, i_{k+1}), i_>k+1] = Σ_{r_{k-1}, i_k} S_k · E_k

one GEMM of ``(B·J_<k·I_>k) × (r_{k-1}·n_k) × (m_k·r_k)`` a core, so the batch work is
``B·Σ_k J_<k·I_>k·r_{k-1}·n_k·m_k·r_k`` MACs: below ``B·N·M`` only at small ranks, which
is why the planner weighs it against materialising ``W`` (:mod:`.ttm_matrix`) per case.
Autograd differentiates it (every step a PyTorch op); :func:`ttm_linear_reference` forms
``W`` (:func:`.ttm_matrix.ttm_matrix_reference`) and is what it is tested against
(tests/test_paths.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .gates import absorb_gates
from .ttm_matrix import ttm_matrix_reference

__all__ = ["ttm_linear_reference", "ttm_linear_sweep"]


def _gated(cores: Sequence[Tensor], gates: Sequence[Tensor], alive: Sequence[Tensor],
           tau: float) -> list[Tensor]:
    if not gates:
        return list(cores)
    alive = alive or [torch.ones(g.shape, dtype=torch.bool, device=g.device) for g in gates]
    return absorb_gates(cores, gates, tau, alive)


def ttm_linear_sweep(x: Tensor, cores: Sequence[Tensor], gates: Sequence[Tensor] = (),
                     alive: Sequence[Tensor] = (), tau: float = 0.0,
                     bias: Tensor | None = None) -> Tensor:
    """``X·W (+ bias)`` core by core (module doc). ``x``: ``(B, ∏ n_k)``; ``cores``
    ``(r_{k-1}, n_k, m_k, r_k)``; ``gates``/``alive``: the ``d-1`` bonds' (empty: the cores
    as they are); returns ``(B, ∏ m_k)``."""
    B, N = x.shape
    if N != math.prod(int(c.shape[1]) for c in cores):
        raise ValueError(f"x: {N} columns, the cores take {math.prod(c.shape[1] for c in cores)}")
    state, J, rest = x, 1, N
    for E in _gated(cores, gates, alive, tau):
        r0, n, m, r1 = (int(s) for s in E.shape)
        rest //= n
        s = state.reshape(B * J, r0 * n, rest).transpose(1, 2)  # (B·J, rest, r0·n)
        s = s.reshape(-1, r0 * n) @ E.reshape(r0 * n, m * r1).to(s.dtype)
        s = s.reshape(B * J, rest, m, r1).permute(0, 2, 3, 1)  # (B·J, m, r1, rest)
        J *= m
        state = s.reshape(B * J, r1 * rest)
    y = state.reshape(B, J)
    return y + bias.to(y.dtype) if bias is not None else y


def ttm_linear_reference(x: Tensor, cores: Sequence[Tensor], gates: Sequence[Tensor] = (),
                         alive: Sequence[Tensor] = (), tau: float = 0.0,
                         bias: Tensor | None = None) -> Tensor:
    """The plain path: ``W`` from the gated cores, then ``X·W (+ bias)``."""
    alive = alive or [torch.ones(g.shape, dtype=torch.bool, device=g.device) for g in gates]
    y = x @ ttm_matrix_reference(cores, gates, alive, tau)
    return y + bias if bias is not None else y
