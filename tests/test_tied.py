"""A language model's head tied to its embedding table (one weight) under ``tensorize``:
the table becomes TT and the head decodes through it (:mod:`comera_engine.layers.tied`),
against the same tied model dense on the TT table's values; the tie survives save /
load_into and the exports' copies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import comera_engine as ce
from comera_engine.errors import ConfigError
from comera_engine.layers import TTEmbedding, tt_layers
from comera_engine.layers.tied import TiedDecoder
from tests.run_checks import readme_loop

V, D = 120, 32


class TinyLM(nn.Module):
    """Tokens through an embedding, one encoder layer, and a head tied to the table."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.block = nn.TransformerEncoderLayer(D, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(D, V)
        self.head.weight = self.emb.weight  # tied: one matrix

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(ids)))


def tensorized(**kw: object) -> TinyLM:
    torch.manual_seed(0)
    return ce.tensorize(TinyLM(), ce.CoMERAConfig(target_compression=3), **kw)


def dense_twin(model: TinyLM) -> TinyLM:
    """A fresh, tied, dense ``TinyLM`` holding ``model``'s values: the TT table's rebuilt
    weight as the shared matrix, every TT linear's rebuilt weight, the rest as is."""
    state = {k: v for k, v in model.state_dict().items() if ".tt." not in k}
    state = {k.replace("self_attn.in_proj.bias", "self_attn.in_proj_bias"): v
             for k, v in state.items()}
    for name, layer in tt_layers(model):
        key = (name.replace(".in_proj", ".in_proj_weight") if name.endswith(".in_proj")
               else f"{name}.weight")
        state[key] = layer.dense_weight().detach().clone()
    state["head.weight"] = state["emb.weight"]
    twin = TinyLM()
    twin.load_state_dict(state)
    assert twin.head.weight is twin.emb.weight
    return twin


def tokens() -> torch.Tensor:
    return torch.randint(0, V, (4, 7), generator=torch.Generator().manual_seed(1))


def test_the_head_decodes_through_the_tt_table_as_the_tied_dense_model_does() -> None:
    model = tensorized()
    assert isinstance(model.emb, TTEmbedding) and isinstance(model.head, TiedDecoder)
    assert model.head.embedding is model.emb and model.head.bias is not None
    # the table's parameters are the embedding's, once: the head adds its bias only
    assert "emb" in [n for n, _ in tt_layers(model)]
    assert [n for n, _ in model.head.named_parameters()] == ["bias"]
    twin = dense_twin(model)
    x = tokens()
    y, want = model(x), twin(x)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    y.square().mean().backward()
    want.square().mean().backward()
    cores = list(model.emb.tt.cores)
    expect = torch.autograd.grad(model.emb.dense_weight(), cores, twin.emb.weight.grad)
    for core, g in zip(cores, expect):  # both uses of the table reach its cores
        torch.testing.assert_close(core.grad, g, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(model.head.bias.grad, twin.head.bias.grad)


def test_the_head_follows_its_table_and_a_dense_head_on_a_tt_table_is_refused() -> None:
    kept = tensorized(exclude=["emb", "head"])
    assert type(kept.emb) is nn.Embedding and kept.head.weight is kept.emb.weight
    only_table = tensorized(include=["emb"])
    assert isinstance(only_table.head, TiedDecoder)
    with pytest.raises(ConfigError, match="'head' is tied to 'emb'.*exclude both"):
        tensorized(exclude=["head"])
    from comera_engine.layers import tensorize_layers

    rows = {r["name"]: r for r in tensorize_layers(TinyLM(), rank=4, dry_run=True)}
    assert rows["head"]["tied_to"] == "emb" and rows["head"]["params_before"] == V
    assert rows["emb"]["params_before"] == V * D  # the shared matrix counted once


def test_save_and_load_into_restore_the_tie(tmp_path: Path) -> None:
    """Trained in the README's loop to its target, saved, loaded into a fresh tied
    ``TinyLM``: the head decodes through the rebuilt table, the same outputs."""
    config = ce.CoMERAConfig(target_compression=3)
    torch.manual_seed(0)
    model = ce.tensorize(TinyLM(), config)

    def loss_of(g: torch.Generator) -> torch.Tensor:  # next-token prediction
        ids = torch.randint(0, V, (8, 7), generator=g)
        return nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, V),
                                           ids[:, 1:].reshape(-1))

    comera = readme_loop(model, config, 40, loss_of)
    assert comera.report()["compression"] == pytest.approx(3, rel=0.05)
    path = tmp_path / "lm.safetensors"
    ce.save(model, path)
    loaded = ce.load_into(TinyLM(), path)
    assert isinstance(loaded.head, TiedDecoder) and loaded.head.embedding is loaded.emb
    model.eval()
    loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens()), model(tokens()))


