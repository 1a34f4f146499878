"""Rank gates inside the TT-linear ops, and tensors saved for backward by name.

Shared by :mod:`.tt_linear_halves` and :mod:`.tt_linear_sweep`: the gate masks
``alive_k & (|g_k| > tau)`` (:func:`gate_masks`), gates absorbed into the cores' bonds
(:func:`apply_gates`, the reference; :class:`GatedFunction`, inside a Function with no
autograd node per gate), and :func:`save` / :func:`saved`, which keep a Function's
tensors for backward under names instead of slice positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["GatedFunction", "absorb_gates", "apply_gates", "gate_args",
           "gate_masks", "save", "saved"]


def save(ctx, **groups: Tensor | Sequence[Tensor] | None) -> None:  # noqa: ANN001
    """``ctx.save_for_backward`` by name: each keyword a tensor, a sequence of tensors
    or None; :func:`saved` gives them back under the same names."""
    flat: list[Tensor] = []
    layout: list[tuple[str, int | None]] = []
    for name, v in groups.items():
        if v is None or isinstance(v, Tensor):
            layout.append((name, None if v is None else -1))
            flat.extend(() if v is None else (v,))
        else:
            layout.append((name, len(v)))
            flat.extend(v)
    ctx.save_for_backward(*flat)
    ctx.saved_layout = layout


def saved(ctx) -> dict[str, Tensor | list[Tensor] | None]:  # noqa: ANN001
    """What :func:`save` kept, by name (a tensor, a list of tensors, or None)."""
    it = iter(ctx.saved_tensors)
    return {name: None if n is None else next(it) if n == -1 else [next(it) for _ in range(n)]
            for name, n in ctx.saved_layout}


def apply_gates(cores: Sequence[Tensor], gates: Sequence[Tensor],
                masks: Sequence[Tensor]) -> list[Tensor]:
    """Absorb masked rank gates into the cores' right bonds: ``G_k · diag(g_k ⊙ m_k)``.

    ``cores[k]``: ``(r_{k-1}, …, r_k)`` for ``k < K``; ``gates[k]``, ``masks[k]`` (bool):
    ``(r_k,)`` for the ``K-1`` internal bonds. The last core is returned as is.
    Differentiable in cores and gates; masked entries give and get exactly zero.
    """
    return _scale_bonds(cores, [g * m.to(g.dtype) for g, m in zip(gates, masks)])


def absorb_gates(cores: Sequence[Tensor], gates: Sequence[Tensor], tau: float,
                 alive: Sequence[Tensor]) -> list[Tensor]:
    """``G_k · diag(hardshrink(g_k, tau) ⊙ alive_k)``: :func:`apply_gates` with the masks
    of :func:`gate_masks`, the same bits forward and backward (``hardshrink`` keeps ``g``
    where ``|g| > tau`` and passes the gradient there, 0 elsewhere), in two small ops a
    bond instead of a mask built over all bonds and three products: a third of the cost
    of the module path (forward and backward) on small cores, where each op costs more
    than its arithmetic. ``alive``: one bool ``(r_k,)`` a bond."""
    shrink = torch.nn.functional.hardshrink
    return _scale_bonds(cores, [shrink(g, tau) * a for g, a in zip(gates, alive)])


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


@dataclass(frozen=True)
class FlatPlan:
    """Cores of one structure laid end to end in one vector (:func:`flat_plan`)."""

    idx: Tensor  #: each entry's gate entry, from 1 (0: the ungated core's constant 1)
    shapes: list[torch.Size]  #: each core's shape
    starts: list[int]  #: where each core starts in the vector
    #: per bond, in gate order: (where its core starts, its core as the 2-D matrix
    #: whose rows (gate on the right bond) or columns (left) its entries sum over,
    #: whether the gate is on its right bond)
    bonds: list[tuple[int, tuple[int, int], bool]]


@lru_cache(maxsize=256)
def flat_plan(shapes: tuple[torch.Size, ...], d: int, device: torch.device) -> FlatPlan:
    """The :class:`FlatPlan` of cores of these ``shapes`` (``2d`` of them, gated as
    :func:`_gate_plan` says), its index on ``device``. Built once per structure."""
    numels = [math.prod(shp) for shp in shapes]
    starts = [sum(numels[:k]) for k in range(len(numels))]
    idx = torch.zeros(sum(numels), dtype=torch.long)
    bonds = []
    first = 1
    gate_plan = _gate_plan.__wrapped__ if torch.compiler.is_compiling() else _gate_plan
    for j, right in gate_plan(d):
        shp, n = shapes[j], numels[j]
        r = shp[-1] if right else shp[0]
        pos = torch.arange(n)
        idx[starts[j] : starts[j] + n] = first + (pos % r if right else pos // (n // r))
        bonds.append((starts[j], (n // r, r) if right else (r, n // r), right))
        first += r
    return FlatPlan(idx.to(device), list(shapes), starts, bonds)


def to_autocast(t: Tensor) -> Tensor:
    """``t`` in the autocast dtype where autocast is on for its device and ``t`` is
    float32 (as the first product that reads it would cast it), else ``t`` itself."""
    dev = t.device.type
    if torch.is_autocast_enabled(dev) and t.dtype == torch.float32:
        return t.to(torch.get_autocast_dtype(dev))
    return t


def masked_gates(gate: Tensor, alive: Tensor | None, tau: float) -> Tensor:
    """``g`` where active (alive and ``|g| > tau``), else 0: ``hardshrink`` (one op; its
    zeros are exactly the inactive entries, so ``!= 0`` is the mask) and the dead
    entries zeroed. Any shape; ``alive`` bool like ``gate``, or None for all alive."""
    gm = torch.nn.functional.hardshrink(gate, tau)
    return gm if alive is None else torch.where(alive, gm, 0.0)


def gate_flat(flat: Tensor, gm: Tensor, plan: FlatPlan) -> tuple[Tensor, Tensor]:
    """Cores laid end to end, ``flat`` ``(..., P)``, gated by the masked gates ``gm``
    ``(..., E)`` of the same leading shape: ``(gexp, E)`` with ``gexp = gm[idx]`` each
    entry's gate (1 on the ungated core) and ``E = flat ⊙ gexp`` in the autocast dtype
    (:func:`to_autocast`): one pass for every core."""
    gexp = torch.nn.functional.pad(gm, (1, 0), value=1.0).index_select(-1, plan.idx)
    return gexp, to_autocast(flat * gexp)


def gate_sums(dv: Tensor, plan: FlatPlan) -> Tensor:
    """Each gate entry's gradient before masking: ``dv = dE ⊙ raw`` ``(..., P)`` summed
    over the entries it scales (per bond, its core read in place as a matrix: over the
    rows for a gate on the right bond, the columns on the left); ``(..., E)``."""
    lead, P = dv.shape[:-1], dv.shape[-1]
    n = math.prod(lead)
    sums = [dv.as_strided((n, *mat), (P, mat[1], 1), start).sum(1 if right else 2)
            for start, mat, right in plan.bonds]
    return torch.cat(sums, dim=1).view(*lead, -1)


def gate_masks(gates: Sequence[Tensor], tau: float,
               alive: Sequence[Tensor] | None = None) -> list[Tensor]:
    """Per bond, the active gate entries: ``alive_k & (|g_k| > tau)`` (bool ``(r_k,)``).

    ``gates``: the ``K-1`` gate vectors; ``alive``: matching bool vectors (entries pruned
    for good are False) or None for all alive. One pass over all bonds."""
    if not gates:
        return []
    with torch.no_grad():
        m = torch.cat(list(gates)).abs() > tau
        if alive:
            m &= torch.cat(list(alive))
    return list(m.split([int(g.shape[0]) for g in gates]))



class GatedFunction:
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
        then, when gated, either the 2d-1 gates, the 2d-1 ``alive`` vectors and ``tau``,
        or (``ctx.flat``) all bonds' gates as one vector, their ``alive`` as one and
        ``tau`` (:func:`gate_args`); else empty lists and 0. The gates and alive vectors
        are returned per bond (views of the flat ones). Sets ``ctx.gated``, ``ctx.flat``."""
        n_g = 2 * d - 1
        extra = len(tensors) - 2 * d
        ctx.gated = extra > 0
        ctx.flat = extra == 3  # one gate vector (for d = 1 both forms are the same)
        raw = list(tensors[: 2 * d])
        if not ctx.gated:
            return raw, [], [], 0.0
        if ctx.flat:
            sizes = [int(c.shape[-1]) for c in raw[:-1]]
            return (raw, list(tensors[2 * d].split(sizes)), list(tensors[2 * d + 1].split(sizes)),
                    float(tensors[-1]))
        return (raw, list(tensors[2 * d : 2 * d + n_g]), list(tensors[2 * d + n_g : -1]),
                float(tensors[-1]))

    @staticmethod
    def _absorb(ctx, tensors: Sequence[Tensor], d: int) -> list[Tensor]:  # noqa: ANN001
        """``tensors``: the 2d cores, optionally followed by the gates, the bool ``alive``
        flags and the threshold ``tau`` (a float), per bond or flat (:meth:`_split`).
        Returns the gated cores and keeps what :meth:`_gate_grads` needs on ``ctx``.

        All cores are gated at once, laid end to end in one vector (:func:`flat_plan`):
        ``E = raw ⊙ gm[idx]`` with ``gm`` the masked gates (``alive_k & (|g_k| > tau)``,
        computed here in one pass over all bonds) and ``idx`` each core entry's gate entry
        (a constant 1 for the core that carries none). Under autocast the gated cores
        are cast to the autocast dtype in the same pass, once, instead of before every
        product that reads them (forward and backward): a handful of kernels per layer
        instead of two or three per core. The gated cores returned are views of that
        vector."""
        raw, gates, alive, tau = GatedFunction._split(ctx, tensors, d)
        if not ctx.gated:
            return raw
        flat_g = tensors[2 * d] if ctx.flat else torch.cat(gates)
        gm = masked_gates(flat_g, (tensors[2 * d + 1] if ctx.flat else torch.cat(alive))
                          if alive else None, tau)
        ctx.m = gm != 0  # the mask: alive and |g| > tau (> 0, so never a kept zero)
        ctx.sizes = [int(v.shape[0]) for v in gates]
        # traced by Dynamo, the plan is built in the graph (its cache bypassed: Dynamo
        # would bypass it anyway, with a warning); eagerly, once per structure
        plan_of = flat_plan.__wrapped__ if torch.compiler.is_compiling() else flat_plan
        ctx.plan = plan = plan_of(tuple(c.shape for c in raw), d, flat_g.device)
        flat = _flatten_dense_tensors(raw)  # one C++ call: the cat of the cores' views
        gexp, eff = gate_flat(flat, gm, plan)
        ctx.gate_flat = (flat, gexp)  # intermediates: kept on ctx, not saved inputs
        return list(_unflatten_dense_tensors(eff, raw))  # views of eff, the cores' shapes

    @staticmethod
    def _gate_grads(ctx, d_eff: list[Tensor | None], need: Sequence[bool]  # noqa: ANN001
                    ) -> list[Tensor | None]:
        """From gradients of the gated cores to the raw cores and the gates, all cores at
        once on the vector :meth:`_absorb` laid them in: ``E = raw ⊙ v`` gives
        ``d raw = dE ⊙ v`` and ``d v = dE ⊙ raw``, and each gate entry's gradient is the
        sum of ``d v`` over the entries it scales (one sum a bond: over all but the last
        axis of a core gated on its right bond, all but the first on its left), zero where
        masked. Returns grads for (cores, gates, alive, tau) in the order they were
        passed."""
        K = len(d_eff)
        n_g = K - 1
        flat, gexp = ctx.gate_flat
        plan = ctx.plan
        parts = [g if g is not None else flat.new_zeros(s) for g, s in zip(d_eff, plan.shapes)]
        d_flat = _flatten_dense_tensors(parts)
        if d_flat.dtype != flat.dtype:  # the autocast dtype: the gradients in the cores'
            d_flat = d_flat.to(flat.dtype)
        d_cores: list[Tensor | None] = [None] * K
        if any(need[:K]):
            d_raw = _unflatten_dense_tensors(d_flat * gexp, parts)
            d_cores = [p if need[k] else None for k, p in enumerate(d_raw)]
        if not any(need[K : K + n_g]):
            per = 1 if ctx.flat else n_g  # the gate and alive arguments: one, or one a bond
            return [*d_cores, *([None] * per), *([None] * per), None]
        d_gate = torch.where(ctx.m, gate_sums(d_flat * flat, plan), 0.0)
        if ctx.flat:  # one gradient for the one gate vector: no split
            return [*d_cores, d_gate if need[K] else None, None, None]
        d_gates = [g if need[K + k] else None for k, g in enumerate(d_gate.split(ctx.sizes))]
        return [*d_cores, *d_gates, *([None] * n_g), None]

    @staticmethod
    def _keep_autocast(ctx, x: Tensor) -> None:  # noqa: ANN001
        dev = x.device.type  # backward runs under the forward's autocast state (bf16)
        ctx.amp = (dev, torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else None

    @staticmethod
    def _run_backward(backward, ctx, dy: Tensor):  # noqa: ANN001, ANN205
        """``backward(ctx, dy)`` (a subclass's ``_backward``) under the forward's autocast
        state. Each subclass's ``backward`` is a staticmethod calling this (a classmethod
        ``backward`` is not traced by ``torch.compile``: it breaks the graph there)."""
        if ctx.amp is None:
            return backward(ctx, dy)
        with torch.autocast(ctx.amp[0], dtype=ctx.amp[1]):
            return backward(ctx, dy)

    @classmethod
    def _finish(cls, ctx, dx: Tensor | None, dbias: Tensor | None,  # noqa: ANN001
                grads: list[Tensor | None]) -> tuple[Tensor | None, ...]:
        """The Function's return value from the gradients of the (gated) cores."""
        need_cores = ctx.needs_input_grad[3:]
        if ctx.gated:
            return (dx, None, dbias, *cls._gate_grads(ctx, grads, need_cores))
        return (dx, None, dbias, *(g if need else None for g, need in zip(grads, need_cores)))

    @staticmethod
    def _finish_backend(ctx, dx: Tensor | None, dbias: Tensor | None,  # noqa: ANN001
                        g_cores: Sequence[Tensor], g_gates: Sequence[Tensor]
                        ) -> tuple[Tensor | None, ...]:
        """The Function's return value from the core and gate gradients the CPU backend
        computed (``None`` where not asked for)."""
        need = ctx.needs_input_grad
        cores = [g if need[3 + k] else None for k, g in enumerate(g_cores)]
        if not ctx.gated:
            return (dx, None, dbias, *cores)
        k0 = 3 + len(g_cores)
        if ctx.flat:
            got = bool(g_gates) and all(g is not None for g in g_gates)
            gate = torch.cat(list(g_gates)) if need[k0] and got else None
            return (dx, None, dbias, *cores, gate, None, None)
        gates = [g if need[k0 + b] else None for b, g in enumerate(g_gates)]
        return (dx, None, dbias, *cores, *gates, *([None] * len(gates)), None)


def gate_args(gates: Sequence[Tensor] | Tensor, tau: float,
              alive: Sequence[Tensor] | Tensor) -> tuple:
    """The trailing Function arguments for gates: ``(*gates, *alive, tau)``, alive
    defaulting to all True; nothing without gates. ``gates`` may also be all bonds'
    gates as one vector (a train's ``gate``, ``alive`` its flags as one bool vector or
    empty): then ``(gate, alive, tau)``, and the Function's gradient for it is one
    vector too (no split views, no concatenation after)."""
    if isinstance(gates, Tensor):
        if not isinstance(alive, Tensor):
            if alive:
                raise ValueError("alive: one bool vector with the flat gate vector")
            alive = torch.ones(gates.shape, dtype=torch.bool, device=gates.device)
        if alive.shape != gates.shape:
            raise ValueError(f"alive: shape {tuple(alive.shape)}, the gates' "
                             f"{tuple(gates.shape)}")
        return (gates, alive, float(tau))
    if not gates:
        return ()
    if not alive:
        alive = [torch.ones(g.shape, dtype=torch.bool, device=g.device) for g in gates]
    elif len(alive) != len(gates):
        raise ValueError(f"alive: expected {len(gates)} vectors (one per gate), got {len(alive)}")
    return (*gates, *alive, float(tau))
