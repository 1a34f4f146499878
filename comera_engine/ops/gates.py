"""Rank gates inside the TT-linear ops, and tensors saved for backward by name.

Shared by :mod:`.tt_linear_halves` and :mod:`.tt_linear_sweep`: the gate masks
``alive_k & (|g_k| > tau)`` (:func:`gate_masks`), gates absorbed into the cores' bonds
(:func:`apply_gates`, the reference; :class:`GatedFunction`, inside a Function with no
autograd node per gate), and :func:`save` / :func:`saved`, which keep a Function's
tensors for backward under names instead of slice positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
from torch import Tensor

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
        Returns the gated cores and keeps what :meth:`_gate_grads` needs on ``ctx`` (the
        raw cores are saved last). The masks ``alive_k & (|g_k| > tau)`` are computed
        here, in one pass over all bonds: no mask tensors are built outside the step."""
        raw, gates, alive, tau = GatedFunction._split(ctx, tensors, d)
        if not ctx.gated:
            return raw
        flat_g = tensors[2 * d] if ctx.flat else torch.cat(gates)
        # g where |g| > tau, else 0 (hardshrink: one op), then the dead entries zeroed
        gm = torch.nn.functional.hardshrink(flat_g, tau)
        if alive:
            gm = torch.where(tensors[2 * d + 1] if ctx.flat else torch.cat(alive), gm, 0.0)
        ctx.m = gm != 0  # the mask: alive and |g| > tau (> 0, so never a kept zero)
        ctx.sizes = [int(v.shape[0]) for v in gates]
        # per gate, its vector shaped to broadcast over its core: (r,) on the right bond,
        # (r, 1, 1) on the left
        ctx.gv = [v if right else v.view(-1, 1, 1)
                  for v, (_, right) in zip(gm.split(ctx.sizes), _gate_plan(d))]
        eff = list(raw)
        for v, (j, _) in zip(ctx.gv, _gate_plan(d)):
            eff[j] = raw[j] * v
        return eff

    @staticmethod
    def _gate_grads(ctx, d_eff: list[Tensor | None], need: Sequence[bool],  # noqa: ANN001
                    raw: Sequence[Tensor]) -> list[Tensor | None]:
        """From gradients of the gated cores to the raw cores ``raw`` and the gates. For a
        gate on the right bond, ``E = G · diag(gm)``: ``dG = dE · diag(gm)`` and
        ``dg = m ⊙ Σ_{all but last} dE ⊙ G``; on the left bond the same over all but the
        first axis. Returns grads for (cores, gates, alive, tau) in the order they were
        passed."""
        K = len(d_eff)
        n_g = K - 1
        d_cores: list[Tensor | None] = [dE if need[k] else None for k, dE in enumerate(d_eff)]
        want_g = any(need[K : K + n_g])
        sums: list[Tensor] = []
        for v, (j, right) in zip(ctx.gv, _gate_plan(K // 2)):
            dE = d_eff[j]
            if dE is None:  # no gradient reached this core: zero for its gate
                sums.append(v.new_zeros(v.shape[0]))
                continue
            if need[j]:
                d_cores[j] = dE * v
            if want_g:
                sums.append((dE * raw[j]).sum((0, 1) if right else (1, 2)))
        if ctx.flat:  # one gradient for the one gate vector: no split, no cat after
            d_gate = torch.where(ctx.m, torch.cat(sums), 0.0) if need[K] else None
            return [*d_cores, d_gate, None, None]
        d_gates: list[Tensor | None] = [None] * n_g
        if want_g:
            flat = torch.where(ctx.m, torch.cat(sums), 0.0).split(ctx.sizes)
            d_gates = [g if need[K + k] else None for k, g in enumerate(flat)]
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
                grads: list[Tensor | None], raw: Sequence[Tensor] | None
                ) -> tuple[Tensor | None, ...]:
        """The Function's return value from the gradients of the (gated) cores; ``raw``:
        the raw cores (when gated)."""
        need_cores = ctx.needs_input_grad[3:]
        if ctx.gated:
            return (dx, None, dbias, *cls._gate_grads(ctx, grads, need_cores, raw))
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
