"""``comera_engine.tensorize(model, config)``: TT layers for any model, their initial ranks
chosen from the config's target compression the way ``comera train`` chooses them.

:func:`comera_engine.layers.tensorize_layers` replaces the layers at the ranks it is
given; this adds the planning: with a target (``config.target_compression``) the layers
are first built on the meta device (no memory), :func:`comera_engine.rank.plan_target`
picks the smallest rank whose model is ``headroom`` times the target size
(``config.headroom``, docs/SIZE_AND_TARGET.md), and the real layers are made at that
rank. An unreachable target is refused before any layer is replaced::

    config = ce.CoMERAConfig(target_compression=20)
    model = ce.tensorize(MyNet(), config, exclude=["head"])
    comera = ce.CoMERA(model, config, total_steps=1500)
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from glob import escape
from numbers import Integral
from typing import Any

from torch import nn

from ..config import CoMERAConfig, validate_comera
from ..errors import ConfigError
from ..layers import candidate_layers, factorized_layers, freeze_gates, tensorize_layers
from ..layers.tensorize import dense_only_layers, matches
from ..layers.tree import module_aliases
from .size import size_spec
from .target import SizeSpec, TargetPlan, plan_fixed_ranks, plan_target

__all__ = ["BASE_RANK", "plan_ranks", "tensorize"]

#: The rank of every layer without a target (and the rank a plan starts from).
BASE_RANK = 8


def _config(config: object) -> CoMERAConfig:
    """``config`` checked: a validated :class:`CoMERAConfig` (the defaults for None)."""
    if config is None:
        return CoMERAConfig()
    if not isinstance(config, CoMERAConfig):
        raise ConfigError("config", f"give a comera_engine.CoMERAConfig (e.g. "
                                    f"CoMERAConfig(target_compression=20)), got {config!r}; "
                                    "a fixed rank is rank=...")
    validate_comera(config)
    return config


def _patterns(model: nn.Module, field: str, patterns: Iterable[str] | str | None
              ) -> list[str] | None:
    """``patterns`` as a list, each checked to match the name of at least one of the
    model's ``nn.Linear`` / ``nn.Embedding`` layers, attention projections (``.in_proj``)
    or TT layers: a typo would otherwise
    leave a layer dense, or make one TT, without a word."""
    if patterns is None:
        return None
    out = [patterns] if isinstance(patterns, str) else list(patterns)
    names = [n for n, _ in candidate_layers(model)] + [n for n, m in model.named_modules()
                                                       if hasattr(m, "tt")]
    for p in out:
        if not isinstance(p, str):
            raise ConfigError(field, f"glob patterns of module names (strings), got {p!r}")
        if not any(matches(n, [p]) for n in names):
            shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise ConfigError(field, f"{p!r} matches none of the model's Linear / Embedding "
                                     f"layers ({shown or 'it has none'}); give glob patterns "
                                     "over these full names (e.g. 'head', 'blocks.*.mlp*')")
    return out


def _refuse_tied(model: nn.Module, rows: list[dict], exclude: Iterable[str] | None) -> None:
    """Refuse to make a layer TT whose weight another module shares, but for a language
    model's head tied to its embedding table (the head then decodes through the TT
    table, :mod:`comera_engine.layers.tied`): a TT layer holds weights of its own, so
    any other tie would be cut without a word and the shared matrix counted twice. A
    tied head excluded while its table is made TT is refused too (it cannot stay dense
    and tied). ``rows``: the candidates :func:`tensorize_layers` reports (a dry run)."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name.rpartition(".")[0])
    modules = dict(model.named_modules())
    aliases = module_aliases(model)  # one module at several places is no tie
    heads = {r["name"]: r["tied_to"] for r in rows if "tied_to" in r}
    for row in rows:
        if "module" not in row:
            continue
        layer = modules.get(row["name"])  # None: an attention's packed projection
        weight = getattr(layer, "weight", None)
        same = {row["name"], *aliases.get(row["name"], ())}
        others = [o for o in owners.get(id(weight), []) if o not in same]
        kept = [o for o in others if heads.get(o) == row["name"] and matches(o, exclude or [])]
        if kept:
            raise ConfigError("exclude", f"{kept[0]!r} is tied to {row['name']!r} (one "
                                         "weight): a head tied to a table made TT decodes "
                                         "through it and cannot stay dense; exclude both "
                                         f"to keep them dense (exclude={[row['name'], *kept]!r})"
                                         ", or neither")
        others = [o for o in others if heads.get(o) != row["name"]]
        if others:
            both = [row["name"], *others]
            raise ConfigError("exclude", f"{row['name']!r} shares its weight with "
                                         f"{', '.join(repr(o) for o in others)} (tied "
                                         "weights); a TT layer holds weights of its own and "
                                         "would untie them: keep them dense with exclude="
                                         f"{both!r}, or untie them in the model first")


