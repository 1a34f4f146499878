"""Model size ``S`` and its differentiable surrogate ``Ŝ`` (comera-method.md §1–§2).

For a TT layer with mode sizes ``s_k`` and effective ranks ``R_k`` (``R_0 = R_K = 1``):

    S_layer = Σ_k s_k · R_{k-1} · R_k            (0 if some R_k = 0)
    Ŝ_layer = Σ_k s_k · ‖g_{k-1}‖₁ · ‖g_k‖₁       (active gate entries only, ‖g_0‖₁ = ‖g_K‖₁ = 1)

so each gate entry is weighted by the parameters its bond controls
(``∂Ŝ/∂|g_k[j]| = s_k‖g_{k-1}‖₁ + s_{k+1}‖g_{k+1}‖₁``). With gates at 1, ``Ŝ`` equals
the cores' size.

One size, counted one way (the same as :func:`~comera_engine.layers.size_report`, the
preview and the export card; docs/SIZE_AND_TARGET.md):

- ``tensorized``: every parameter of the TT layers at their effective ranks, i.e. the
  cores plus a TT linear's bias; its dense equivalent is the dense layer with the same
  bias (``in·out + out``; an embedding table ``rows·dim``).
- ``other``: every parameter outside the TT layers (dense linears, norms, heads, their
  biases), counted the same on both sides. Gate vectors count nowhere (training controls,
  absorbed into the cores on export).
- ``model`` = ``tensorized + other``.

The TT biases are a constant in ``S`` (the surrogate ``Ŝ`` is the cores' part only, which
is all the gates can change).
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor, nn

from ..layers import TTEmbedding, TTLinear, peer_layers, tt_layers
from .target import LayerSpec, SizeSpec

__all__ = ["dense_size", "effective_size", "layer_size", "layer_size_surrogate", "min_size",
           "model_sizes", "size_spec", "surrogate_size"]


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
    """``Σ Ŝ_layer`` over the TT layers of ``model`` (as :func:`layer_size_surrogate`
    per layer, summed), in one pass over all gates of the model.

    Called every training step: per layer and bond it would be a few dozen small ops
    for every layer (``experiments/bench_step_overheads.py``). Instead, with ``g`` all gate entries
    concatenated: ``a = |g|`` where active else 0; bond norms ``R`` as row sums of ``a``
    gathered into a (bonds × largest rank) table padded with zeros; then
    ``Σ s · R[left] · R[right]`` over every core of every layer, the indices (``R[0] = 1``
    for the outer bonds) built once per model structure (:func:`_surrogate_plan`). No
    scatter-add: every sum has a fixed order, and in backward each gate entry and each
    bond norm receives at most two contributions, so the result and its gradients are
    the same run to run on GPUs too."""
    layers = [m for _, m in tt_layers(model)]
    if not layers:
        return torch.zeros(())
    parts = [m.tt.parts() for m in layers]
    gates = [g for _, gs, _ in parts for g in gs]
    if not gates:
        return torch.stack([layer_size_surrogate(m) for m in layers]).sum()
    g = torch.cat(gates)
    alive = torch.cat([a for _, _, al in parts for a in al])
    key = tuple((tuple(int(v.shape[0]) for v in gs), tuple(m.tt.mode_sizes), m.tt.tau)
                for m, (_, gs, _) in zip(layers, parts))
    table, tau, li, ri, sizes = _surrogate_plan(key, g.device, g.dtype)
    a = g.abs()
    a = torch.where(alive & (a > tau), a, 0.0)
    R = torch.cat([g.new_ones(1), torch.cat([a, a.new_zeros(1)])[table].sum(1)])
    return (sizes * R[li] * R[ri]).sum()


@lru_cache(maxsize=64)
def _surrogate_plan(key: tuple, device: torch.device, dtype: torch.dtype
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Index tensors for :func:`surrogate_size`. ``key``: per layer (gate sizes, mode
    sizes, tau). Returns the (bonds × largest rank) table of each bond's entry positions
    in the concatenated gates (padded with the position one past the end, a zero); per
    gate entry its tau; per core the indices of its left and right bond norms in
    ``[1, R_1, …]`` (0: an outer bond, norm 1) and its mode size."""
    rows: list[list[int]] = []
    tau, li, ri, sizes = [], [], [], []
    bond = pos = 0
    for gsizes, modes, t in key:
        first = bond + 1  # position of this layer's first bond norm in [1, R...]
        for r in gsizes:
            rows.append(list(range(pos, pos + r)))
            pos += r
            tau += [t] * r
        K = len(modes)
        for k, s in enumerate(modes):
            li.append(first + k - 1 if k > 0 else 0)
            ri.append(first + k if k < K - 1 else 0)
            sizes.append(float(s))
        bond += len(gsizes)
    width = max([1, *(len(r) for r in rows)])
    table = [r + [pos] * (width - len(r)) for r in rows]
    return tuple(torch.tensor(v, dtype=dt, device=device)  # type: ignore[return-value]
                 for v, dt in ((table, torch.long), (tau, dtype), (li, torch.long),
                               (ri, torch.long), (sizes, dtype)))


