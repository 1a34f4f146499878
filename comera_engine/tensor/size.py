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

Over many trains at once the sum is a quadratic form: with ``R = (1, R_1, …, R_B)`` the
ranks of all bonds (a leading 1 for the outer sides), ``Σ_c s_c·R_left(c)·R_right(c) =
Rᵀ Q R`` where ``Q`` holds each core's ``s_c`` (halved, symmetric) at its two sides; and
the gates' l1 norms are a linear map of their magnitudes, ``R = e₀ + M·|g ⊙ active|``.
:func:`surrogate` computes ``Ŝ`` so for all TT layers of a model, in plain PyTorch over
``M`` and ``Q`` built once per structure (:func:`size_form`): no host read, no
data-dependent shapes, so it runs the same eagerly, on the CPU and GPU, and inside a CUDA
graph. Everything that counts a train's size (the layers' ``num_params``, the target
plan, the pace, the preview, the report, the objective's ``S``) calls :func:`tt_size`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .tt import TensorTrain

__all__ = ["SizeForm", "core_sizes", "gate_entries", "refresh_entries", "size_form", "surrogate",
           "tt_size"]

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
class SizeForm:
    """The size of some trains laid end to end as a quadratic form (:func:`size_form`).
    ``E`` gate entries (every train's bonds in order), ``B`` bonds:

    - ``M`` ``(B+1, E)``: row ``b`` sums bond ``b``'s entries (row 0, the outer sides', is
      empty), so ``R = e0 + M·a`` are the bonds' norms (or counts) of entry values ``a``;
    - ``e0`` ``(B+1,)``: ``[1, 0, …, 0]``;
    - ``Q`` ``(B+1, B+1)``: symmetric, ``s_c / 2`` at ``(left, right)`` and
      ``(right, left)`` for every core ``c``, so ``RᵀQR = Σ_c core_sizes(s_c, R_left,
      R_right)``;
    - ``tau``: each entry's threshold ``(E,)``, or one float when every train has the
      same.
    """

    M: Tensor
    e0: Tensor
    Q: Tensor
    tau: Tensor | float


@lru_cache(maxsize=64)
def _size_form(structure: tuple[tuple[tuple[int, ...], tuple[int, ...], float], ...],
              device: torch.device, dtype: torch.dtype) -> SizeForm:
    """The :class:`SizeForm` of trains whose ``structure`` is, per train, ``(internal
    ranks, mode sizes, tau)`` (:meth:`TensorTrain.structure`), on ``device`` in ``dtype``.
    Cached: built once per structure, device and dtype."""
    bonds = sum(len(ranks) for ranks, _, _ in structure)
    entries = sum(sum(ranks) for ranks, _, _ in structure)
    M = torch.zeros(bonds + 1, entries, dtype=dtype)
    Q = torch.zeros(bonds + 1, bonds + 1, dtype=dtype)
    taus: list[float] = []
    bond = entry = 0
    for ranks, modes, tau in structure:
        first = bond + 1  # this train's first bond in R = (1, R_1, …)
        for k, r in enumerate(ranks):
            M[first + k, entry : entry + r] = 1.0
            entry += r
        taus += [tau] * sum(ranks)
        K = len(modes)
        for k, s in enumerate(modes):
            left = first + k - 1 if k > 0 else 0
            right = first + k if k < K - 1 else 0
            Q[left, right] += s / 2
            Q[right, left] += s / 2
        bond += len(ranks)
    tau: Tensor | float = taus[0] if len(set(taus)) <= 1 and taus else torch.tensor(
        taus, dtype=dtype)
    e0 = torch.zeros(bonds + 1, dtype=dtype)
    e0[0] = 1.0
    return SizeForm(M.to(device), e0.to(device), Q.to(device),
                    tau if isinstance(tau, float) else tau.to(device))


#: :func:`_size_form` left out of ``torch.compile``'s graphs (Dynamo would trace through
#: the cache and build ``M`` and ``Q`` again in every step). The wrapper imports Dynamo
#: on its first call only, and an eager step never calls it: it neither imports Dynamo
#: (seconds) nor passes through its frame hook (µs a call: per cent of a small step)
_size_form_outside_graphs: Callable[..., SizeForm] = torch._disable_dynamo(_size_form)


def size_form(structure: tuple[tuple[tuple[int, ...], tuple[int, ...], float], ...],
              device: torch.device, dtype: torch.dtype) -> SizeForm:
    """:func:`_size_form` (cached), kept out of Dynamo's graphs when Dynamo traces it."""
    if torch.compiler.is_compiling():
        return _size_form_outside_graphs(structure, device, dtype)
    return _size_form(structure, device, dtype)


size_form.cache_clear = _size_form.cache_clear  # type: ignore[attr-defined]
size_form.cache_info = _size_form.cache_info  # type: ignore[attr-defined]


