"""A TT MLP for image classification (8x8 digits, flattened images).

``input -> [TTLinear -> ReLU -> Dropout] * len(hidden) -> Linear -> logits``. The hidden
layers are the ``hidden`` kind, the output layer the ``output`` kind (dense by default:
with 10 outputs a TT factorisation saves nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from comera_engine.models.common import LayerFactory, mlp


@dataclass(frozen=True)
class MLPSize:
    hidden: tuple[int, ...]
    rank: int
    dropout: float = 0.1


PRESETS: dict[str, MLPSize] = {
    "paper": MLPSize(hidden=(1024, 1024), rank=16),
    "small": MLPSize(hidden=(512, 512), rank=12),
    "tiny": MLPSize(hidden=(256, 256), rank=8),
}


class TTMLP(nn.Module):
    """``forward(x [B, input_dim]) -> logits [B, num_classes]``."""

    def __init__(
        self, size: MLPSize, factory: LayerFactory, input_dim: int, num_classes: int
    ) -> None:
        super().__init__()
        widths = [input_dim, *size.hidden]
        self.body = mlp(factory, "hidden", widths, dropout=size.dropout, last_activation=True)
        self.out = factory.linear("output", widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x.flatten(1)))
