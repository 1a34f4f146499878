"""The worked example's own network (README, "Train your own model"): a small MLP for a
table of numeric features, written as any PyTorch model is. Nothing here knows about
tensor trains: the config's ``[model.tensorize]`` table says which of its layers become
TT, and ``comera train`` / ``comera app --models experiments.own.model`` do the rest.

``COMERA_MODELS`` lists the factories this module exposes: ``comera app --models`` offers
them on the New experiment page, and ``comera_engine.load`` rebuilds exports through
them (and through nothing else).
"""

from __future__ import annotations

import torch
from torch import nn

COMERA_MODELS = ["tabular_net"]


class TabularNet(nn.Module):
    """``forward(x [B, in_features]) -> logits [B, num_classes]``: hidden layers with
    ReLU and dropout, then a linear head."""

    def __init__(self, in_features: int, num_classes: int, hidden: list[int],
                 dropout: float) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(), nn.Dropout(dropout)]
            width = h
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def tabular_net(in_features: int, num_classes: int, hidden: list[int] | None = None,
                dropout: float = 0.1) -> nn.Module:
    """The factory a config names (``model.factory = "experiments.own.model:tabular_net"``);
    ``in_features`` and ``num_classes`` come from the data, the rest from
    ``model.kwargs``."""
    return TabularNet(in_features, num_classes, list(hidden or [64, 64]), dropout)