def gate_entries(trains: Sequence[TensorTrain]) -> tuple[Tensor, Tensor, SizeForm]:
    """Every gate entry of ``trains`` in one vector, its ``alive`` flags, and their
    :class:`SizeForm` (read straight from the modules' registries: a module attribute
    lookup costs more than the concatenation on a small model)."""
    gates = [t._parameters["gate"] for t in trains]
    alive = [t._buffers["alive"] for t in trains]
    g = torch.cat(gates) if len(gates) > 1 else gates[0]
    a = torch.cat(alive) if len(alive) > 1 else alive[0]
    return g, a, size_form(tuple(t.structure() for t in trains), g.device, g.dtype)


def surrogate(trains: Sequence[TensorTrain]) -> Tensor:
    """``Ŝ`` summed over ``trains``: :func:`tt_size`'s formula with every internal rank
    replaced by the l1 norm of the bond's active gates (alive and ``|g| > tau``),
    differentiable in the gates (their dtype; autograd's gradient). A train without bonds
    counts its cores. Shapes: each train's ``gate`` ``(Σ_k r_k,)``; the result a 0-d
    tensor. Half a dozen ops for any number of layers: each costs more than its
    arithmetic on a small model, so the form is the fewest that express it."""
    if not trains:
        return torch.zeros(())
    g, alive, form = gate_entries(trains)
    if isinstance(form.tau, float):  # g where |g| > tau, else 0; dead entries 0
        kept = torch.nn.functional.hardshrink(g, form.tau) * alive
    else:
        kept = torch.where(g.abs() > form.tau, g, 0.0) * alive
    R = torch.addmv(form.e0, form.M, kept.abs())  # (1, ‖g_1‖₁, …, ‖g_B‖₁)
    return torch.dot(R, torch.mv(form.Q, R))


@lru_cache(maxsize=64)
def _bond_index(structure: tuple[tuple[tuple[int, ...], tuple[int, ...], float], ...],
                device: torch.device) -> tuple[Tensor, Tensor, list[int]]:
    """Per gate entry of trains of this ``structure``: its bond (``(E,)``, 0-based over
    all trains' bonds) and its position ``0..E-1``; and each train's entry count."""
    bonds = [b for b, r in enumerate(r for ranks, _, _ in structure for r in ranks)
             for _ in range(r)]
    sizes = [sum(ranks) for ranks, _, _ in structure]
    return (torch.tensor(bonds, dtype=torch.long, device=device),
            torch.arange(sum(sizes), device=device), sizes)


@torch.no_grad()
def refresh_entries(trains: Sequence[TensorTrain], floor: bool = True) -> Tensor:
    """The gate refresh of :meth:`TensorTrain.refresh_` for all ``trains`` at once, as
    device work without host reads (a CUDA graph can capture it): per bond, entries
    with ``|g| <= tau`` die for good and are zeroed, except that (with ``floor``) a bond
    about to lose its last alive entry keeps its strongest one (the first of the largest
    ``|g|``), held at ``±1.5·tau``. Returns the alive count of every bond, trains in
    order, ``(B,)`` int64.

    The verdicts of each train's host :meth:`TensorTrain.refresh_` (bit for bit), with
    segment reductions over all entries (``E`` gate entries, ``B`` bonds: the bonds'
    alive / survivor counts by the :class:`SizeForm`'s ``M``, the strongest entry by
    ``scatter_reduce``): about 30
    ops for any number of layers instead of about 20 a bond, and each gate and ``alive``
    written back in one ``_foreach_copy_``."""
    trains = [t for t in trains if t.bond_ranks]
    if not trains:
        return torch.zeros(0, dtype=torch.long)
    g, alive, form = gate_entries(trains)
    g = g.detach()
    bond, pos, sizes = _bond_index(tuple(t.structure() for t in trains), g.device)
    nb = form.M.shape[0] - 1
    M = form.M[1:]  # (B, E): bond b's entries (counts exact in fp32 to 2^24)
    if M.dtype not in (torch.float32, torch.float64):
        M = M.float()
    mag = g.abs()
    surv = alive & (mag > form.tau)
    n_alive = torch.mv(M, alive.to(M.dtype))
    rescue = (n_alive > 0) & (torch.mv(M, surv.to(M.dtype)) == 0)
    if not floor:
        rescue = torch.zeros_like(rescue)
    # the strongest alive entry of each bond: the first position of its largest |g|
    key = torch.where(alive, mag, -1.0)
    top = key.new_full((nb,), -2.0).scatter_reduce(0, bond, key, "amax")
    first = torch.where(key == top[bond], pos, pos.shape[0])
    first = torch.full((nb,), pos.shape[0], dtype=pos.dtype, device=g.device).scatter_reduce(
        0, bond, first, "amin")
    keep = (pos == first[bond]) & rescue[bond]
    held = torch.where(g < 0, -1.5 * form.tau, 1.5 * form.tau).to(g.dtype)
    now_alive = alive & (surv | keep)
    new_g = torch.where(now_alive, torch.where(keep, held, g), 0.0)
    torch._foreach_copy_([t._parameters["gate"].detach() for t in trains],
                         list(new_g.split(sizes)))
    torch._foreach_copy_([t._buffers["alive"] for t in trains], list(now_alive.split(sizes)))
    return torch.mv(M, now_alive.to(M.dtype)).round().long()
