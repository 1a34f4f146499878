"""Model size ``S`` and its differentiable surrogate ``Ŝ`` (comera-method.md §1–§2).

For a TT layer with mode sizes ``s_k`` and effective ranks ``R_k`` (``R_0 = R_K = 1``):

    S_layer = Σ_k s_k · R_{k-1} · R_k            (0 if some R_k = 0)
    Ŝ_layer = Σ_k s_k · ‖g_{k-1}‖₁ · ‖g_k‖₁       (active gate entries only, ‖g_0‖₁ = ‖g_K‖₁ = 1)

so each gate entry is weighted by the parameters its bond controls
(``∂Ŝ/∂|g_k[j]| = s_k‖g_{k-1}‖₁ + s_{k+1}‖g_{k+1}‖₁``). With gates at 1, ``Ŝ = S``.
Non-tensorised parameters add a constant to ``S``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..layers import TTEmbedding, TTLinear, tt_layers

__all__ = ["layer_size", "layer_size_surrogate", "model_sizes", "surrogate_size",
           "min_size", "dense_size"]


def layer_size_surrogate(layer: TTLinear | TTEmbedding) -> Tensor:
    """``Ŝ`` of one layer (a differentiable scalar; gates only, cores not involved)."""
    tt = layer.tt
    norms = [g.abs().mul(m.to(g.dtype)).sum() for g, m in zip(tt.gates, tt.masks())]
    one = tt.gates[0].new_ones(()) if len(tt.gates) else tt.cores[0].new_ones(())
    R = [one, *norms, one]
    total = one * 0
    for k, s in enumerate(tt.mode_sizes):
        total = total + s * R[k] * R[k + 1]
    return total


def layer_size(layer: TTLinear | TTEmbedding) -> int:
    """``S`` of the layer's cores at their effective ranks."""
    return layer.tt.num_params(effective=True)


def surrogate_size(model: nn.Module) -> Tensor:
    """``Σ Ŝ_layer`` over the TT layers of ``model``."""
    parts = [layer_size_surrogate(m) for _, m in tt_layers(model)]
    if not parts:
        return torch.zeros(())
    return torch.stack(parts).sum()


def _other_params(model: nn.Module) -> int:
    tt_ids = set()
    for _, m in tt_layers(model):
        tt_ids.update(id(p) for p in m.tt.parameters())
    return sum(p.numel() for p in model.parameters() if id(p) not in tt_ids)


def model_sizes(model: nn.Module) -> dict[str, int]:
    """Effective sizes: ``tensorized`` (TT cores), ``other`` (every other parameter but
    gates, biases of TT layers included) and ``model`` (their sum)."""
    tt = sum(layer_size(m) for _, m in tt_layers(model))
    other = _other_params(model)
    return {"tensorized": tt, "other": other, "model": tt + other}


def dense_size(model: nn.Module) -> dict[str, int]:
    """Sizes of the dense equivalent: TT weights as dense matrices/tables."""
    tt = 0
    for _, m in tt_layers(model):
        tt += (m.in_features * m.out_features if isinstance(m, TTLinear)
               else m.num_embeddings * m.embedding_dim)
    other = _other_params(model)
    return {"tensorized": tt, "other": other, "model": tt + other}


def min_size(model: nn.Module) -> dict[str, int]:
    """Smallest reachable size: every bond at rank 1 (``Σ s_k`` per layer)."""
    tt = sum(sum(m.tt.mode_sizes) for _, m in tt_layers(model))
    other = _other_params(model)
    return {"tensorized": tt, "other": other, "model": tt + other}