def _fixed(config: CoMERAConfig) -> bool:
    """A fixed-rank method (``"fixed"``, ``"tt_svd"``): no gates, the ranks planned once."""
    return config.method != "comera"


def plan_ranks(model: nn.Module, config: CoMERAConfig, *, rank: int | str = "auto",
               embedding_rank: int | None = None, include: Iterable[str] | None = None,
               exclude: Iterable[str] | None = None, min_features: int = 8,
               d: int | None = None, layout: str = "tt") -> TargetPlan:
    """The target plan for tensorizing ``model`` with ``config`` (nothing is replaced or
    allocated): feasibility of ``config.target_compression`` in ``config.target_scope``
    and, for ``rank="auto"``, the initial ranks (``plan.rank`` / ``plan.embedding_rank``;
    ``None``: keep :data:`BASE_RANK`).

    Raises:
        ConfigError: no layer to tensorize, no target, the target is below what rank 1
            everywhere allows, or a fixed ``rank`` already compresses more than asked.
    """
    config = _config(config)
    if config.target_compression is None:
        raise ConfigError("config.target_compression", "a plan needs a target; set "
                                                       "CoMERAConfig(target_compression=...)")
    base = BASE_RANK if rank == "auto" else rank
    rows = tensorize_layers(model, rank=base, embedding_rank=embedding_rank or base,
                            include=include, exclude=exclude, min_features=min_features, d=d,
                            layout=layout, dry_run=True)
    planned = [r for r in rows if "module" in r]
    existing = [m for _, m in factorized_layers(model)]
    if not planned and not existing:
        raise ConfigError("include", "no nn.Linear or nn.Embedding of the model is left to "
                                     "tensorize; widen include / exclude or lower min_features")
    if existing and _fixed(config) and rank == "auto":
        raise ConfigError("config.method", f"{config.method!r} plans the ranks of every TT "
                                           "layer from the target: tensorize a model that has "
                                           "none yet (or give rank=...)")
    shadow = nn.Module()
    shadow.layers = nn.ModuleList([*existing, *(r["module"] for r in planned)])
    total = sum(p.numel() for p in model.parameters())
    inside = (sum(r["params_before"] for r in planned)
              + sum(p.numel() for m in existing for p in m.parameters()))
    spec = SizeSpec(size_spec(shadow).layers, total - inside)
    try:
        if _fixed(config) and rank == "auto":  # gate-free TT layers at the target's size
            return plan_fixed_ranks(spec, config.target_scope, config.target_compression)
        return plan_target(spec, config.target_scope, config.target_compression,
                           rank_fixed=rank != "auto",
                           embedding_rank_fixed=embedding_rank is not None,
                           headroom=config.headroom)
    except ConfigError as exc:  # in the names of this API
        field = {"model.rank": "rank"}.get(exc.field, exc.field.replace("comera.", "config."))
        raise ConfigError(field, exc.problem.replace("model.rank", "rank").replace(
            "comera.", "config.")) from None


