"""Issue 3: TT layers against dense references (float64)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from comera_engine import TTEmbedding, TTLinear, size_report, tensorize, truncate
from comera_engine.layers import tensorize_layers
from comera_engine.tensor.lookup import ttm_lookup, ttm_lookup_naive

DT = torch.float64


def test_ttlinear_matches_dense_layer_with_padding() -> None:
    torch.manual_seed(0)
    layer = TTLinear(30, 20, rank=4, dtype=DT)  # 30 and 20 both factor (maybe padded)
    dense = nn.Linear(30, 20, dtype=DT)
    with torch.no_grad():
        dense.weight.copy_(layer.dense_weight())
        dense.bias.copy_(layer.bias)
    x = torch.randn(3, 7, 30, dtype=DT, requires_grad=True)
    y = layer(x)
    assert y.shape == (3, 7, 20)
    assert torch.allclose(y, dense(x), atol=1e-12)
    g = torch.randn_like(y)
    gx = torch.autograd.grad((y * g).sum(), x)[0]
    gx_ref = torch.autograd.grad((dense(x) * g).sum(), x)[0]
    assert torch.allclose(gx, gx_ref, atol=1e-12)


@pytest.mark.parametrize("path", ["halves", "sweep", "dense"])
def test_ttlinear_bf16_autocast_backward(path: str) -> None:
    """Under bf16 autocast (the trainer's GPU mode; CPU here) forward and backward run,
    the gradients keep the parameters' dtype and stay within bf16 error of a dense
    float64 layer with the same weight."""
    torch.manual_seed(0)
    layer = TTLinear(64, 48, rank=8, path=path)
    dense = nn.Linear(64, 48, dtype=DT)
    with torch.no_grad():
        dense.weight.copy_(layer.dense_weight())
        dense.bias.copy_(layer.bias)
    x = torch.randn(256, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    g = torch.randn(256, 48)
    (y.float() * g).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == p.dtype for p in layer.parameters())
    xd = x.detach().double().requires_grad_()
    (dense(xd) * g.double()).sum().backward()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.detach().double() - b.detach()).norm() / b.detach().norm())

    assert rel(y.float(), dense(xd).detach()) < 2e-2
    assert rel(x.grad, xd.grad) < 2e-2
    assert rel(layer.bias.grad, dense.bias.grad) < 2e-2


def test_ttlinear_padded_factors() -> None:
    layer = TTLinear(10, 7, rank=3, in_factors=[3, 4], out_factors=[2, 4], dtype=DT)
    x = torch.randn(5, 10, dtype=DT)
    ref = x @ layer.dense_weight().t() + layer.bias
    assert torch.allclose(layer(x), ref, atol=1e-12)
    assert layer.dense_weight().shape == (7, 10)


def test_init_variance_matches_dense_defaults() -> None:
    """Every draw of a TT layer has the dense default's weight variance (the cores are
    scaled isometries: the energy of the product does not depend on the draw), where
    i.i.d. Gaussian cores of the same entry scale give 0.4-2x of it from draw to draw."""
    torch.manual_seed(0)
    for fin, fout, rank in [(768, 768, 30), (768, 3072, 30), (256, 256, 19), (64, 512, 38)]:
        for _ in range(3):
            w = TTLinear(fin, fout, rank=rank).dense_weight().detach()
            assert w.var().item() == pytest.approx(1.0 / (3 * fin), rel=0.05)
    e = TTEmbedding(4096, 64, rank=16).dense_weight().detach()
    assert e.var().item() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("shape", [(1, 8, 4, 6), (6, 4, 2, 1), (3, 2, 20), (1, 3, 9)],
                         ids=["tall", "last", "wide-3d", "wide-first"])
def test_cores_are_scaled_isometries_of_the_gaussian_entry_scale(shape) -> None:
    """``scaled_isometry``: the core's matricisation ``(m, r)`` has orthogonal columns of
    norm ``std·√m`` (rows of norm ``std·√r`` when wide), so each entry has the mean
    square ``std²`` of an ``N(0, std²)`` core; checked against float64 Gram matrices.
    It draws as many normal numbers as ``randn(shape)`` (the generator ends in the same
    state) and is reproducible from the seed."""
    from comera_engine.tensor.tt import scaled_isometry

    std = 0.37
    torch.manual_seed(5)
    core = scaled_isometry(shape, std, torch.float64)
    after = torch.randn(3)
    torch.manual_seed(5)
    torch.randn(shape, dtype=torch.float64)
    assert torch.equal(after, torch.randn(3))
    torch.manual_seed(5)
    assert torch.equal(scaled_isometry(shape, std, torch.float64), core)
    a = core.reshape(-1, shape[-1])
    m, r = a.shape
    gram = a.T @ a if m >= r else a @ a.T
    torch.testing.assert_close(gram, std**2 * max(m, r) * torch.eye(min(m, r),
                                                                   dtype=torch.float64),
                               rtol=0, atol=1e-12)
    assert core.shape == shape and core.dtype == torch.float64 and core.is_contiguous()
    assert a.pow(2).mean().item() == pytest.approx(std**2, rel=1e-12)
    assert scaled_isometry(shape, std, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("d", [2, 3, 4])
def test_ttembedding_matches_dense_with_repeats_and_padding(d: int) -> None:
    torch.manual_seed(d)
    emb = TTEmbedding(500, 24, rank=4, padding_idx=3, d=d, dtype=DT)
    ids = torch.tensor([[3, 7, 7, 499, 0], [7, 3, 12, 12, 12]])
    out = emb(ids)
    E = emb.dense_weight()
    assert torch.allclose(out, E[ids], atol=1e-12)
    assert torch.all(out[ids == 3] == 0)
    # gradients: dense nn.Embedding grads mapped back through the reconstruction
    w = torch.randn(*ids.shape, 24, dtype=DT)
    core_grads = torch.autograd.grad((emb(ids) * w).sum(), list(emb.tt.cores))
    ref = nn.Embedding(500, 24, padding_idx=3, dtype=DT)
    with torch.no_grad():
        ref.weight.copy_(E.detach())
    (ref(ids) * w).sum().backward()
    dense_grad = ref.weight.grad
    assert torch.all(dense_grad[3] == 0)
    mapped = torch.autograd.grad((emb.dense_weight() * dense_grad).sum(), list(emb.tt.cores))
    for a, b in zip(core_grads, mapped):
        assert torch.allclose(a, b, atol=1e-10)


def test_lookup_matches_naive_baseline() -> None:
    torch.manual_seed(0)
    emb = TTEmbedding(1000, 32, rank=5, d=3, dtype=DT)
    ids = torch.randint(0, 1000, (64,))
    cores = emb.tt.gated_cores()
    ref = ttm_lookup_naive(ids, cores)
    assert torch.allclose(ttm_lookup(ids, cores), ref, atol=1e-12)
    # the fixed-shape path (used under CUDA graph capture) gives the same rows
    assert torch.allclose(ttm_lookup(ids, cores, dedup=False), ref, atol=1e-12)


def test_tensorize_random_and_pretrained() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(256, 16), nn.Flatten(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 4))
    x = torch.randint(0, 256, (5, 4))
    ref = model(x).detach()
    # TT-SVD at full rank reproduces the trained model exactly; the public tensorize
    # returns the model, the layer-level one reports each candidate
    assert tensorize(model, rank=64, from_pretrained=True) is model
    assert isinstance(model[0], TTEmbedding) and isinstance(model[2], TTLinear)
    assert isinstance(model[4], nn.Linear)  # a side below min_features: kept dense
    assert torch.allclose(model(x), ref, atol=1e-5)
    pre = tensorize_layers(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4)), rank=4)
    assert [r["replaced"] for r in pre] == [True, False]
    assert pre[1]["reason"].startswith("smaller than")
    m2 = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    rep = tensorize_layers(m2, rank=4, exclude=["1"])
    assert rep[0]["replaced"] and not rep[1]["replaced"] and rep[1]["reason"] == "excluded"
    assert rep[0]["params_after"] < rep[0]["params_before"]


@pytest.mark.parametrize("path", [None, "halves", "sweep", "dense"])
def test_an_empty_batch_gives_an_empty_output_as_torchs_layers_do(path: str | None) -> None:
    """No rows (the last, empty batch of a loader; a 3-D input of no tokens): the output
    torch's own layer gives, empty, and a backward; it crashed on a reshape."""
    from comera_engine.layers import TTEmbeddingBag

    for layout in ("tt", "ttm"):
        tt = TTLinear(64, 48, rank=4, path=path if layout == "tt" else None, layout=layout)
        for shape in ((0, 64), (2, 0, 64)):
            x = torch.randn(*shape, requires_grad=True)
            y = tt(x)
            assert y.shape == nn.Linear(64, 48)(x).shape
            y.sum().backward()
    lookup = {None: None, "halves": "gather", "sweep": "gather", "dense": "dense"}[path]
    ids = torch.zeros(0, 5, dtype=torch.long)
    emb = TTEmbedding(500, 16, rank=4, path=lookup)
    assert emb(ids).shape == nn.Embedding(500, 16)(ids).shape
    bag = TTEmbeddingBag(500, 16, rank=4, path=lookup, mode="mean")
    none = torch.zeros(0, dtype=torch.long)
    assert bag(none, none).shape == nn.EmbeddingBag(500, 16)(none, none).shape
    (emb(ids).sum() + bag(none, none).sum()).backward()


