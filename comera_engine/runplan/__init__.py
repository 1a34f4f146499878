"""A run planned once: the config resolved into a :class:`RunPlan` before any weight is
made and before any data is read.

:func:`plan_run` builds the config's model on the meta device from the dataset's shape
facts (:func:`~comera_engine.runplan.data.data_shape`, or a built ``DataBundle``) and asks
:func:`comera_engine.rank.plan_target` (or, for the fixed-rank methods,
:func:`comera_engine.rank.plan_fixed_ranks`) whether the target is reachable and from
which ranks the run starts. The plan holds the config with those initial ranks, the
:class:`~comera_engine.rank.TargetPlan` and the data spec it was made from; ``comera
train`` writes it into the run folder (``plan.json``) and hands it to the trainer, and
the preview (the New experiment page, ``comera launch``'s checks) reads the same plan.

Layer: below ``train/``, ``launch/`` and ``export/``, above ``rank/``, ``models/`` and
``data/`` (``docs/ARCHITECTURE.md``). Torch loads only when a plan is made.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comera_engine.config import Config
from comera_engine.rank.schedule import resolve_schedule
from comera_engine.runplan.data import (
    data_config,
    data_namespace,
    data_shape,
    data_spec,
    data_spec_from_bundle,
    same_facts,
)

__all__ = ["PLAN_FILENAME", "RunPlan", "data_config", "data_namespace", "data_shape",
           "data_spec", "data_spec_from_bundle", "plan_initial_ranks", "plan_run",
           "read_plan", "write_plan"]

#: the plan in a run folder, beside ``config.toml``
PLAN_FILENAME = "plan.json"


@dataclass(frozen=True)
class RunPlan:
    """A run's plan. ``config``: the config with the initial ranks chosen from the target
    (``model.rank`` / ``model.embedding_rank``; the config itself when none were chosen);
    ``target``: the :class:`~comera_engine.rank.TargetPlan` (``None``: no target to plan
    for); ``data``: the data spec it was planned from (:func:`data_spec`); ``source``:
    those shape facts as given (a :func:`data_shape` or a ``DataBundle``; not written)."""

    config: Config
    target: Any
    data: dict[str, Any]
    source: Any = field(default=None, repr=False, compare=False)

    @property
    def shape(self) -> Any:
        """What ``build_model`` reads about the data (the facts the plan was made from)."""
        return self.source if self.source is not None else data_namespace(self.data)

    @property
    def note(self) -> str:
        """What the plan decided, one line ("" when nothing)."""
        return self.target.note if self.target is not None else ""

    def fits(self, bundle: Any) -> bool:
        """Whether a built dataset has the facts this plan was made from (else the run is
        planned from the dataset itself)."""
        return same_facts(self.data, data_spec_from_bundle(bundle))

    def to_dict(self) -> dict[str, Any]:
        """The plan as ``plan.json`` holds it."""
        m = self.config.model
        target = None
        if self.target is not None:
            target = dataclasses.asdict(self.target)
            if target.get("bond_ranks") is not None:
                target["bond_ranks"] = [list(b) for b in target["bond_ranks"]]
        return {"initial_ranks": {"rank": m.rank, "embedding_rank": m.embedding_rank},
                "target": target, "data_spec": self.data}


def plan_run(cfg: Config, data: Any = None) -> RunPlan:
    """Plan the run ``cfg`` describes from ``data``'s shape facts: a ``DataBundle``, a
    :func:`data_shape` namespace, or ``None`` (the dataset registry's facts, read from
    ``cfg.data``; nothing is downloaded or built).

    Raises:
        ConfigError: the target is below the floor, or a fixed ``model.rank`` already
            compresses more than asked (:func:`plan_initial_ranks`).
        ValueError: ``data`` is ``None`` and the dataset has no shape facts.
    """
    if data is None:
        data = data_shape(cfg.data, cfg.task)
    planned, target = plan_initial_ranks(cfg, data)
    return RunPlan(planned, target, data_spec(data), data)


def write_plan(run_dir: str | os.PathLike[str], plan: RunPlan) -> Path:
    """Write ``plan.json`` into ``run_dir`` (atomically); returns its path."""
    from comera_engine.store.layout import write_atomic

    path = Path(run_dir) / PLAN_FILENAME
    write_atomic(path, json.dumps(plan.to_dict(), indent=1, default=str))
    return path


def read_plan(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``plan.json`` of a run folder as a dict (``None``: none, or unreadable)."""
    try:
        raw = json.loads((Path(run_dir) / PLAN_FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def plan_initial_ranks(cfg: Config, data: Any) -> tuple[Config, Any]:
    """The run's target plan before the first step (:func:`comera_engine.rank.plan_target`
    on a meta-device model built from ``cfg.model`` and ``data``'s shape facts: a
    ``DataBundle`` or a :func:`data_shape`; nothing is allocated or read).

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
    import torch

    from comera_engine.layers import factorized_layers
    from comera_engine.models import build_model
    from comera_engine.rank.size import size_spec
    from comera_engine.rank.target import plan_fixed_ranks, plan_target

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
        plan = plan_fixed_ranks(size_spec(model), c.target_scope, c.target_compression)
        return _with_ranks(cfg, plan), plan
    plan = plan_target(size_spec(model), c.target_scope, c.target_compression,
                       rank_fixed=cfg.model.rank is not None or not chosen,
                       embedding_rank_fixed=cfg.model.embedding_rank is not None
                       or not chosen, headroom=c.headroom,
                       kept_by=None if chosen or cfg.model.rank is not None
                       else f"comera.schedule = {c.schedule!r}")
    return _with_ranks(cfg, plan), plan


def _with_ranks(cfg: Config, plan: Any) -> Config:
    """``cfg`` with the plan's initial ranks (``cfg`` itself when it chose none)."""
    changes = {k: v for k, v in (("rank", plan.rank), ("embedding_rank", plan.embedding_rank))
               if v is not None}
    if not changes:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **changes))