def _say_untouched(model: nn.Module) -> None:
    """One line on stderr naming the convolutions, recurrent layers and bilinear layers
    of ``model``, which stay dense (TT layers replace linears and tables), with their
    share of its parameters: a CNN asked for 20x is 20x over its linears only."""
    counts: dict[str, list[int]] = {}
    for _, m in dense_only_layers(model):
        kind = counts.setdefault(type(m).__name__, [0, 0])
        kind[0] += 1
        kind[1] += sum(p.numel() for p in m.parameters())
    if not counts:
        return
    total = max(1, sum(p.numel() for p in model.parameters()))
    held = sum(n for _, n in counts.values())
    kinds = ", ".join(f"{k} ×{c}" for k, (c, _) in counts.items())
    print(f"CoMERA: {kinds} stay dense ({held:,} parameters, {held / total:.0%} of the "
          "model): TT layers replace nn.Linear, nn.Embedding and nn.EmbeddingBag; the "
          "target counts the TT layers (target_scope \"tensorized\") or the whole model "
          "(\"model\")", file=sys.stderr)


def _say_sparse(model: nn.Module, candidates: list[dict]) -> None:
    """One line on stderr naming the tables made TT whose ``sparse=True`` asked for sparse
    gradients: a TT table's gradients are its cores', dense (and small), which an
    optimizer for sparse gradients (``torch.optim.SparseAdam``) refuses."""
    modules = dict(model.named_modules())
    names = [r["name"] for r in candidates if "module" in r
             and getattr(modules.get(r["name"]), "sparse", False) is True]
    if names:
        print(f"CoMERA: {', '.join(map(repr, names))} had sparse=True; a TT table's "
              "gradients are its cores', dense and small: step them with a dense optimizer "
              "(e.g. AdamW), not SparseAdam", file=sys.stderr)


def _check_rank(name: str, value: Any) -> None:
    """``rank`` / ``embedding_rank``: ``None``, ``"auto"`` (checked where it is read), a
    positive integer, or a sequence of them; else a one-line ConfigError (the layers'
    own check, :func:`~comera_engine.tensor.tt._resolve_ranks`, sees each layer's bonds
    later, where a float failed as "not iterable")."""
    if value is None or isinstance(value, str):
        return
    items = list(value) if isinstance(value, Sequence) else [value]
    if not items or any(isinstance(v, bool) or not isinstance(v, Integral) or v < 1
                        for v in items):  # Integral: numpy's integers too, as the layers
        raise ConfigError(name, f'must be a positive integer (or a list of them, or "auto"), '
                                f"got {value!r}")


