"""``nn.MultiheadAttention`` and torch's transformer layers under ``tensorize``: the packed
query-key-value projection and the output projection become TT layers
(:mod:`comera_engine.layers.attention`), and the model computes what torch's own dense
module computes on the TT layers' weights, in training and through the inference fast
paths, with the gradient reaching the cores; ``save`` / ``load_into`` rebuild it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import comera_engine as ce
from comera_engine.errors import ConfigError
from comera_engine.layers import SplitAttention, TTLinear, groupable_linears, tt_layers
from tests.run_checks import readme_loop

E, HEADS, FF, VOCAB = 32, 4, 64, 50


class Encoder(nn.Module):
    """Tokens through torch's ``nn.TransformerEncoder`` (two layers), mean-pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, E)
        layer = nn.TransformerEncoderLayer(E, HEADS, FF, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
        self.head = nn.Linear(E, 3)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.enc(self.emb(x), src_key_padding_mask=pad).mean(1))


def dense_twin(model: Encoder) -> Encoder:
    """A fresh, dense ``Encoder`` holding ``model``'s weights: each TT layer's rebuilt
    weight where torch's module keeps it (an attention's packed projection as its
    ``in_proj_weight``), every other tensor as is. The independent reference."""
    state = {}
    for key, tensor in model.state_dict().items():
        if ".tt." not in key:  # biases and the layers left dense
            state[key.replace("self_attn.in_proj.bias", "self_attn.in_proj_bias")] = tensor
    for name, layer in tt_layers(model):
        key = (name.replace(".in_proj", ".in_proj_weight") if name.endswith(".in_proj")
               else f"{name}.weight")
        state[key] = layer.dense_weight().detach().clone()
    twin = Encoder()
    twin.load_state_dict(state)
    return twin


def tensorized(seed: int = 0, **kw: object) -> Encoder:
    torch.manual_seed(seed)
    return ce.tensorize(Encoder(), ce.CoMERAConfig(target_compression=4), **kw)


def tokens(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (5, 9), generator=g)
    pad = torch.zeros(5, 9, dtype=torch.bool)
    pad[1:, 6:] = True  # left-aligned padding: what the nested-tensor fast path takes
    return x, pad