@pytest.mark.parametrize("path", [None, "halves", "sweep"])
def test_float32_input_to_a_bf16_layer_is_refused_as_torch_refuses_it(path: str | None
                                                                    ) -> None:
    """A bf16 TT layer given float32 input: torch's own dtype message, as ``nn.Linear``
    in bf16 gives, on every path (the CPU backend took the call and failed inside with
    '"absorb_gates" not implemented for BFloat16')."""
    x = torch.randn(8, 64)
    with pytest.raises(RuntimeError, match="same dtype"):
        nn.Linear(64, 48).to(torch.bfloat16)(x)
    with pytest.raises(RuntimeError, match="same dtype"):
        TTLinear(64, 48, rank=4, path=path).to(torch.bfloat16)(x)


def test_frozen_parametrized_or_hooked_layers_stay_as_they_are() -> None:
    """A layer the user froze (a TT layer made of it trained again, from random values),
    one whose weight is parametrized (spectral norm: the constraint dropped without a
    word) or with a hook on its forward (an old-style weight norm) stays dense, its row
    saying why; the others become TT, and the kept layers compute what they did."""
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import spectral_norm

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), spectral_norm(nn.Linear(64, 64)),
                          nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)).eval()
    model[2].requires_grad_(False)  # eval: the spectral norm's power iteration holds still
    calls = []
    model[3].register_forward_hook(lambda m, i, o: calls.append(o.shape))
    x = torch.randn(5, 64)
    with torch.no_grad():
        kept = [model[i](x) for i in (1, 2, 3)]
    rows = {r["name"]: r for r in tensorize_layers(model, rank=4)}
    assert [rows[n]["replaced"] for n in "01234"] == [True, False, False, False, True]
    assert "parametrized" in rows["1"]["reason"] and "frozen" in rows["2"]["reason"]
    assert "hooks on its forward" in rows["3"]["reason"]
    assert parametrize.is_parametrized(model[1]) and not model[2].weight.requires_grad
    with torch.no_grad():
        for i, before in zip((1, 2, 3), kept):
            torch.testing.assert_close(model[i](x), before)
    assert len(calls) == 2  # the hook still runs