def tensorize(model: nn.Module, config: CoMERAConfig | None = None, *,
              rank: int | Sequence[int] | str | None = None,
              embedding_rank: int | Sequence[int] | None = None,
              include: Iterable[str] | None = None, exclude: Iterable[str] | None = None,
              from_pretrained: bool = False, min_features: int = 8, d: int | None = None,
              layout: str = "tt") -> nn.Module:
    """Replace ``model``'s ``nn.Linear`` / ``nn.Embedding`` modules by TT layers, in place,
    and return ``model``.

    Args:
        config: the run's :class:`~comera_engine.config.CoMERAConfig` (the ``[comera]``
            table; give the same one to :class:`~comera_engine.CoMERA`): its target
            (``target_compression`` in ``target_scope``) chooses the initial ranks, its
            ``headroom`` how far above the target they start, its ``tau`` the gate
            threshold. ``None``: the defaults (no target).
        rank: the TT rank of every layer; default ``"auto"`` with a target (the smallest
            rank whose model is ``headroom`` times the target size, as ``comera train``
            starts; embeddings at the same rank unless ``embedding_rank`` is given), else
            :data:`BASE_RANK`. With a fixed rank and a target, the target is checked:
            refused when those ranks already compress more. A fixed-rank method
            (``config.method`` ``"fixed"`` / ``"tt_svd"``) gets gate-free layers (gates
            at 1, frozen) and, with ``"auto"``, each layer its own ranks, the largest
            whose model is at most the target size
            (:func:`~comera_engine.rank.target.plan_fixed_ranks`, as ``comera train``).
        include, exclude: glob patterns of module names to make TT / keep dense.
        from_pretrained: initialise the cores by TT-SVD of the existing weights.
        min_features, d, layout: as :func:`comera_engine.layers.tensorize_layers`.

    The layers replaced are in :func:`comera_engine.size_report` (and
    ``comera_engine.layers.tt_layers``).

    Raises:
        ConfigError: ``rank="auto"`` without a target, a bad config or rank, or an
            unreachable target; nothing is replaced then.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError("model", f"give the torch.nn.Module to tensorize, got "
                                   f"{type(model).__name__}")
    if isinstance(model, (nn.Linear, nn.Embedding, nn.EmbeddingBag)):  # itself a layer
        kind = ("TTEmbeddingBag" if isinstance(model, nn.EmbeddingBag) else
                "TTEmbedding" if isinstance(model, nn.Embedding) else "TTLinear")
        raise ConfigError("model", f"a bare {type(model).__name__} cannot be replaced in "
                                   f"place: build ce.{kind}(...) directly, or tensorize the "
                                   "network that holds it")
    config = _config(config)
    for name, value in (("rank", rank), ("embedding_rank", embedding_rank)):
        _check_rank(name, value)
    include, exclude = _patterns(model, "include", include), _patterns(model, "exclude", exclude)
    candidates = tensorize_layers(model, include=include, exclude=exclude,
                                  min_features=min_features, d=d, layout=layout, dry_run=True)
    _refuse_tied(model, candidates, exclude)
    _say_untouched(model)
    _say_sparse(model, candidates)
    target = config.target_compression
    if rank is None:
        rank = "auto" if target is not None else BASE_RANK
    if isinstance(rank, str):
        if rank != "auto":
            raise ConfigError("rank", f'must be a positive integer or "auto", got {rank!r}')
        if target is None:
            raise ConfigError("rank", '"auto" chooses the ranks from a target: set '
                                      "CoMERAConfig(target_compression=...) or give an "
                                      "integer rank")
    if target is not None:
        if isinstance(rank, Sequence) and not isinstance(rank, str):
            raise ConfigError("rank", "a target is planned for one rank per layer kind; "
                                      "give an integer or \"auto\"")
        if embedding_rank is not None and not isinstance(embedding_rank, int):
            raise ConfigError("embedding_rank", "with a target, give one integer rank")
        plan = plan_ranks(model, config, rank=rank,  # type: ignore[arg-type]
                          embedding_rank=embedding_rank, include=include, exclude=exclude,
                          min_features=min_features, d=d, layout=layout)
        if plan.bond_ranks is not None:  # a fixed-rank method: each layer at its own ranks
            names = [r["name"] for r in candidates if "module" in r]  # the plan's order
            for name, ranks in zip(names, plan.bond_ranks):
                tensorize_layers(model, rank=list(ranks), embedding_rank=list(ranks),
                                 include=[escape(name)], from_pretrained=from_pretrained,
                                 min_features=min_features, d=d, tau=config.tau,
                                 layout=layout)
            freeze_gates(model)
            return model
        if rank == "auto":
            rank = plan.rank if plan.rank is not None else BASE_RANK
            if embedding_rank is None:
                embedding_rank = plan.embedding_rank if plan.embedding_rank is not None else rank
    tensorize_layers(model, rank=rank, embedding_rank=embedding_rank,  # type: ignore[arg-type]
                     include=include, exclude=exclude, from_pretrained=from_pretrained,
                     min_features=min_features, d=d, tau=config.tau, layout=layout)
    if _fixed(config):  # gate-free TT at the ranks given
        freeze_gates(model)
    return model
