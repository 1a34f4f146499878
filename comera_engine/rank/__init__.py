"""Rank-adaptive multi-objective training (comera-method.md §2): the rank controller
:class:`CoMERA` (the method for any model and loop), ``tensorize`` with initial ranks from
a target, and the pieces it is made of (objective, pace, sizes, target plans)."""

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

__all__ = [
    "CoMERA", "CoMERAObjective", "EVENT_KINDS", "Event", "PacePlan", "PlateauDetector",
    "RankEvent", "RankTracker", "TargetPlan", "dense_size", "effective_core_size",
    "effective_size", "entry_scores", "gate_sizes",
    "gamma_ramp", "grow_to", "host_size", "min_size", "model_sizes", "param_groups",
    "plan_fixed_ranks", "plan_ranks", "plan_target", "prune_to", "refresh_gates",
    "refresh_gates_on_device", "size_spec", "surrogate_size", "tensorize",
    "truncate_model_and_optimizer",
]
