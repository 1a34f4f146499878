"""A network whose tables are too large to build dense: built on the ``meta`` device,
tensorized there, then materialised with torch's convention (``to_empty``, then each
module's ``reset_parameters``), it starts as a TT network built directly does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import comera_engine as ce
from comera_engine.layers import TTEmbedding, TTEmbeddingBag, TTLinear, tt_layers

pytestmark = pytest.mark.usefixtures("one_thread")


class BigClicks(nn.Module):
    """Two tables of 2 M and 1 M rows (768 MB dense in float32) and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.items = nn.EmbeddingBag(2_000_000, 64, mode="sum")
        self.users = nn.Embedding(1_000_000, 64)
        self.mlp = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, items: torch.Tensor, users: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.items(items), self.users(users)], 1)).squeeze(1)


def _materialise(model: nn.Module) -> nn.Module:
    """torch's convention: storage on the device, then every module draws its values."""
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return model


def test_a_network_built_on_meta_is_tensorized_then_materialised() -> None:
    with torch.device("meta"):
        model = BigClicks()
    ce.tensorize(model, ce.CoMERAConfig(target_compression=500))
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])  # nothing drawn
    planned = ce.size_report(model)  # readable before anything is allocated
    _materialise(model)
    assert ce.size_report(model) == planned  # the materialised network, every entry alive
    assert isinstance(model.items, TTEmbeddingBag) and isinstance(model.users, TTEmbedding)
    assert isinstance(model.mlp[0], TTLinear)
    torch.manual_seed(0)
    fresh = {name: type(layer)(  # the same layers built directly, on the CPU
        *((layer.num_embeddings, layer.embedding_dim) if isinstance(layer, TTEmbedding)
          else (layer.in_features, layer.out_features)),
        rank=list(layer.tt.bond_ranks)) for name, layer in tt_layers(model)}
    ids = torch.randint(0, 1_000_000, (4096,), generator=torch.Generator().manual_seed(1))
    for name, layer in tt_layers(model):
        assert torch.equal(layer.tt.gate, torch.ones_like(layer.tt.gate))
        assert bool(layer.tt.alive.all())
        if isinstance(layer, TTEmbedding):  # rows of a fresh table: entries of variance 1
            got = TTEmbedding.forward(layer, ids).detach()
            ref = TTEmbedding.forward(fresh[name], ids).detach()
        else:  # a fresh linear: W's entries of variance 1/(3·in), as nn.Linear's
            got, ref = layer.dense_weight().detach(), fresh[name].dense_weight().detach()
        assert float(got.std()) == pytest.approx(float(ref.std()), rel=0.15), name
        assert bool(torch.isfinite(got).all())
    # it trains: CoMERA's loop runs from these values
    comera = ce.CoMERA(model, ce.CoMERAConfig(target_compression=500), total_steps=20)
    opt = torch.optim.AdamW(comera.param_groups(), lr=1e-2)
    comera.attach(opt)
    g = torch.Generator().manual_seed(2)
    items = torch.randint(0, 2_000_000, (32, 5), generator=g)
    users = torch.randint(0, 1_000_000, (32,), generator=g)
    clicks = (items[:, 0] % 2).float()
    losses = []
    for _ in range(20):
        loss = nn.functional.binary_cross_entropy_with_logits(model(items, users), clicks)
        losses.append(float(loss.detach()))
        opt.zero_grad()
        comera.loss(loss).backward()
        opt.step()
    assert losses[-1] < losses[0]
