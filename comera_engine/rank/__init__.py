"""Rank-adaptive multi-objective training (comera-method.md §2): the rank controller
:class:`CoMERA` (the method for any model and loop), ``tensorize`` with initial ranks from
a target, and the target plan. The pieces it is made of live in their modules
(:mod:`.objective`, :mod:`.pace`, :mod:`.optim`, :mod:`.size`, :mod:`.schedule`,
:mod:`.target`); sizes and their surrogate are :mod:`comera_engine.tensor.size`.

Names load on first use (torch with them), so ``comera_engine.rank.schedule`` and
``comera_engine.rank.target`` can be imported on their own."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_getattr

__all__ = ["EVENT_KINDS", "CoMERA", "Event", "TargetPlan", "plan_ranks", "plan_target",
           "size_spec", "tensorize"]

_LAZY = {"CoMERA": "controller", "Event": "controller", "EVENT_KINDS": "controller",
         "TargetPlan": "target", "plan_target": "target", "plan_ranks": "tensorize",
         "tensorize": "tensorize", "size_spec": "size"}

if TYPE_CHECKING:  # pragma: no cover
    from .controller import EVENT_KINDS, CoMERA, Event
    from .size import size_spec
    from .target import TargetPlan, plan_target
    from .tensorize import plan_ranks, tensorize

__getattr__ = lazy_getattr(__name__, _LAZY)
