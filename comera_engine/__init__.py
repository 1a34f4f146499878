"""CoMERA engine: rank-adaptive tensor-train training (arXiv 2405.14377).

``import comera_engine`` is cheap: the layers (and torch) load on first use of
``TTLinear``, ``TTEmbedding``, ``tensorize``, ``truncate`` or ``size_report``, so the run
store, the launcher and the CLI's light commands start fast. It needs only torch, numpy
and tensorly; datasets, tokenizers, streamlit, pynvml and onnx are imported where used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["TTEmbedding", "TTLinear", "__version__", "load", "size_report", "tensorize",
           "truncate"]

_LAYER_NAMES = {"TTEmbedding", "TTLinear", "size_report", "tensorize", "truncate"}

if TYPE_CHECKING:  # pragma: no cover
    from .layers import TTEmbedding, TTLinear, size_report, tensorize, truncate


def __getattr__(name: str) -> Any:
    if name in _LAYER_NAMES:
        from . import layers

        value = getattr(layers, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'comera_engine' has no attribute {name!r}")


def load(path: str, map_location: str = "cpu") -> Any:
    """Rebuild a model exported with ``comera export`` (no pickle). See
    :mod:`comera_engine.export`."""
    from .export import load as _load

    return _load(path, map_location=map_location)
