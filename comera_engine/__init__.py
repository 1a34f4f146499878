"""CoMERA engine: rank-adaptive tensor-train training (arXiv 2405.14377).

``import comera_engine`` needs only torch, numpy and tensorly; everything else (datasets,
tokenizers, streamlit, pynvml, onnx) is imported where it is used.
"""

from __future__ import annotations

from .layers import TTEmbedding, TTLinear, size_report, tensorize, truncate

__version__ = "0.1.0"

__all__ = ["TTEmbedding", "TTLinear", "__version__", "load", "size_report", "tensorize",
           "truncate"]


def load(path: str, map_location: str = "cpu"):  # noqa: ANN201 - returns nn.Module
    """Rebuild a model exported with ``comera export`` (no pickle). See
    :mod:`comera_engine.export`."""
    from .export import load as _load

    return _load(path, map_location=map_location)
