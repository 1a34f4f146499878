"""The matrix of a gated TT matrix: ``W = ttm_matrix(cores, gates, alive, tau)``.

Cores ``G_k`` ``(r_{k-1}, n_k, m_k, r_k)`` (``r_0 = r_K = 1``), gates ``g_b`` ``(r_{b+1},)``
for the ``K-1`` internal bonds, absorbed on the right of core ``b``:
``E_b = G_b · diag(hardshrink(g_b, tau) ⊙ alive_b)``. Contracting ``E_0 … E_{K-1}``
left to right gives the modes ``(n_0, m_0, n_1, m_1, …)``; permuted to
``(n_0..n_{K-1}, m_0..m_{K-1})`` they are ``W`` ``(∏ n_k, ∏ m_k)``: a TT-linear weight
(inputs × outputs, the ``ttm`` layout) or a TTM embedding table (rows × dim).

:func:`ttm_matrix_reference` is the PyTorch reference (every step an autograd node).
:func:`ttm_matrix` hands float32/float64 CPU cores to the CPU backend
(``csrc/ttm_matrix.cpp``: the same products, one autograd node, backward by hand), and
runs the reference elsewhere (CUDA, autocast, other dtypes, a rank-0 bond, tracing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..backends import cpu_backend
from .gates import absorb_gates
from .merges import contract_chain

__all__ = ["ttm_matrix", "ttm_matrix_reference"]


def ttm_matrix_reference(cores: Sequence[Tensor], gates: Sequence[Tensor] = (),
                         alive: Sequence[Tensor] = (), tau: float = 0.0) -> Tensor:
    """``W`` ``(∏ n_k, ∏ m_k)`` in PyTorch ops (module doc). ``gates`` empty: the cores
    as they are; ``alive`` empty: every entry alive. A bond of rank 0 gives zeros."""
    rows = [int(c.shape[1]) for c in cores]
    cols = [int(c.shape[2]) for c in cores]
    if gates:
        alive = alive or [torch.ones(g.shape, dtype=torch.bool, device=g.device) for g in gates]
        cores = absorb_gates(cores, gates, tau, alive)
    if any(int(c.shape[-1]) == 0 for c in cores[:-1]):
        return cores[0].new_zeros(math.prod(rows), math.prod(cols))
    d = len(cores)
    t = contract_chain(cores).reshape([x for k in range(d) for x in (rows[k], cols[k])])
    perm = [2 * k for k in range(d)] + [2 * k + 1 for k in range(d)]
    return t.permute(perm).reshape(math.prod(rows), math.prod(cols))


def ttm_matrix(cores: Sequence[Tensor], gates: Sequence[Tensor] = (),
               alive: Sequence[Tensor] = (), tau: float = 0.0) -> Tensor:
    """``W`` ``(∏ n_k, ∏ m_k)`` (module doc): the CPU backend's node where it takes the
    call, else :func:`ttm_matrix_reference`. Differentiable in cores and gates."""
    if _native_ok(cores, gates, alive):
        backend = cpu_backend(cores[0])
        if backend is not None:
            return backend.ops.ttm_matrix(list(cores), list(gates), list(alive), float(tau))[0]
    return ttm_matrix_reference(cores, gates, alive, tau)


def _native_ok(cores: Sequence[Tensor], gates: Sequence[Tensor],
               alive: Sequence[Tensor]) -> bool:
    """Whether the backend's node takes these tensors: one float dtype, on the CPU, gates
    with their alive vectors and no empty bond, and no trace being recorded (a trace
    keeps the reference's ops)."""
    if not cores or torch.jit.is_tracing() or len(gates) != len(alive):
        return False
    dt = cores[0].dtype
    if gates and len(gates) != len(cores) - 1:
        return False
    return all(t.dtype == dt and t.device.type == "cpu" for t in (*cores, *gates)) and all(
        int(g.shape[0]) > 0 for g in gates) and all(c.dim() == 4 for c in cores)
