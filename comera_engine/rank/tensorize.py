"""``comera_engine.tensorize``: TT layers for any model, their initial ranks chosen from a
target compression the way ``comera train`` chooses them.

:func:`comera_engine.layers.tensorize` replaces the layers at the ranks it is given;
this adds ``rank="auto"``: the layers are first built on the meta device (no memory),
:func:`comera_engine.rank.plan_target` picks the smallest rank whose model is
``headroom`` times the target size (``comera.headroom``, docs/SIZE_AND_TARGET.md), and
the real layers are made at that rank. An unreachable target is refused before any layer
is replaced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from torch import nn

from ..config import CoMERAConfig
from ..errors import ConfigError
from ..layers import factorized_layers
from ..layers import tensorize as _replace
from .size import size_spec
from .target import SizeSpec, TargetPlan, plan_target

__all__ = ["BASE_RANK", "tensorize"]

#: The rank a layer is planned from when ``rank="auto"`` (the layers' default rank).
BASE_RANK = 8

_DEFAULTS = CoMERAConfig()


def _api_error(exc: ConfigError) -> ConfigError:
    """A planning error in the names of this function's arguments, not the config's."""
    names = {"model.rank": "rank", "comera.target_compression": "target_compression",
             "comera.headroom": "headroom"}
    problem = exc.problem
    for old, new in names.items():
        problem = problem.replace(old, new)
    return ConfigError(names.get(exc.field, exc.field), problem)


def plan_ranks(model: nn.Module, target_compression: float, *, rank: int | str = "auto",
               embedding_rank: int | None = None, target_scope: str | None = None,
               headroom: float | None = None, include: Iterable[str] | None = None,
               exclude: Iterable[str] | None = None, min_features: int = 8,
               d: int | None = None, layout: str = "tt") -> TargetPlan:
    """The target plan for tensorizing ``model`` (nothing is replaced or allocated):
    feasibility of ``target_compression`` and, for ``rank="auto"``, the initial ranks
    (``plan.rank`` / ``plan.embedding_rank``; ``None``: keep :data:`BASE_RANK`).

    Raises:
        ConfigError: no layer to tensorize, the target is below what rank 1 everywhere
            allows, or a fixed ``rank`` already compresses more than asked.
    """
    base = BASE_RANK if rank == "auto" else rank
    rows = _replace(model, rank=base, embedding_rank=embedding_rank if embedding_rank else base,
                    include=include, exclude=exclude, min_features=min_features, d=d,
                    layout=layout, dry_run=True)
    planned = [r for r in rows if "module" in r]
    existing = [m for _, m in factorized_layers(model)]
    if not planned and not existing:
        raise ConfigError("include", "no nn.Linear or nn.Embedding of the model is left to "
                                     "tensorize; widen include / exclude or lower min_features")
    shadow = nn.Module()
    shadow.layers = nn.ModuleList([*existing, *(r["module"] for r in planned)])
    total = sum(p.numel() for p in model.parameters())
    inside = (sum(r["params_before"] for r in planned)
              + sum(p.numel() for m in existing for p in m.parameters()))
    spec = SizeSpec(size_spec(shadow).layers, total - inside)
    try:
        return plan_target(spec, target_scope or _DEFAULTS.target_scope, target_compression,
                           rank_fixed=rank != "auto",
                           embedding_rank_fixed=embedding_rank is not None,
                           headroom=_DEFAULTS.headroom if headroom is None else headroom)
    except ConfigError as exc:
        raise _api_error(exc) from None


def tensorize(model: nn.Module, rank: int | Sequence[int] | str = BASE_RANK,
              target_compression: float | None = None, *,
              embedding_rank: int | Sequence[int] | None = None,
              target_scope: str | None = None, headroom: float | None = None,
              include: Iterable[str] | None = None, exclude: Iterable[str] | None = None,
              from_pretrained: bool = False, min_features: int = 8, d: int | None = None,
              tau: float = 1e-2, layout: str = "tt") -> list[dict]:
    """Replace ``nn.Linear`` / ``nn.Embedding`` modules of ``model`` by TT layers, in place.

    Args:
        rank: the TT rank of every layer, or ``"auto"``: chosen from
            ``target_compression`` (the smallest rank whose model is ``headroom`` times
            the target size, as ``comera train`` starts; embeddings at the same rank
            unless ``embedding_rank`` is given).
        target_compression: dense size / size the run will be asked for, in
            ``target_scope`` (``"tensorized"``, the TT layers, or ``"model"``, every
            parameter; the ``[comera]`` defaults). With a fixed ``rank`` the target is
            checked: refused when those ranks already compress more.
        headroom: the start size over the target size (``comera.headroom``, default 3).
        include, exclude, from_pretrained, min_features, d, tau, layout: as
            :func:`comera_engine.layers.tensorize`.

    Returns one report row per candidate layer (:func:`comera_engine.layers.tensorize`).

    Raises:
        ConfigError: ``rank="auto"`` without a target, or an unreachable target; nothing
            is replaced then.
    """
    if isinstance(rank, str):
        if rank != "auto":
            raise ConfigError("rank", f'must be a positive integer or "auto", got {rank!r}')
        if target_compression is None:
            raise ConfigError("rank", '"auto" chooses the ranks from a target: give '
                                      "target_compression=... or an integer rank")
    if target_compression is not None:
        if isinstance(rank, Sequence) and not isinstance(rank, str):
            raise ConfigError("rank", "a target is planned for one rank per layer kind; "
                                      "give an integer or \"auto\"")
        if embedding_rank is not None and not isinstance(embedding_rank, int):
            raise ConfigError("embedding_rank", "with a target, give one integer rank")
        settings = {k: v for k, v in (("target_scope", target_scope), ("headroom", headroom))
                    if v is not None}
        try:  # the [comera] checks of the target, its scope and the headroom
            from ..config import validate_comera

            validate_comera(dataclasses.replace(_DEFAULTS, target_compression=float(
                target_compression), **settings))
        except (ConfigError, TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise _api_error(exc) from None
            raise ConfigError("target_compression", f"must be a number, got "
                                                    f"{target_compression!r}") from None
        plan = plan_ranks(model, float(target_compression), rank=rank,  # type: ignore[arg-type]
                          embedding_rank=embedding_rank, target_scope=target_scope,
                          headroom=headroom, include=include, exclude=exclude,
                          min_features=min_features, d=d, layout=layout)
        if rank == "auto":
            rank = plan.rank if plan.rank is not None else BASE_RANK
            if embedding_rank is None:
                embedding_rank = plan.embedding_rank if plan.embedding_rank is not None else rank
    return _replace(model, rank=rank, embedding_rank=embedding_rank,  # type: ignore[arg-type]
                    include=include, exclude=exclude, from_pretrained=from_pretrained,
                    min_features=min_features, d=d, tau=tau, layout=layout)
