"""CoMERA engine: rank-adaptive tensor-train training (arXiv 2405.14377).

``import comera_engine`` is cheap: the layers (and torch) load on first use of
``TTLinear``, ``TTEmbedding``, ``tensorize``, ``truncate``, ``size_report`` or the TT math
(``tt_svd``, ``max_tt_ranks``, ``plan``, ``estimate``, ``explain``), so the run
store, the launcher and the CLI's light commands start fast. It needs only torch, numpy
and tensorly; datasets, tokenizers, streamlit, pynvml and onnx are imported where used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._lazy import lazy_getattr

__version__ = "0.1.0"

__all__ = ["TTEmbedding", "TTLinear", "__version__", "estimate", "explain", "load",
           "max_tt_ranks", "plan", "size_report", "tensorize", "truncate", "tt_svd"]

#: Public names that load torch on first use, and the module each lives in.
_LAZY = {"TTEmbedding": "layers", "TTLinear": "layers", "size_report": "layers",
         "tensorize": "layers", "truncate": "layers", "tt_svd": "tensor",
         "max_tt_ranks": "tensor", "explain": "tensor", "plan": "tensor",
         "estimate": "tensor"}

if TYPE_CHECKING:  # pragma: no cover
    from .layers import TTEmbedding, TTLinear, size_report, tensorize, truncate
    from .tensor import estimate, explain, max_tt_ranks, plan, tt_svd


__getattr__ = lazy_getattr(__name__, _LAZY)


def load(path: str, map_location: str = "cpu") -> Any:
    """Rebuild a model exported with ``comera export`` (no pickle). See
    :mod:`comera_engine.export`."""
    from .export import load as _load

    return _load(path, map_location=map_location)
