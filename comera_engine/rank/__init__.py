"""Rank-adaptive multi-objective training (comera-method.md §2)."""

from .objective import CoMERAObjective, PlateauDetector, RankConfig
from .optim import (
    RankEvent,
    RankTracker,
    param_groups,
    refresh_gates,
    truncate_model_and_optimizer,
)
from .size import dense_size, min_size, model_sizes, surrogate_size

__all__ = [
    "CoMERAObjective", "PlateauDetector", "RankConfig", "RankEvent", "RankTracker",
    "dense_size", "min_size", "model_sizes", "param_groups", "refresh_gates",
    "surrogate_size", "truncate_model_and_optimizer",
]
