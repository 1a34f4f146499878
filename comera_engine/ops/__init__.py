"""The ops, pure PyTorch, one per module (its ``autograd.Function`` or step, its reference):

* :mod:`.tt_linear_halves`: ``Y = (X·L)·R + b`` with the halves merged;
* :mod:`.tt_linear_sweep`: ``X`` contracted with one core at a time;
* :mod:`.ttm_lookup`: TTM embedding rows from merged tables;
* :mod:`.ttm_matrix`: the matrix of a gated TT matrix (the ``ttm`` linear layout);
* :mod:`.adamw`: the AdamW step over every parameter group in one call;
* shared: :mod:`.gates` (rank gates, tensors saved by name), :mod:`.merges`.

Each has tests/test_op_<name>.py and experiments/bench_op_<name>.py. Where the CPU
backend is built (:func:`comera_engine.backends.cpu_backend`), the ops hand it their work.
"""

from .adamw import AdamW
from .tt_linear_halves import TTLinearHalves, tt_linear_halves, tt_linear_halves_reference
from .tt_linear_sweep import TTLinearSweep, tt_linear_sweep, tt_linear_sweep_reference
from .ttm_lookup import ttm_lookup, ttm_lookup_naive
from .ttm_matrix import ttm_matrix, ttm_matrix_reference

__all__ = ["AdamW", "TTLinearHalves", "TTLinearSweep", "tt_linear_halves",
           "tt_linear_halves_reference", "tt_linear_sweep", "tt_linear_sweep_reference",
           "ttm_lookup", "ttm_lookup_naive", "ttm_matrix", "ttm_matrix_reference"]
