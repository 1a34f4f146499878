"""Is the requested compression reachable, and from which ranks? Decided before the
first step, from shapes alone (docs/SIZE_AND_TARGET.md).

:func:`plan_target` is the one function the run plan (``comera_engine.runplan``), the
command line (before any data is read) and the New experiment preview
(``comera_engine.preview``) call. It takes the TT layers' shapes (:class:`SizeSpec`,
read off a meta-device model by :func:`comera_engine.rank.size.size_spec`) and returns
a :class:`TargetPlan`: dense size, start size, floor and target size in the chosen scope,
all counted one way (``tensorized`` = TT cores + TT biases; ``model`` adds every other
parameter; see :mod:`comera_engine.rank.size`).

Rules, with ``T = dense / target_compression`` the target size, ``S₀`` the size at the
initial ranks and ``F`` the floor (rank 1 on every bond):

- ``T < F``: refused (``comera.target_compression``): no ranks reach it.
- ``model.rank`` fixed: kept when ``S₀ > T``; refused (``model.rank``) when the initial
  ranks already compress more than asked (``S₀ <= T``: the late stage could only stop
  or overshoot).
- otherwise the initial ranks are chosen from the target: the smallest linear rank
  ``r`` (the embedding rank in proportion, ``ceil(r_emb · r / r_preset)``, unless
  ``model.embedding_rank`` is fixed; every bond capped by its full TT rank) with
  ``S₀ >= headroom · T`` (``comera.headroom``, default ``HEADROOM = 3``: room for the
  early stage to find which ranks matter, not so much that pruning it away costs more
  than it gains). This raises the preset's ranks or lowers them. If even the full-rank
  TT stays at or below ``T``, the full ranks are used (the late stage then has nothing
  to prune; the plan's note says so).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..errors import ConfigError
from ..tensor.size import tt_size

__all__ = ["HEADROOM", "LayerSpec", "SizeSpec", "TargetPlan", "bond_caps", "plan_fixed_ranks",
           "plan_target"]

HEADROOM = 3.0


@dataclass(frozen=True)
class LayerSpec:
    """One TT layer: ``kind`` (``"linear"``/``"embedding"``), core mode sizes, allocated
    internal ranks (length ``K-1``), bias parameters and its dense size (bias included)."""

    kind: str
    mode_sizes: tuple[int, ...]
    ranks: tuple[int, ...]
    bias: int
    dense: int


@dataclass(frozen=True)
class SizeSpec:
    """The TT layers of a model and its parameters outside them (``other``)."""

    layers: tuple[LayerSpec, ...]
    other: int


@dataclass(frozen=True)
class TargetPlan:
    """Sizes in ``scope`` (parameters): ``dense``, ``start`` (at the ranks the run starts
    from), ``floor`` (rank 1 everywhere), ``target`` (``dense / compression``; ``None``
    without a target). ``rank``/``embedding_rank``: the initial ranks chosen from the
    target (``None``: keep the config's). ``note``: what was decided, one line."""

    scope: str
    dense: int
    start: int
    floor: int
    target: float | None
    compression: float | None
    rank: int | None = None
    embedding_rank: int | None = None
    note: str = ""
    #: fixed-rank methods (:func:`plan_fixed_ranks`): the internal ranks of every TT layer,
    #: in the order of ``SizeSpec.layers`` (``None``: the ranks are learnt, or the config's)
    bond_ranks: tuple[tuple[int, ...], ...] | None = None
    #: learnt ranks with a target: an illustration of the ranks at the target (the start
    #: ranks of every bond scaled by one factor, whole ranks, at least 1, the largest
    #: factor whose size fits the target), per TT layer in ``SizeSpec.layers`` order; the
    #: run's own ranks are whatever the objective and the pace keep
    target_ranks: tuple[tuple[int, ...], ...] | None = None

    def ratio(self, size: float | None) -> float | None:
        """``dense / size`` (``None`` for no size)."""
        return None if size is None else (self.dense / size if size > 0 else math.inf)


def _full_ranks(mode_sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Full TT ranks ``min(∏_{j<=k} s_j, ∏_{j>k} s_j)`` per internal bond."""
    return tuple(min(math.prod(mode_sizes[:k]), math.prod(mode_sizes[k:]))
                 for k in range(1, len(mode_sizes)))


def _dense_size(spec: SizeSpec, scope: str) -> int:
    """The dense size the ratio is measured against: the TT-able layers' dense
    parameters, plus everything else when ``scope`` is ``"model"``."""
    return sum(layer.dense for layer in spec.layers) + (spec.other if scope == "model" else 0)


def _params(n: float) -> str:
    """A parameter count as the refusal states it: ``1234 params``, or ``0.03 params``
    below one (a ratio beyond the dense size itself, read "0 params" when rounded)."""
    return f"{n:.0f} params" if n >= 1 else f"{n:.2g} params"


def _reachable(dense: int, floor: int, compression: float, scope: str) -> float:
    """The target size ``dense / compression``; a ConfigError naming
    ``comera.target_compression`` when it is below ``floor`` (rank 1 everywhere)."""
    target = dense / compression
    if target < floor:
        raise ConfigError(
            "comera.target_compression",
            f"{compression:g}x is beyond the smallest TT model: it needs a {scope} size of "
            f"{_params(target)}, below the {floor} that rank 1 everywhere allows; choose "
            f"at most {math.floor(dense / floor * 10) / 10:g}x")
    return target


def _size(spec: SizeSpec, scope: str, ranks_of: dict[str, int] | None,
          floor: bool = False) -> int:
    """Size in ``scope``: every layer at its allocated ranks (``ranks_of`` None), at
    ``min(ranks_of[kind], full rank)`` per bond, or at rank 1 (``floor``)."""
    total = 0
    for layer in spec.layers:
        if floor:
            ranks = tuple(1 for _ in layer.ranks)
        elif ranks_of is None:
            ranks = layer.ranks
        else:
            ranks = tuple(min(ranks_of[layer.kind], c) for c in _full_ranks(layer.mode_sizes))
        total += tt_size(layer.mode_sizes, ranks) + layer.bias
    return total + (spec.other if scope == "model" else 0)


def _start_ranks(spec: SizeSpec, ranks_of: dict[str, int] | None
                 ) -> tuple[tuple[int, ...], ...]:
    """Each layer's internal ranks at the start: its allocated ones, or
    ``min(ranks_of[kind], full rank)`` per bond."""
    if ranks_of is None:
        return tuple(tuple(layer.ranks) for layer in spec.layers)
    return tuple(tuple(min(ranks_of[layer.kind], c) for c in _full_ranks(layer.mode_sizes))
                 for layer in spec.layers)


def _scaled_to(spec: SizeSpec, start: tuple[tuple[int, ...], ...], budget: float
               ) -> tuple[tuple[int, ...], ...]:
    """``start`` with every bond scaled by the largest one factor (rounded, at least 1)
    whose TT layers' size (their biases included) is at most ``budget``."""
    def scaled(f: float) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(max(1, round(r * f)) for r in rs) for rs in start)

    def size(ranks: tuple[tuple[int, ...], ...]) -> int:
        return sum(tt_size(layer.mode_sizes, rs) + layer.bias
                   for layer, rs in zip(spec.layers, ranks))

    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if size(scaled(mid)) <= budget else (lo, mid)
    return scaled(lo)


def _with_target_ranks(plan: TargetPlan, spec: SizeSpec, ranks_of: dict[str, int] | None
                       ) -> TargetPlan:
    """``plan`` with its :attr:`TargetPlan.target_ranks` filled in."""
    assert plan.target is not None
    budget = plan.target - (spec.other if plan.scope == "model" else 0)
    return dataclasses.replace(plan, target_ranks=_scaled_to(spec, _start_ranks(spec, ranks_of),
                                                             budget))


def plan_target(spec: SizeSpec, scope: str, compression: float | None, *,
                rank_fixed: bool = False, embedding_rank_fixed: bool = False,
                headroom: float = HEADROOM, kept_by: str | None = None) -> TargetPlan:
    """Feasibility of ``compression`` (dense / target size, over ``scope``) for the model
    ``spec`` describes, and the initial ranks to start from (rules in the module doc;
    ``headroom``: the start size over the target size, ``comera.headroom``). ``kept_by``:
    what keeps the ranks when ``model.rank`` is not set (a schedule that does not choose
    them from the target), named in the refusal with its fix.

    Raises:
        ConfigError: the target is below the floor (``comera.target_compression``), or
            the fixed ``model.rank`` already compresses more than asked (``model.rank``).
    """
    dense = _dense_size(spec, scope)
    start = _size(spec, scope, None)
    floor = _size(spec, scope, None, floor=True)
    if compression is None or not spec.layers:
        return TargetPlan(scope, dense, start, floor, None, None)
    target = _reachable(dense, floor, compression, scope)
    plan = TargetPlan(scope, dense, start, floor, target, compression)
    if rank_fixed:
        if start > target:
            return _with_target_ranks(plan, spec, None)
        if kept_by is not None:
            raise ConfigError("model.rank", f"the preset's ranks already give "
                              f"{dense / start:.1f}x ({scope}), more than the "
                              f"{compression:g}x target asks with {kept_by}, which keeps "
                              "them (comera.ranks_from_target off); set a larger model.rank, "
                              "or comera.ranks_from_target = true")
        raise ConfigError(
            "model.rank",
            f"the fixed ranks already give {dense / start:.1f}x ({scope}), more than the "
            f"{compression:g}x target asks, so nothing is left to learn; remove model.rank "
            f"(ranks are then chosen from the target) or set comera.target_compression "
            f"above {dense / start:.1f}")
    base = {kind: max([max(layer.ranks, default=1) for layer in spec.layers
                       if layer.kind == kind], default=1) for kind in ("linear", "embedding")}
    caps = {kind: max([max(_full_ranks(layer.mode_sizes), default=1) for layer in spec.layers
                       if layer.kind == kind], default=1) for kind in ("linear", "embedding")}
    lead = "linear" if any(layer.kind == "linear" for layer in spec.layers) else "embedding"
    other = "embedding" if lead == "linear" else "linear"
    ranks = dict(base)
    for r in range(1, caps[lead] + 1):
        ranks[lead] = r
        if not (other == "embedding" and embedding_rank_fixed):
            grown = math.ceil(base[other] * r / base[lead])
            ranks[other] = min(caps[other], max(1, grown))
        size = _size(spec, scope, ranks)
        if size >= headroom * target:
            break
    if ranks == base:
        return _with_target_ranks(plan, spec, None)
    start = _size(spec, scope, ranks)
    has = {layer.kind for layer in spec.layers}
    new_rank = ranks["linear"] if "linear" in has else None
    new_emb = ranks["embedding"] if "embedding" in has and not embedding_rank_fixed else None
    what = f"rank {base[lead]} -> {ranks[lead]}" + (
        f", embedding rank {base['embedding']} -> {new_emb}"
        if new_emb is not None and lead == "linear" else "")
    note = (f"initial ranks chosen from the {compression:g}x target: {what} "
            f"(start {dense / start:.1f}x, {start / target:.1f}x the target size)")
    if start <= target:
        note += "; even full ranks do not exceed the target size, nothing to prune"
    return _with_target_ranks(TargetPlan(scope, dense, start, floor, target, compression,
                                         rank=new_rank, embedding_rank=new_emb, note=note),
                              spec, ranks)


# --------------------------------------------------------------------------- fixed ranks


def bond_caps(mode_sizes: tuple[int, ...], ranks: tuple[int, ...]) -> tuple[int, ...]:
    """The largest useful rank of each internal bond given its neighbours' ranks:
    ``min(full TT rank, r_{k-1}·s_k, s_{k+1}·r_{k+1})`` (a bigger rank adds parameters
    but no expressiveness; a TT-SVD could not produce it)."""
    r = (1, *ranks, 1)
    full = _full_ranks(mode_sizes)
    return tuple(min(full[k], r[k] * mode_sizes[k], mode_sizes[k + 1] * r[k + 2])
                 for k in range(len(ranks)))


def plan_fixed_ranks(spec: SizeSpec, scope: str, compression: float) -> TargetPlan:
    """The ranks a fixed-rank TT model (no gates, no pruning) needs to be ``compression``
    times smaller than dense in ``scope``: the size is at most the target size
    ``T = dense / compression`` and as close to it as one more rank on any bond allows.

    1. One rank ``r`` for every bond of every TT layer (linear and embedding alike, each
       bond capped by its full TT rank): the largest ``r`` whose size is at most ``T``.
    2. Then, in model order (layers, bonds left to right), one more rank on each bond
       whose increase still fits in ``T`` (and stays useful: :func:`bond_caps`), in passes
       until no bond can grow. The size then ends within one bond's increment below ``T``
       (well inside the 10 % the sweep allows for all but the tiniest layers).

    Returns a :class:`TargetPlan` whose ``bond_ranks`` hold the internal ranks per layer
    (in ``spec.layers`` order), ``rank`` / ``embedding_rank`` the largest of the linear /
    embedding layers (what to allocate before slicing to ``bond_ranks``) and ``start``
    the planned size.

    Raises:
        ConfigError: ``T`` is below the size at rank 1 everywhere
            (``comera.target_compression``).
    """
    dense = _dense_size(spec, scope)
    floor = _size(spec, scope, None, floor=True)
    if not spec.layers:
        return TargetPlan(scope, dense, dense, floor, None, None)
    target = _reachable(dense, floor, compression, scope)
    fixed = sum(layer.bias for layer in spec.layers) + (spec.other if scope == "model" else 0)
    full = [_full_ranks(layer.mode_sizes) for layer in spec.layers]

    def uniform(r: int) -> list[list[int]]:
        return [[min(r, c) for c in caps] for caps in full]

    def total(ranks: list[list[int]]) -> int:
        return fixed + sum(tt_size(layer.mode_sizes, tuple(rk))
                           for layer, rk in zip(spec.layers, ranks))

    top = max((c for caps in full for c in caps), default=1)
    r = 1
    while r < top and total(uniform(r + 1)) <= target:
        r += 1
    ranks = uniform(r)
    size = total(ranks)
    grown = 0
    changed = True
    while changed:
        changed = False
        for layer, rk in zip(spec.layers, ranks):
            for k in range(len(rk)):
                if rk[k] >= bond_caps(layer.mode_sizes, tuple(rk))[k]:
                    continue
                before = tt_size(layer.mode_sizes, tuple(rk))
                rk[k] += 1
                step = tt_size(layer.mode_sizes, tuple(rk)) - before
                if size + step <= target:
                    size += step
                    grown += 1
                    changed = True
                else:
                    rk[k] -= 1
    has = {layer.kind for layer in spec.layers}

    def top_of(kind: str) -> int | None:
        return max((max(rk, default=1) for layer, rk in zip(spec.layers, ranks)
                    if layer.kind == kind), default=1) if kind in has else None

    note = (f"fixed ranks for the {compression:g}x target: rank {r} on every bond"
            + (f", one more on {grown} bonds" if grown else "")
            + f": size {size} params ({scope}), {dense / size:.2f}x")
    return TargetPlan(scope, dense, size, floor, target, compression,
                      rank=top_of("linear"), embedding_rank=top_of("embedding"), note=note,
                      bond_ranks=tuple(tuple(rk) for rk in ranks))
