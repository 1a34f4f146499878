"""The run's target plan, before the first step and before any weight is made.

:func:`plan_initial_ranks` builds the config's model on the meta device and asks
:func:`comera_engine.rank.plan_target` (or, for the fixed-rank methods,
:func:`comera_engine.rank.plan_fixed_ranks`) whether the target is reachable and from
which ranks the run starts. ``comera train``, the trainer and the New experiment preview
all call it, so they agree.
"""

from __future__ import annotations

from typing import Any

import torch

from comera_engine.config import Config, resolve_schedule
from comera_engine.layers import factorized_layers

__all__ = ["plan_initial_ranks"]


def plan_initial_ranks(cfg: Config, data: Any) -> tuple[Config, Any]:
    """The run's target plan before the first step (:func:`comera_engine.rank.plan_target`
    on a meta-device model built from ``cfg.model`` and ``data``'s shape facts: a
    ``DataBundle`` or the preview's ``data_shape``; nothing is allocated or read).

    Returns ``(cfg, plan)``: ``cfg`` with ``model.rank`` / ``model.embedding_rank`` set
    to the ranks chosen from the target when the plan chose them (else ``cfg`` itself),
    and the :class:`~comera_engine.rank.TargetPlan` (``None``: no target to plan for:
    dense baseline, ``comera.enabled = false``, or no target).

    With ``comera.ranks_from_target`` off (the ``"paper"`` schedule) the config's ranks
    are kept, and only checked against the target.

    The fixed-rank methods (``comera.method`` ``"fixed"`` / ``"tt_svd"``, docs/METHODS.md)
    with a target get :func:`comera_engine.rank.plan_fixed_ranks`: the per-bond ranks of
    the TT model of the target size (``plan.bond_ranks``, applied by
    :func:`comera_engine.train.methods.build_run_model`), ``model.rank`` /
    ``model.embedding_rank`` set to the largest of them (the ranks are the target's:
    the config's are not read, so planning a planned config gives the same plan).

    Raises:
        ConfigError: the target is below the floor, or a fixed ``model.rank`` already
            compresses more than asked.
    """
    import dataclasses

    from comera_engine import rank
    from comera_engine.models import build_model

    c = cfg.comera
    # comera.ranks_from_target (off in the paper's schedule: the preset's ranks are kept)
    chosen = bool(resolve_schedule(c).ranks_from_target)
    fixed = c.method != "comera"  # "fixed" / "tt_svd": the ranks that meet the target
    if cfg.model.dense or not (c.enabled or fixed) or c.target_compression is None:
        return cfg, None
    with torch.device("meta"):
        model = build_model(cfg.model, data)
    if not factorized_layers(model):
        return cfg, None
    if fixed:
        plan = rank.plan_fixed_ranks(rank.size_spec(model), c.target_scope,
                                     c.target_compression)
        changes = {k: v for k, v in (("rank", plan.rank),
                                     ("embedding_rank", plan.embedding_rank)) if v is not None}
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **changes)), plan
    plan = rank.plan_target(rank.size_spec(model), c.target_scope, c.target_compression,
                            rank_fixed=cfg.model.rank is not None or not chosen,
                            embedding_rank_fixed=cfg.model.embedding_rank is not None
                            or not chosen, headroom=c.headroom,
                            kept_by=None if chosen or cfg.model.rank is not None
                            else f"comera.schedule = {c.schedule!r}")
    if plan.rank is None and plan.embedding_rank is None:
        return cfg, plan
    changes = {k: v for k, v in (("rank", plan.rank), ("embedding_rank", plan.embedding_rank))
               if v is not None}
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **changes)), plan
