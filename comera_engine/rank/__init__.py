"""Rank-adaptive multi-objective training (comera-method.md §2): the rank controller
:class:`CoMERA` (the method for any model and loop), ``tensorize`` with initial ranks from
a target, and the pieces it is made of (objective, pace, sizes, target plans, the
schedules' meaning in the torch-free ``schedule.py``).

Each public name loads its module (and torch with it) on first use, so that
``import comera_engine.rank.schedule`` stays torch-free (``comera_engine._lazy``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._lazy import lazy_getattr

__all__ = [
    "CoMERA", "CoMERAObjective", "EVENT_KINDS", "Event", "PacePlan", "PlateauDetector",
    "RankEvent", "RankTracker", "TargetPlan", "dense_size", "effective_core_size",
    "effective_size", "entry_scores", "gate_sizes",
    "gamma_ramp", "grow_to", "host_size", "min_size", "model_sizes", "param_groups",
    "plan_fixed_ranks", "plan_ranks", "plan_target", "prune_to", "refresh_gates",
    "refresh_gates_on_device", "size_spec", "surrogate_size", "tensorize",
    "truncate_model_and_optimizer",
]

#: Each public name and the module it lives in.
_LAZY = {
    **dict.fromkeys(("EVENT_KINDS", "CoMERA", "Event"), "controller"),
    **dict.fromkeys(("CoMERAObjective", "PlateauDetector", "gamma_ramp"), "objective"),
    **dict.fromkeys(("RankEvent", "RankTracker", "param_groups", "refresh_gates",
                     "refresh_gates_on_device", "truncate_model_and_optimizer"), "optim"),
    **dict.fromkeys(("PacePlan", "entry_scores", "grow_to", "host_size", "prune_to"), "pace"),
    **dict.fromkeys(("dense_size", "effective_core_size", "effective_size", "gate_sizes",
                     "min_size", "model_sizes", "size_spec", "surrogate_size"), "size"),
    **dict.fromkeys(("TargetPlan", "plan_fixed_ranks", "plan_target"), "target"),
    **dict.fromkeys(("plan_ranks", "tensorize"), "tensorize"),
}

if TYPE_CHECKING:  # pragma: no cover
    from .controller import EVENT_KINDS, CoMERA, Event
    from .objective import CoMERAObjective, PlateauDetector, gamma_ramp
    from .optim import (
        RankEvent,
        RankTracker,
        param_groups,
        refresh_gates,
        refresh_gates_on_device,
        truncate_model_and_optimizer,
    )
    from .pace import PacePlan, entry_scores, grow_to, host_size, prune_to
    from .size import (
        dense_size,
        effective_core_size,
        effective_size,
        gate_sizes,
        min_size,
        model_sizes,
        size_spec,
        surrogate_size,
    )
    from .target import TargetPlan, plan_fixed_ranks, plan_target
    from .tensorize import plan_ranks, tensorize

_load = lazy_getattr(__name__, _LAZY)


def __getattr__(name: str) -> Any:
    value = _load(name)
    if _LAZY[name] == "tensorize":  # importing tensorize.py bound that module to the name
        _load("tensorize")  # of the function it holds: the function again
    return value
