"""The merge chains of a TT matrix's halves and their backward (shared by the ops).

Input half ``L = G_1⋯G_d`` as prefixes ``P_k`` (:func:`merge_left`), output half
``R = G_{d+1}⋯G_{2d}`` as suffixes ``Q_j`` (:func:`merge_right`), the gradients back
through each chain, and :func:`layout`, the factors and ranks read off core shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
from torch import Tensor

__all__ = ["contract_chain", "layout", "left_mat", "merge_left", "merge_left_grads",
           "merge_right", "merge_right_grads", "right_mat"]


def left_mat(G: Tensor) -> Tensor:
    """A core ``(r0, n, r1)`` as the ``(r0·n, r1)`` matrix (a view when contiguous)."""
    return G.reshape(-1, G.shape[-1])


def right_mat(G: Tensor) -> Tensor:
    """A core ``(r0, n, r1)`` as the ``(r0, n·r1)`` matrix (a view when contiguous)."""
    return G.reshape(G.shape[0], -1)


def contract_chain(cores: Sequence[Tensor]) -> Tensor:
    """Contract a train of cores ``(r_{k-1}, *s_k, r_k)`` left to right (``r_0 = r_d =
    1``): the full tensor flattened, ``(∏_k ∏ s_k, 1)``, modes in core order. Shapes are
    read as Python ints, so an ONNX trace keeps them static."""
    acc = cores[0].reshape(-1, int(cores[0].shape[-1]))
    for c in cores[1:]:
        acc = (acc @ c.reshape(int(c.shape[0]), -1)).reshape(-1, int(c.shape[-1]))
    return acc


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



@lru_cache(maxsize=4096)
def layout(shapes: tuple[torch.Size, ...], d: int
            ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Input factors, output factors and ranks ``(1, r_1, …, r_{2d-1}, 1)`` of cores with
    these shapes (cached: read every forward)."""
    ins = tuple(int(s[1]) for s in shapes[:d])
    outs = tuple(int(s[1]) for s in shapes[d:])
    return ins, outs, (1, *(int(s[-1]) for s in shapes[:-1]), 1)
