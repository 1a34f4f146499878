"""The size of a tensor train and its differentiable surrogate: the one formula
(comera-method.md §1–§2, docs/SIZE_AND_TARGET.md).

A train of ``K`` cores with mode sizes ``s_k`` (``s_k = n_k`` for a TT-linear core,
``v_k·e_k`` for a TT-matrix core) and internal ranks ``R_1 … R_{K-1}`` (``R_0 = R_K = 1``)
holds

    S = Σ_k s_k · R_{k-1} · R_k                  (0 when some R_k = 0: the zero map)

parameters (:func:`core_sizes` is the term, :func:`tt_size` the sum). The CoMERA
objective's surrogate ``Ŝ`` is the same sum with each ``R_k`` replaced by the l1 norm of
the bond's active gate entries, ``‖g_k ⊙ active_k‖₁``, so each gate entry is weighted by
the parameters its bond controls; with every gate at 1, ``Ŝ = S``.

:func:`train_sizes` computes ``(Ŝ, S)`` for many trains at once, in plain PyTorch over an
index table built once per structure (:func:`size_index`): no host read, no data-dependent
shapes, so it runs the same eagerly, on the CPU and GPU, and inside a CUDA graph; ``Ŝ``'s
gradient comes from autograd. Everything else that counts a train's size (the layers'
``num_params``, the target plan, the pace, the preview, the report) calls
:func:`tt_size`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .tt import TensorTrain

__all__ = ["SizeIndex", "core_sizes", "size_index", "train_sizes", "tt_size"]

N = TypeVar("N", int, float, Tensor)


def core_sizes(s: N, left: N, right: N) -> N:
    """``s_k · R_{k-1} · R_k``: the parameters of core ``k`` (numbers, or tensors of one
    entry per core) from its mode size and the ranks (or gate norms) on either side."""
    return s * left * right


def tt_size(mode_sizes: Sequence[int], ranks: Sequence[int]) -> int:
    """``S = Σ_k s_k · R_{k-1} · R_k`` of a train with ``K = len(mode_sizes)`` cores and
    internal ranks ``ranks`` (length ``K-1``; ``R_0 = R_K = 1``); 0 when a rank is 0."""
    r = (1, *(int(x) for x in ranks), 1)
    if len(r) != len(mode_sizes) + 1:
        raise ValueError(f"ranks: {len(mode_sizes) - 1} internal ranks for {len(mode_sizes)} "
                         f"cores, got {len(ranks)}")
    if min(r) == 0:
        return 0
    return sum(core_sizes(int(s), r[k], r[k + 1]) for k, s in enumerate(mode_sizes))


@dataclass(frozen=True)
class SizeIndex:
    """Index tensors of some trains laid end to end (:func:`size_index`). ``E`` gate
    entries (every train's bonds in order), ``B`` bonds, ``C`` cores, ``L`` trains:

    - ``table`` ``(B, width)``: each bond's entry positions, padded with ``E`` (a zero
      appended to the entries), so a bond's norm is one gather and a row sum (no
      scatter: the same sums in the same order on every device);
    - ``tau`` ``(E,)``: each entry's threshold;
    - ``s``, ``left``, ``right`` ``(C,)``: each core's mode size and the positions of the
      ranks on its two sides in ``[1, R_1, …, R_B]`` (0: an outer side, rank 1);
    - ``core_train`` ``(C,)``, ``bond_train`` ``(B,)``: the train each core / bond is of.
    """

    table: Tensor
    tau: Tensor
    s: Tensor
    left: Tensor
    right: Tensor
    core_train: Tensor
    bond_train: Tensor
    trains: int


@lru_cache(maxsize=64)
def size_index(structure: tuple[tuple[tuple[int, ...], tuple[int, ...], float], ...],
               device: torch.device, dtype: torch.dtype) -> SizeIndex:
    """The :class:`SizeIndex` of trains whose ``structure`` is, per train, ``(internal
    ranks, mode sizes, tau)`` (:meth:`TensorTrain.structure`), on ``device``, ``tau`` and
    ``s`` in ``dtype``. Cached: built once per structure, device and dtype."""
    rows: list[list[int]] = []
    tau: list[float] = []
    s: list[float] = []
    left: list[int] = []
    right: list[int] = []
    core_train: list[int] = []
    bond_train: list[int] = []
    entry = bond = 0
    for t, (ranks, modes, threshold) in enumerate(structure):
        first = bond + 1  # this train's first rank in [1, R_1, …]
        for r in ranks:
            rows.append(list(range(entry, entry + r)))
            entry += r
            tau += [threshold] * r
            bond_train.append(t)
        K = len(modes)
        for k, size in enumerate(modes):
            s.append(float(size))
            left.append(first + k - 1 if k > 0 else 0)
            right.append(first + k if k < K - 1 else 0)
            core_train.append(t)
        bond += len(ranks)
    width = max([1, *(len(r) for r in rows)])
    table = [r + [entry] * (width - len(r)) for r in rows]

    def ints(v: list[int], shape: tuple[int, ...] | None = None) -> Tensor:
        out = torch.tensor(v, dtype=torch.long, device=device)
        return out.reshape(shape) if shape is not None else out

    return SizeIndex(ints([x for row in table for x in row], (len(table), width)),
                     torch.tensor(tau, dtype=dtype, device=device),
                     torch.tensor(s, dtype=dtype, device=device), ints(left), ints(right),
                     ints(core_train), ints(bond_train), len(structure))


def _bond_sums(values: Tensor, index: SizeIndex) -> Tensor:
    """``[1, Σ_{bond 1} values, …, Σ_{bond B} values]``: a rank per bond with the outer
    rank 1 in front (``values``: one per gate entry)."""
    padded = torch.cat([values, values.new_zeros(1)])
    return torch.cat([values.new_ones(1), padded[index.table].sum(1)])


def train_sizes(trains: Sequence[TensorTrain], sizes: bool = True
                ) -> tuple[Tensor, Tensor | None]:
    """``(Ŝ, S)`` summed over ``trains``: the surrogate (differentiable in the gates, in
    their dtype) and, with ``sizes``, the size at the effective ranks (float64, a
    constant; a train with an empty bond counts 0). Module doc for the formulas; a train
    without bonds counts its one core."""
    if not trains:
        zero = torch.zeros(())
        return zero, (zero.double() if sizes else None)
    gates = [t.gate for t in trains]
    g = torch.cat(gates) if len(gates) > 1 else gates[0]
    alive = torch.cat([t.alive for t in trains]) if len(trains) > 1 else trains[0].alive
    index = size_index(tuple(t.structure() for t in trains), g.device, g.dtype)
    active = alive & (g.abs() > index.tau)
    R = _bond_sums(torch.where(active, g.abs(), 0.0), index)
    s_hat = core_sizes(index.s, R[index.left], R[index.right]).sum()
    if not sizes:
        return s_hat, None
    n = _bond_sums(active.to(torch.float64), index)
    per_core = core_sizes(index.s.to(torch.float64), n[index.left], n[index.right])
    per_train = n.new_zeros(index.trains).index_add_(0, index.core_train, per_core)
    empty = n.new_zeros(index.trains).index_add_(0, index.bond_train, (n[1:] == 0).double())
    return s_hat, torch.where(empty > 0, 0.0, per_train).sum()
