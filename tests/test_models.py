"""Models: shapes, TT/dense from config, paper-size parameter counts, DLRM interaction, losses."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from comera_engine.config import ModelConfig
from comera_engine.errors import ConfigError
from comera_engine.layers import tt_layers as _pairs
from comera_engine.models import DLRM, TTMLP, TaskModel, build_model, roc_auc
from comera_engine.models.transformer import TransformerClassifier, TransformerMLM


def tt_layers(model: torch.nn.Module) -> dict:
    return dict(_pairs(model))


def nli_data(vocab: int = 300, seq: int = 16) -> SimpleNamespace:
    return SimpleNamespace(
        name="fake", task="nli", num_classes=3, vocab_size=vocab, seq_len=seq, meta={"pad_id": 0}
    )


def mlm_data(vocab: int = 300, seq: int = 16) -> SimpleNamespace:
    return SimpleNamespace(
        name="fake", task="mlm", num_classes=None, vocab_size=vocab, seq_len=seq, meta={"pad_id": 0}
    )


def ctr_data() -> SimpleNamespace:
    sizes = [500, 40, 300, 7]
    return SimpleNamespace(
        name="fake", task="ctr", num_classes=2, vocab_size=None, seq_len=None,
        meta={"num_dense": 13, "bucket_sizes": sizes},
    )  # fmt: skip


def img_data() -> SimpleNamespace:
    return SimpleNamespace(
        name="fake", task="classification", num_classes=10, vocab_size=None, seq_len=None,
        meta={"input_dim": 64},
    )  # fmt: skip


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------- shapes, TT or dense


def test_transformer_classifier_forward_and_dense_baseline() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(name="transformer_cls", preset="tiny")
    tt = build_model(cfg, nli_data())
    dense = build_model(cfg, nli_data(), dense=True)
    assert isinstance(tt, TransformerClassifier) and isinstance(dense, TransformerClassifier)
    ids = torch.randint(1, 300, (4, 16))
    types = torch.zeros_like(ids)
    mask = torch.ones_like(ids)
    mask[:, 12:] = 0
    for model in (tt, dense):
        assert model(ids, types, mask).shape == (4, 3)
    assert not tt_layers(dense)
    names = set(tt_layers(tt))
    assert "encoder.word" in names and "encoder.layers.0.attn.q" in names
    assert "encoder.layers.1.ffn_out" in names and "pooler" not in names
    # the two builds share the architecture: same module tree, TT layers <-> nn.Linear/Embedding
    for name in names:
        assert isinstance(dense.get_submodule(name), (nn.Linear, nn.Embedding))
    assert n_params(tt) < n_params(dense)


def test_any_layer_kind_dense_or_tt_by_config() -> None:
    cfg = ModelConfig(name="transformer_cls", preset="tiny", tt_layers=["ffn", "head"])
    model = build_model(cfg, nli_data())
    names = set(tt_layers(model))
    assert "pooler" in names and "encoder.layers.0.ffn_in" in names
    assert isinstance(model.encoder.word, nn.Embedding)
    assert isinstance(model.encoder.layers[0].attn.q, nn.Linear)


def test_padding_is_ignored_by_attention() -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="transformer_cls", preset="tiny"), nli_data()).eval()
    ids = torch.randint(1, 300, (2, 16))
    mask = torch.ones_like(ids)
    mask[:, 10:] = 0
    other = ids.clone()
    other[:, 10:] = torch.randint(1, 300, (2, 6))  # change only padded positions
    a = model(ids, None, mask)
    b = model(other, None, mask)
    torch.testing.assert_close(a, b)


def test_mlm_logits_over_vocab_and_selected_positions() -> None:
    torch.manual_seed(0)
    for dense in (True, False):
        model = build_model(ModelConfig(name="transformer_mlm", preset="tiny"), mlm_data(), dense)
        assert isinstance(model, TransformerMLM)
        ids = torch.randint(1, 300, (3, 16))
        full = model.eval()(ids)
        assert full.shape == (3, 16, 300)
        select = torch.zeros_like(ids, dtype=torch.bool)
        select[0, 2] = select[2, 5] = True
        part = model(ids, select=select)
        torch.testing.assert_close(part, full[select], rtol=1e-5, atol=1e-5)


def test_mlm_task_loss_equals_cross_entropy_on_masked_positions() -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="transformer_mlm", preset="tiny"), mlm_data()).eval()
    ids = torch.randint(1, 300, (2, 16))
    labels = torch.full_like(ids, -100)
    labels[0, 3], labels[1, 7], labels[1, 8] = 5, 9, 11
    out = TaskModel(model, "mlm")({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                   "labels": labels})  # fmt: skip
    logits = model(ids)
    ref = F.cross_entropy(logits.reshape(-1, 300), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out["loss"], ref, rtol=1e-5, atol=1e-5)
    assert out["count"].item() == 3
    # a batch with no masked token gives loss 0, not NaN
    none = TaskModel(model, "mlm")({"input_ids": ids, "labels": torch.full_like(ids, -100)})
    assert none["loss"].item() == 0.0


def test_dlrm_interaction_matches_explicit_dot_products() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(name="dlrm", preset="tiny", tt_min_rows=100)
    model = build_model(cfg, ctr_data())
    assert isinstance(model, DLRM)
    # tables with >= 100 rows are TT, the small ones dense
    kinds = [type(t).__name__ for t in model.tables]
    assert kinds[1] == "Embedding" and kinds[3] == "Embedding"
    assert kinds[0] != "Embedding" and kinds[2] != "Embedding"
    dense = torch.randn(5, 13)
    sparse = torch.stack([torch.randint(0, n, (5,)) for n in (500, 40, 300, 7)], 1)
    out = model(dense, sparse)
    assert out.shape == (5,)
    # reference: loop over pairs i < j of [bottom, emb_0, ..., emb_3]
    x = model.bottom(dense)
    vecs = [x] + [t(sparse[:, i]) for i, t in enumerate(model.tables)]
    pairs = [(vecs[i] * vecs[j]).sum(1) for i in range(5) for j in range(i + 1, 5)]
    ref = model.top(torch.cat([x, torch.stack(pairs, 1)], 1)).squeeze(1)
    torch.testing.assert_close(out, ref)
    base = build_model(cfg, ctr_data(), dense=True)
    assert all(isinstance(t, nn.Embedding) for t in base.tables)


def test_tt_mlp_forward() -> None:
    model = build_model(ModelConfig(name="tt_mlp", preset="tiny"), img_data())
    assert isinstance(model, TTMLP)
    assert model(torch.randn(7, 64)).shape == (7, 10)
    assert len(tt_layers(model)) == 2  # two hidden layers; the 10-way output stays dense
    assert isinstance(model.out, nn.Linear)


def test_model_must_fit_the_task() -> None:
    with pytest.raises(ConfigError, match=r"^model\.name: dlrm trains on ctr"):
        build_model(ModelConfig(name="dlrm"), img_data())
    with pytest.raises(ConfigError, match=r"^model\.n_heads"):
        build_model(ModelConfig(name="transformer_cls", d_model=64, n_heads=5), nli_data())


# ---------------------------------------------------------------------- paper size


def test_paper_transformer_sizes_match_the_paper() -> None:
    """Dense: ~256 MB of fp32 weights. TT at rank 30/32: attention 28.8x, FFN 81.5x,
    embedding 139.7x smaller (method page, section 4), from hand-counted core sizes."""
    data = nli_data(vocab=30522, seq=128)
    cfg = ModelConfig(name="transformer_cls", preset="paper")
    with torch.device("meta"):
        dense = build_model(cfg, data, dense=True)
        tt = build_model(cfg, data)
    mb = n_params(dense) * 4 / 2**20
    assert 240 < mb < 270, mb

    def cores(modes: list[int], ranks: list[int]) -> int:
        return sum(r0 * m * r1 for r0, m, r1 in zip(ranks[:-1], modes, ranks[1:]))

    # ranks capped by the unfolding sizes: attention [12,8,8|8,8,12] -> 1,12,30,30,30,12,1
    attn = cores([12, 8, 8, 8, 8, 12], [1, 12, 30, 30, 30, 12, 1])
    ffn_in = cores([12, 8, 8, 12, 16, 16], [1, 12, 30, 30, 30, 16, 1])
    ffn_out = cores([16, 16, 12, 8, 8, 12], [1, 16, 30, 30, 30, 12, 1])
    emb = cores([16 * 4, 20 * 4, 10 * 8, 10 * 6], [1, 32, 32, 32, 1])
    layers = tt_layers(tt)
    q = layers["encoder.layers.0.attn.q"]
    assert q.num_params(effective=False) - 768 == attn  # minus the bias
    assert 768 * 768 / attn == pytest.approx(28.8, abs=0.05)
    assert layers["encoder.layers.0.ffn_in"].num_params(effective=False) - 3072 == ffn_in
    assert layers["encoder.layers.0.ffn_out"].num_params(effective=False) - 768 == ffn_out
    assert 768 * 3072 / ffn_in == pytest.approx(81.5, abs=0.05)
    assert layers["encoder.word"].num_params(effective=False) == emb
    assert 30522 * 768 / emb == pytest.approx(139.7, abs=0.05)
    assert n_params(dense) / n_params(tt) > 30  # ~45x for the whole model at full rank


# ---------------------------------------------------------------------- metrics


def test_roc_auc_and_log_loss_match_sklearn_on_tensors_and_arrays() -> None:
    """The one AUC and log-loss (comera_engine.metrics): the eval metric of click models
    (torch tensors) and the generators' Bayes figures (NumPy arrays) against sklearn."""
    from sklearn.metrics import log_loss as sk_log_loss
    from sklearn.metrics import roc_auc_score

    from comera_engine.metrics import log_loss

    gen = torch.Generator().manual_seed(0)
    targets = (torch.rand(500, generator=gen) < 0.3).float()
    scores = torch.rand(500, generator=gen) + 0.3 * targets
    scores[:50] = 0.5  # ties
    want = roc_auc_score(targets, scores)
    assert roc_auc(scores, targets) == pytest.approx(want, abs=1e-12)
    assert roc_auc(scores.numpy(), targets.numpy()) == roc_auc(scores, targets)
    assert roc_auc(scores.double().requires_grad_(), targets) == roc_auc(scores, targets)
    assert roc_auc(scores, torch.ones(500)) != roc_auc(scores, torch.ones(500))  # NaN
    p = torch.sigmoid(torch.randn(500, generator=gen, dtype=torch.float64))
    assert log_loss(p, targets) == pytest.approx(sk_log_loss(targets, p), rel=1e-12)
    assert log_loss([0.0, 1.0], [1.0, 0.0]) == pytest.approx(-math.log(1e-12))  # clipped
    assert log_loss(p.numpy(), targets.numpy().astype(np.float32)) == log_loss(p, targets)


