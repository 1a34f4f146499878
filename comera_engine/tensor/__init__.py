"""The tensor-train math: factorisation, gated cores, TT-SVD, contraction planning."""

from .factorize import Factorization, factorize, resolve_factors
from .lookup import ttm_lookup, ttm_lookup_naive
from .planner import (
    PATHS,
    estimate,
    explain,
    explain_decode,
    explain_lookup,
    explain_ttm,
    plan,
    tt_linear,
)
from .size import surrogate, tt_size
from .tt import (
    RankChange,
    TensorTrain,
    TTLinearCores,
    TTMCores,
    max_tt_ranks,
    tt_svd,
)

__all__ = [
    "PATHS", "Factorization", "RankChange", "TTLinearCores", "TTMCores", "TensorTrain",
    "estimate", "explain", "explain_decode", "explain_lookup", "explain_ttm", "factorize",
    "max_tt_ranks", "plan", "resolve_factors", "surrogate", "tt_linear", "tt_size", "tt_svd",
    "ttm_lookup", "ttm_lookup_naive",
]