def _other_params(model: nn.Module) -> int:
    tt_ids = set()
    for _, m in tt_layers(model) + peer_layers(model):
        tt_ids.update(id(p) for p in m.parameters())
    return sum(p.numel() for p in model.parameters() if id(p) not in tt_ids)


def _bias(layer: nn.Module) -> int:
    """Parameters of a TT layer outside its cores and gates (a TT linear's bias)."""
    b = getattr(layer, "bias", None)
    return int(b.numel()) if isinstance(b, Tensor) else 0


def model_sizes(model: nn.Module) -> dict[str, int]:
    """Effective sizes: ``tensorized`` (TT layers: cores at the effective ranks + bias),
    ``other`` (every parameter outside the TT layers) and ``model`` (their sum)."""
    tt = sum(layer_size(m) + _bias(m) for _, m in tt_layers(model))
    other = _other_params(model)
    return {"tensorized": tt, "other": other, "model": tt + other}


def dense_size(model: nn.Module) -> dict[str, int]:
    """Sizes of the dense equivalent: TT layers as dense matrices/tables (with the bias)."""
    tt = 0
    for _, m in tt_layers(model):
        tt += (m.in_features * m.out_features if isinstance(m, TTLinear)
               else m.num_embeddings * m.embedding_dim) + _bias(m)
    other = _other_params(model)
    return {"tensorized": tt, "other": other, "model": tt + other}


def min_size(model: nn.Module) -> dict[str, int]:
    """Smallest reachable size: every bond at rank 1 (``Σ s_k`` + bias per layer)."""
    tt = sum(sum(m.tt.mode_sizes) + _bias(m) for _, m in tt_layers(model))
    other = _other_params(model)
    return {"tensorized": tt, "other": other, "model": tt + other}


def effective_size(model: nn.Module, scope: str) -> Tensor:
    """Effective size ``S`` (``"tensorized"`` or ``"model"``; ``"cores"``: the TT cores
    alone, no bias) as a device tensor: per TT layer ``Σ_k s_k R_{k-1} R_k`` over
    gate-mask counts (0 if a bond is dead) + bias."""
    total: Tensor | None = None
    for _, layer in tt_layers(model):
        tt = layer.tt
        counts = [m.sum().to(torch.float64) for m in tt.masks()]
        one = tt.cores[0].new_ones((), dtype=torch.float64)
        ranks = [one, *counts, one]
        size = sum(s * ranks[k] * ranks[k + 1] for k, s in enumerate(tt.mode_sizes))
        alive = torch.stack([r > 0 for r in ranks]).all()
        size = torch.where(alive, size, torch.zeros_like(size))
        if scope != "cores":
            size = size + _bias(layer)
        total = size if total is None else total + size
    if total is None:
        total = torch.zeros((), dtype=torch.float64)
    if scope == "model":
        total = total + dense_size(model)["other"]
    return total


def size_spec(model: nn.Module) -> SizeSpec:
    """The shapes :func:`comera_engine.rank.target.plan_target` needs, read off ``model``
    (a meta-device model is enough: only shapes and allocated ranks are read).

    The engine's TT layers first, then the peer (tltorch) layers, each in model order
    (a model has one kind or the other; the fixed-rank plans list ranks in this order)."""
    peers = tuple(
        LayerSpec(
            kind="linear" if hasattr(m, "in_features") else "embedding",
            mode_sizes=tuple(m.mode_sizes),
            ranks=tuple(m.effective_ranks()),
            bias=_bias(m),
            dense=m.dense_num_params(),
        )
        for _, m in peer_layers(model)
    )
    layers = tuple(
        LayerSpec(
            kind="linear" if isinstance(m, TTLinear) else "embedding",
            mode_sizes=tuple(int(s) for s in m.tt.mode_sizes),
            ranks=tuple(int(r) for r in m.tt.ranks[1:-1]),
            bias=_bias(m),
            dense=(m.in_features * m.out_features if isinstance(m, TTLinear)
                   else m.num_embeddings * m.embedding_dim) + _bias(m),
        )
        for _, m in tt_layers(model)
    )
    return SizeSpec(layers + peers, _other_params(model))
