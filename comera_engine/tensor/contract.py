"""The TT-linear contraction, as it was importable before the ops moved: the ops live in
:mod:`comera_engine.ops` (one module each), the planner in :mod:`.planner`."""

from ..ops.gates import apply_gates, gate_masks
from ..ops.merges import merge_left, merge_left_grads, merge_right, merge_right_grads
from ..ops.tt_linear_halves import TTLinearHalves, padded_width, tt_linear_halves
from ..ops.tt_linear_sweep import TTLinearSweep, sweep_merges, tt_linear_sweep
from .planner import (
    PATHS,
    DeviceModel,
    PathCost,
    estimate,
    explain,
    plan,
    tt_linear,
    tt_linear_dense,
)

__all__ = [
    "PATHS", "DeviceModel", "PathCost", "TTLinearHalves", "TTLinearSweep", "apply_gates",
    "estimate", "explain", "gate_masks", "merge_left", "merge_left_grads", "merge_right",
    "merge_right_grads", "padded_width", "plan", "sweep_merges", "tt_linear",
    "tt_linear_dense", "tt_linear_halves", "tt_linear_sweep",
]
