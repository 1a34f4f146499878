"""TT layers (drop-ins for ``nn.Linear`` / ``nn.Embedding``) and model-level helpers;
the peer (tltorch) TT layers of docs/METHODS.md in :mod:`.peers`."""

from .attention import SplitAttention
from .peers import PEER_LAYERS, TLTorchEmbedding, TLTorchLinear, peer_layers
from .tensorize import (
    TT_LAYERS,
    candidate_layers,
    conv1d_as_linear,
    dense_size_metrics,
    factorized_layers,
    freeze_gates,
    groupable_linears,
    is_conv1d,
    size_report,
    stored_nbytes,
    tensorize_layers,
    truncate,
    tt_layers,
)
from .tied import TiedDecoder
from .tt_embedding import TTEmbedding, TTEmbeddingBag
from .tt_linear import TTLinear

__all__ = ["PEER_LAYERS", "SplitAttention", "TLTorchEmbedding", "TLTorchLinear", "TT_LAYERS",
           "TTEmbedding", "TTEmbeddingBag", "TiedDecoder", "TTLinear", "candidate_layers",
           "conv1d_as_linear", "dense_size_metrics", "factorized_layers", "freeze_gates",
           "groupable_linears", "is_conv1d", "peer_layers", "size_report", "stored_nbytes",
           "tensorize_layers", "truncate", "tt_layers"]
