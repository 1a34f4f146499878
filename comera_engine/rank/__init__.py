"""Rank-adaptive multi-objective training (comera-method.md §2)."""

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
from .size import dense_size, effective_size, min_size, model_sizes, size_spec, surrogate_size
from .target import TargetPlan, plan_fixed_ranks, plan_target

__all__ = [
    "CoMERAObjective", "PlateauDetector", "RankEvent", "RankTracker", "dense_size",
    "effective_size", "entry_scores", "gamma_ramp", "grow_to", "host_size", "min_size",
    "model_sizes", "PacePlan", "param_groups", "prune_to",
    "plan_fixed_ranks", "plan_target", "refresh_gates", "refresh_gates_on_device", "size_spec",
    "surrogate_size",
    "TargetPlan",
    "truncate_model_and_optimizer",
]
