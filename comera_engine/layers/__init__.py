"""TT layers (drop-ins for ``nn.Linear`` / ``nn.Embedding``) and model-level helpers."""

from .tensorize import TT_LAYERS, size_report, tensorize, truncate, tt_layers
from .tt_embedding import TTEmbedding
from .tt_linear import TTLinear

__all__ = ["TT_LAYERS", "TTEmbedding", "TTLinear", "size_report", "tensorize", "truncate",
           "tt_layers"]