def test_the_click_generators_bias_lands_the_base_rate() -> None:
    """One bisection (data.clicks.bias_for_rate) sets both generators' base rate: the
    offset makes the mean click probability the rate asked."""
    from comera_engine.data.clicks import bias_for_rate

    logits = np.random.default_rng(0).normal(0.0, 2.0, 10_000)
    mean_p = lambda b: float(np.mean(1.0 / (1.0 + np.exp(-(logits + b)))))  # noqa: E731
    for rate in (0.03, 0.25, 0.7):
        assert mean_p(bias_for_rate(mean_p, rate)) == pytest.approx(rate, abs=1e-12)
    assert mean_p(bias_for_rate(mean_p, 0.25, steps=40)) == pytest.approx(0.25, abs=1e-9)


def test_a_meta_model_is_drawn_from_nothing_and_a_real_one_as_seeded() -> None:
    """The run plan and the preview build their model on the meta device, shapes only:
    there no dense table or layer is initialised (torch's ``normal_`` on a meta tensor
    imports Dynamo and sympy, a second or more of ``comera launch``; DLRM's pair indices
    are made on the CPU); on the CPU a table is torch's ``nn.Embedding``, drawn from the
    seed as torch draws it."""
    from tests.run_checks import heavy_imports

    assert heavy_imports(
        "import torch\n"
        "from types import SimpleNamespace as NS\n"
        "from comera_engine.config import ModelConfig\n"
        "from comera_engine.models import build_model\n"
        "nli = NS(name='f', task='nli', num_classes=3, vocab_size=300, seq_len=16,"
        " meta={'pad_id': 0})\n"
        "ctr = NS(name='f', task='ctr', num_classes=2, vocab_size=None, seq_len=None,"
        " meta={'num_dense': 3, 'bucket_sizes': [500, 40, 300, 7]})\n"
        "with torch.device('meta'):\n"
        "    for model, data in (('transformer_cls', nli), ('dlrm', ctr)):\n"
        "        for dense in (False, True):\n"
        "            m = build_model(ModelConfig(name=model, preset='tiny', dense=dense),"
        " data)\n"
        "            assert all(p.is_meta for p in m.parameters())") == []
    from comera_engine.models.common import embedding

    torch.manual_seed(5)
    ours = embedding(300, 16, padding_idx=0)
    torch.manual_seed(5)
    torch_s = nn.Embedding(300, 16, padding_idx=0)
    assert torch.equal(ours.weight, torch_s.weight) and ours.padding_idx == 0