def test_every_projection_of_torchs_encoder_becomes_tt() -> None:
    model = tensorized()
    names = [n for n, _ in tt_layers(model)]
    for i in range(2):
        for part in ("self_attn.in_proj", "self_attn.out_proj", "linear1", "linear2"):
            assert f"enc.layers.{i}.{part}" in names
        attn = model.enc.layers[i].self_attn
        assert isinstance(attn, SplitAttention) and isinstance(attn, nn.MultiheadAttention)
        assert attn.in_proj_weight.shape == (3 * E, E)
    # the attention projections are read as weights, never called: no grouped halves
    assert not {id(model.enc.layers[0].self_attn.in_proj),
                id(model.enc.layers[0].self_attn.out_proj)} & {
                    id(m) for m in groupable_linears(model)}
    assert {id(model.enc.layers[0].linear1)} <= {id(m) for m in groupable_linears(model)}


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("mode", ["train", "eval", "eval, no grad, padded"])
def test_the_model_computes_torchs_dense_encoder_on_the_tt_weights(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Training mode, eval mode (torch's per-layer fast path, under no_grad) and eval with
    a padding mask under no_grad (the encoder's nested-tensor fast path): the outputs of
    torch's dense twin; in training the gradient of every core is the dense weight's
    gradient taken back through the TT reconstruction."""
    model = tensorized()
    twin = dense_twin(model)
    x, pad = tokens()
    if mode != "train":
        model.eval()
        twin.eval()
    if mode == "train":
        y, want = model(x), twin(x)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        loss, loss_twin = y.square().sum(), want.square().sum()
        loss.backward()
        loss_twin.backward()
        for name, layer in tt_layers(model):
            if not isinstance(layer, TTLinear):
                continue
            owner = twin.get_submodule(name.rpartition(".")[0])
            dense = (owner.in_proj_weight if name.endswith("in_proj")
                     else twin.get_submodule(name).weight)
            cores = list(layer.tt.cores)
            expect = torch.autograd.grad(layer.dense_weight(), cores, dense.grad)
            for core, g in zip(cores, expect):
                torch.testing.assert_close(core.grad, g, rtol=1e-4, atol=1e-6)
        return
    fast: list[int] = []  # torch's fused inference kernel for an encoder layer
    kernel = torch._transformer_encoder_layer_fwd
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd",
                        lambda *a, **k: fast.append(1) or kernel(*a, **k))
    with torch.no_grad():
        padding = pad if mode.endswith("padded") else None
        torch.testing.assert_close(model(x, padding), twin(x, padding), rtol=1e-5, atol=1e-5)
    assert len(fast) == 4  # both layers, in both models: the fast path ran on TT weights


def test_split_attention_is_torchs_attention_with_every_option() -> None:
    """Masks, ``need_weights`` (averaged or per head), bias-free, extra key/value biases,
    sequence-first: a :class:`SplitAttention` returns what the attention it was split
    from returns, and shares its parameters."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 6, E, generator=g)
    kv = torch.randn(3, 7, E, generator=g)
    mask = torch.rand(6, 7, generator=g) > 0.7
    mask[:, 0] = False
    key_pad = torch.zeros(3, 7, dtype=torch.bool)
    key_pad[2, 5:] = True
    for options in ({}, {"bias": False}, {"add_bias_kv": True, "add_zero_attn": True},
                    {"batch_first": False}):
        torch.manual_seed(0)
        attn = nn.MultiheadAttention(E, HEADS, **{"batch_first": True, **options})
        split = SplitAttention.of(copy.deepcopy(attn))
        a, b = (q, kv) if attn.batch_first else (q.transpose(0, 1), kv.transpose(0, 1))
        for kw in ({}, {"attn_mask": mask, "key_padding_mask": key_pad},
                   {"need_weights": True, "average_attn_weights": False}):
            want, want_w = attn(a, b, b, **kw)
            got, got_w = split(a, b, b, **kw)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(got_w, want_w)
    assert split.in_proj.weight is split.in_proj_weight
    with pytest.raises(TypeError, match="SplitAttention.of"):
        SplitAttention(E, HEADS)


def test_attention_of_other_key_widths_keeps_its_projections_dense_and_says_why() -> None:
    """``kdim`` / ``vdim`` other than the query's: three projections, not one matrix; the
    report says so, the output projection becomes TT, the attention still runs."""
    from comera_engine.layers import tensorize_layers

    class Cross(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(E, HEADS, kdim=16, vdim=24, batch_first=True)

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.attn(q, k, v, need_weights=False)[0]

    torch.manual_seed(0)
    model = Cross()
    rows = {r["name"]: r for r in tensorize_layers(model, rank=4)}
    assert not rows["attn.in_proj"]["replaced"]
    assert "kdim / vdim" in rows["attn.in_proj"]["reason"]
    assert rows["attn.out_proj"]["replaced"] and isinstance(model.attn.out_proj, TTLinear)
    assert type(model.attn) is nn.MultiheadAttention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, w, generator=g) for w in (E, 16, 24))
    reference = nn.MultiheadAttention(E, HEADS, kdim=16, vdim=24, batch_first=True)
    state = {k_: t for k_, t in model.state_dict().items() if "out_proj" not in k_}
    state["attn.out_proj.weight"] = model.attn.out_proj.dense_weight().detach()
    state["attn.out_proj.bias"] = model.attn.out_proj.bias.detach()
    reference.load_state_dict({k_.removeprefix("attn."): t for k_, t in state.items()})
    torch.testing.assert_close(model(q, k, v), reference(q, k, v, need_weights=False)[0])


def test_exclude_keeps_the_packed_projection_dense() -> None:
    model = tensorized(exclude=["*.in_proj"])
    attn = model.enc.layers[0].self_attn
    assert type(attn) is nn.MultiheadAttention and isinstance(attn.out_proj, TTLinear)
    x, _ = tokens()
    torch.testing.assert_close(model(x), dense_twin(model)(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="exclude"):
        ce.tensorize(Encoder(), ce.CoMERAConfig(target_compression=4), exclude=["*.qkv"])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_save_and_load_into_a_fresh_encoder(tmp_path: Path) -> None:
    """Trained a few steps in the README's loop (ranks pruned), saved, loaded into a
    fresh ``Encoder()``: the same outputs, in training and in eval with padding."""
    config = ce.CoMERAConfig(target_compression=4)
    torch.manual_seed(0)
    model = ce.tensorize(Encoder(), config)

    def loss_of(g: torch.Generator) -> torch.Tensor:
        x = torch.randint(0, VOCAB, (16, 9), generator=g)
        return nn.functional.cross_entropy(model(x), x[:, 0] % 3)

    comera = readme_loop(model, config, 30, loss_of)
    assert comera.report()["compression"] == pytest.approx(4, rel=0.05)
    path = tmp_path / "encoder.safetensors"
    ce.save(model, path)
    loaded = ce.load_into(Encoder(), path)
    assert isinstance(loaded.enc.layers[1].self_attn, SplitAttention)
    x, pad = tokens()
    torch.testing.assert_close(loaded(x), model(x))
    loaded.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, pad), model(x, pad))


ATTENTION_MODULE = '''
import torch
from torch import nn

COMERA_MODELS = ["feature_tokens"]


class Doubled(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def feature_tokens(in_features, num_classes):
    """Each input feature a token through torch's encoder layer, mean-pooled."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = Doubled(1, 32)
            layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
            self.head = nn.Linear(32, num_classes)

        def forward(self, x):
            return self.head(self.enc(self.tok(x.unsqueeze(-1))).mean(1))

    return Net()
'''


def test_the_preview_plans_an_attention_projection_as_its_rebuilt_weight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The studio's preview of a factory network with torch's attention: its projections
    are TT layers on the ``dense`` path (torch reads their weight, rebuilt each step:
    the memory estimate counts it), the feed-forward linears on the planner's."""
    from comera_engine.preview import preview

    (tmp_path / "attn_mod.py").write_text(ATTENTION_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    raw = {"name": "attn", "task": "classify",
           "model": {"factory": "attn_mod:feature_tokens", "tensorize": {"exclude": ["head"]}},
           "data": {"name": "digits"}, "comera": {"target_compression": 3},
           "train": {"steps": 100, "batch_size": 32}}
    pv = preview(raw)
    assert not pv.errors, pv.errors
    layers = {layer.name: layer for layer in pv.layers}
    for name in ("enc.layers.0.self_attn.in_proj", "enc.layers.0.self_attn.out_proj"):
        assert layers[name].weight_read and layers[name].path == "dense"
    assert layers["enc.layers.0.self_attn.in_proj"].shape == (32, 96)
    assert not layers["enc.layers.0.linear1"].weight_read
    in_proj = layers["enc.layers.0.self_attn.in_proj"]
    assert pv.memory["tt"]["materialised"] >= 2 * 4 * 32 * 96  # W (3E × E) and its gradient
    assert in_proj.tt_macs >= 32 * 96  # a dense GEMM per token, plus W's rebuild
    # a layer kept dense for a reason of its own is named, with the reason; the
    # config's exclude ("head") is not repeated
    kept = [n for n in pv.notes if n.startswith("Kept dense")]
    assert len(kept) == 1 and "tok (a Doubled computes more than a plain nn.Linear" in kept[0]


def test_from_pretrained_at_full_rank_computes_the_original_encoder() -> None:
    """``from_pretrained`` splits the attention and TT-SVDs its packed projection from the
    trained values: at full rank (exact TT-SVD) the model gives the original's outputs."""
    torch.manual_seed(0)
    original = Encoder().eval()
    model = ce.tensorize(copy.deepcopy(original), ce.CoMERAConfig(), rank=512,
                         from_pretrained=True, exclude=["emb"]).eval()
    assert isinstance(model.enc.layers[0].self_attn.in_proj, TTLinear)
    x, pad = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x), original(x), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model(x, pad), original(x, pad), rtol=1e-4, atol=1e-4)