def test_the_export_copies_keep_the_tie() -> None:
    """The ONNX export's copy decodes through the table's export form; the dense
    export's tensors hold the head's weight as the tied dense model names it."""
    from comera_engine.export.core import _dense_tensors
    from comera_engine.export.onnx_export import OnnxTTEmbedding, onnx_export_copy

    model = tensorized().eval()
    copy = onnx_export_copy(model)
    assert isinstance(copy.emb, OnnxTTEmbedding) and copy.head.embedding is copy.emb
    with torch.no_grad():
        torch.testing.assert_close(copy(tokens()), model(tokens()), rtol=1e-5, atol=1e-5)
    skeleton = TinyLM()
    tensors = _dense_tensors(model, skeleton)
    assert set(tensors) == set(skeleton.state_dict())
    torch.testing.assert_close(tensors["head.weight"], tensors["emb.weight"])


class TwoTables(nn.Module):
    """An encoder-decoder's tables as T5 holds them: a ``shared`` table, an encoder table
    that is the same module, a decoder table that is another module holding the same
    weight, and a head tied to it; plus a scaled table (a subclass with its own forward,
    as BART's), which a TT layer would not scale."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(V, D)
        self.enc = self.shared  # the same module at two places
        self.dec = nn.Embedding(V, D)
        self.dec.weight = self.shared.weight  # another module, the same weight
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.shared.weight
        self.scaled = Scaled(V, D)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        h = self.enc(src).mean(1, keepdim=True) + self.dec(tgt) + self.scaled(tgt)
        return self.head(h)


class Scaled(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * 2.0


def test_tables_held_twice_become_one_tt_table_and_a_subclass_stays_dense(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ce.tensorize(TwoTables(), ce.CoMERAConfig(), rank=4)
    assert isinstance(model.shared, TTEmbedding)
    assert model.enc is model.shared and model.dec is model.shared
    assert isinstance(model.head, TiedDecoder) and model.head.embedding is model.shared
    assert type(model.scaled) is Scaled  # kept, with its forward
    assert [n for n, _ in tt_layers(model)] == ["shared"]  # one table, counted once
    from comera_engine.layers import tensorize_layers

    rows = {r["name"]: r for r in tensorize_layers(TwoTables(), rank=4, dry_run=True)}
    assert rows["dec"]["tied_to"] == "shared" and "own forward" in rows["scaled"]["reason"]
    src, tgt = tokens(), tokens().flip(1)
    twin = TwoTables()  # dense, tied, on the TT table's values
    with torch.no_grad():
        twin.shared.weight.copy_(model.shared.dense_weight())
        twin.scaled.weight.copy_(model.scaled.weight)
    torch.testing.assert_close(model(src, tgt), twin(src, tgt), rtol=1e-5, atol=1e-5)
    path = tmp_path / "two.safetensors"
    ce.save(model, path)
    loaded = ce.load_into(TwoTables(), path)
    assert loaded.enc is loaded.shared and loaded.dec is loaded.shared
    assert loaded.head.embedding is loaded.shared
    with torch.no_grad():
        torch.testing.assert_close(loaded(src, tgt), model(src, tgt))
