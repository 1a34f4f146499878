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
from .size import dense_size, effective_size, min_size, model_sizes, surrogate_size

__all__ = [
    "CoMERAObjective", "PlateauDetector", "RankEvent", "RankTracker", "dense_size",
    "effective_size", "gamma_ramp", "min_size", "model_sizes", "param_groups",
    "refresh_gates", "refresh_gates_on_device", "surrogate_size",
    "truncate_model_and_optimizer",
]