def test_size_report_and_truncate() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(TTLinear(64, 64, rank=8, dtype=DT), nn.ReLU(),
                          nn.Linear(64, 10, dtype=DT))
    layer = model[0]
    with torch.no_grad():
        layer.tt.gates[2][:5] = 0.0
    rep = size_report(model)
    row = rep["layers"][0]
    s = layer.tt.mode_sizes
    R = [1, *layer.effective_ranks(), 1]
    eff = sum(s[k] * R[k] * R[k + 1] for k in range(len(s))) + 64
    assert row["effective_params"] == eff
    assert row["allocated_params"] == sum(c.numel() for c in layer.tt.cores) + 64
    other = 64 * 10 + 10
    assert rep["model"]["effective_params"] == eff + other
    assert rep["model"]["dense_params"] == 64 * 64 + 64 + other
    assert rep["model"]["compression"] == pytest.approx((64 * 64 + 64 + other) / (eff + other))
    assert rep["model"]["effective_bytes"] == 8 * (eff + other)
    x = torch.randn(4, 64, dtype=DT)
    before = model(x).detach()
    changes = truncate(model)
    assert changes == {"0": [(2, 8, 3)]}
    assert torch.allclose(model(x), before, atol=1e-12)
    after = size_report(model)
    assert after["model"]["allocated_params"] == after["model"]["effective_params"] == eff + other


def test_layer_bad_input() -> None:
    with pytest.raises(ValueError, match="^in_features"):
        TTLinear(0, 4)
    with pytest.raises(ValueError, match="^in_factors"):
        TTLinear(64, 64, in_factors=[4, 4, 3])
    with pytest.raises(ValueError, match="^rank"):
        TTLinear(64, 64, rank=-1)
    with pytest.raises(ValueError, match="^padding_idx"):
        TTEmbedding(10, 8, padding_idx=10)
    with pytest.raises(ValueError, match="^x:"):
        TTLinear(8, 8)(torch.randn(2, 9))
    assert math.isfinite(TTLinear(8, 8).explain(16)["paths"]["halves"]["seconds"])
