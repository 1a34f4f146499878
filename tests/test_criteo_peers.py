"""The Criteo-shaped generator (clicks_criteo) and the compressed-embedding peers
(layers/embedding_peers.py), each against an independent reference: Criteo's published
cardinalities, a power-law fit, a per-row hand computation of the click model and
scikit-learn's AUC; torch's SparseAdam, hand-computed hashed / quotient-remainder /
mixed-dimension / int8 lookups. The reproduce task's end-to-end run is in
tests/test_reproduce.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from comera_engine.data import build_dataset
from comera_engine.data.criteo_synth import (
    CRITEO_KAGGLE_CARDINALITIES,
    CriteoWorld,
    criteo_cardinalities,
    hot_ids,
    noisy_sigmoid,
    power_law_ranks,
)
from comera_engine.errors import ConfigError
from comera_engine.layers.embedding_peers import (
    PEER_KINDS,
    HashTable,
    Int8Table,
    MixedDimTable,
    QRTable,
    RowSparseAdam,
    build_peer,
    qr_split,
    quantize_rows,
    tt_rank_for_budget,
)

SCALE = 1000.0


@pytest.fixture(scope="module")
def bundle():
    return build_dataset({"name": "clicks_criteo", "scale": SCALE, "num_samples": 6000,
                          "num_eval": 6000, "seed": 3, "eval_seed": 11})


# ------------------------------------------------------------------------- generator


def test_cardinalities_are_criteo_kaggles_divided_by_scale(bundle) -> None:
    published = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593,
                 3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105,
                 142572]  # DLRM's Criteo Kaggle counts (TT-Rec, table 1)
    assert list(CRITEO_KAGGLE_CARDINALITIES) == published
    assert sum(criteo_cardinalities(1.0)) == 33_762_577
    sizes = [max(2, math.ceil(c / SCALE)) if c > 2 else c for c in published]
    assert bundle.meta["bucket_sizes"] == bundle.meta["cardinalities"] == sizes
    for split in (bundle.train, bundle.eval):
        sparse = split.tensors["sparse"]
        assert sparse.shape[1] == 26 and split.tensors["dense"].shape[1] == 13
        assert (sparse >= 0).all() and (sparse < torch.tensor(sizes)).all()


def test_ids_follow_the_power_law_with_the_configured_exponent() -> None:
    n, a = 10_000_000, 1.3
    ranks = power_law_ranks(np.random.default_rng(0).random(400_000), n, a)
    counts = np.bincount(ranks, minlength=200)[:200].astype(float)
    r = np.arange(200)
    # P(rank r) = ∫_{r+1}^{r+2} x^-a dx ≈ (r + 1.5)^-a: the slope of log count vs log(r+1.5)
    slope = np.polyfit(np.log(r[2:] + 1.5), np.log(counts[2:]), 1)[0]
    assert slope == pytest.approx(-a, abs=0.06)
    # the ids of a world's field: the same law once sorted by frequency (a bijection)
    world = CriteoWorld.create(criteo_cardinalities(100.0), 0, zipf_exponent=a)
    ids = world.draw(100_000, seed=1)["sparse"][:, 2]
    freq = np.sort(np.bincount(ids))[::-1][:100].astype(float)
    slope = np.polyfit(np.log(np.arange(2, 100) + 1.5), np.log(freq[2:]), 1)[0]
    assert slope == pytest.approx(-a, abs=0.12)


def _splitmix(x: int) -> int:
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def _normals_by_hand(world: int, feature: int, i: int, count: int) -> list[float]:
    out = []
    for slot in range((count + 1) // 2):
        key = _splitmix(_splitmix(_splitmix(world) ^ (feature * 1_000_003 + 17))
                        ^ (slot * 7_919 + 3))
        h = _splitmix(i ^ key)
        u1, u2 = ((h >> 32) + 0.5) / 2**32, ((h & 0xFFFFFFFF) + 0.5) / 2**32
        r = math.sqrt(-2 * math.log(u1))
        out += [r * math.cos(2 * math.pi * u2), r * math.sin(2 * math.pi * u2)]
    return out[:count]


def test_click_probability_matches_a_hand_computation_and_bayes_auc_sklearn(bundle) -> None:
    from scipy.integrate import quad
    from sklearn.metrics import log_loss, roc_auc_score

    world = CriteoWorld.create(bundle.meta["cardinalities"], 3)
    ev = bundle.eval.tensors
    sparse, raw = ev["sparse"].numpy(), np.expm1(ev["dense"].numpy().astype(np.float64))
    k, F = world.interaction_dim, 26
    for row in range(5):  # the module docstring's formula, scalar by scalar
        eff = [_normals_by_hand(3, f, int(sparse[row, f]), 1 + k) for f in range(F)]
        ids_sum = sum(e[0] for e in eff)
        pair = sum(sum(a * b for a, b in zip(eff[f][1:], eff[g][1:]))
                   for f in range(F) for g in range(f + 1, F))
        z = (np.log1p(np.round(raw[row])) - np.array(world.dense_mu)) / np.array(
            world.dense_sigma)
        logit = (world.bias + world.id_signal / math.sqrt(F) * ids_sum
                 + world.pair_signal / math.sqrt(k * F * (F - 1) / 2) * pair
                 + world.dense_signal / math.sqrt(13) * float(z @ np.array(world.dense_weights)))
        p = quad(lambda e, lg=logit: math.exp(-e * e / 2) / math.sqrt(2 * math.pi)
                 / (1 + math.exp(-(lg + world.noise * e))), -12, 12)[0]
        assert float(bundle.meta["eval_probability"][row]) == pytest.approx(p, rel=1e-7)
    p = bundle.meta["eval_probability"].numpy()
    labels = ev["labels"].numpy()
    assert bundle.meta["bayes_auc_eval"] == pytest.approx(roc_auc_score(labels, p), abs=1e-12)
    assert bundle.identity["extra"]["bayes_log_loss_eval"] == pytest.approx(
        log_loss(labels, p), rel=1e-9)
    assert 0.6 < bundle.meta["bayes_auc_eval"] < 0.95
    assert abs(labels.mean() - 0.25) < 0.03  # the base rate


def test_per_id_effects_have_no_low_rank_structure() -> None:
    """The effects of 4,096 ids reshaped as a TT unfolding (64 × 64·5) are full rank: no
    TT table smaller than the table holds them exactly."""
    world = CriteoWorld.create(criteo_cardinalities(1.0), 0)
    e = world.id_effects(2, np.arange(4096)).reshape(64, 64 * 5)
    s = np.linalg.svd(e, compute_uv=False)
    assert s[-1] / s[0] > 0.05  # a random Gaussian matrix's spread, not a low-rank one


def test_eval_split_has_its_own_seed_and_the_same_world() -> None:
    a = build_dataset({"name": "clicks_criteo", "scale": 1e5, "num_samples": 500,
                       "num_eval": 500, "eval_seed": 5})
    b = build_dataset({"name": "clicks_criteo", "scale": 1e5, "num_samples": 500,
                       "num_eval": 500, "eval_seed": 6})
    assert torch.equal(a.train.tensors["sparse"], b.train.tensors["sparse"])
    assert not torch.equal(a.eval.tensors["sparse"], b.eval.tensors["sparse"])
    assert a.identity["params"]["bias"] == b.identity["params"]["bias"]
    with pytest.raises(ConfigError, match="data.eval_seed"):
        build_dataset({"name": "clicks_criteo", "scale": 1e5, "num_samples": 50,
                       "num_eval": 50, "eval_seed": 0})


def test_noisy_sigmoid_is_the_gaussian_expectation() -> None:
    from scipy.integrate import quad

    for logit in (-4.0, 0.3, 2.5):
        ref = quad(lambda e, lg=logit: math.exp(-e * e / 2) / math.sqrt(2 * math.pi)
                   / (1 + math.exp(-(lg + 0.8 * e))), -12, 12)[0]
        assert noisy_sigmoid(np.array([logit]), 0.8)[0] == pytest.approx(ref, rel=1e-9)


def test_hot_ids_are_ordered_by_frequency() -> None:
    sparse = np.array([[3, 1], [3, 2], [5, 2], [3, 2], [5, 1], [7, 2]])
    out = hot_ids(sparse, top=2)
    assert out["f0"].tolist() == [3, 5] and out["f1"].tolist() == [2, 1]


# ------------------------------------------------------------------------- peers


def _step(module: nn.Module, ids: torch.Tensor, w: torch.Tensor) -> None:
    (module(ids) * w).sum().backward()


def test_row_sparse_adam_is_torch_sparse_adam() -> None:
    torch.manual_seed(0)
    ref = nn.Embedding(50, 4, sparse=True)
    ours = RowSparseAdam(50, 4, init=ref.weight.detach().clone(), lr=0.05)
    opt = torch.optim.SparseAdam(ref.parameters(), lr=0.05)
    for _ in range(4):
        ids = torch.randint(0, 12, (16,))  # duplicates summed
        w = torch.randn(16, 4)
        opt.zero_grad()
        (ref(ids) * w).sum().backward()
        opt.step()
        (ours.lookup(ids) * w).sum().backward()
    assert torch.allclose(ours.weight, ref.weight, atol=1e-6)
    assert torch.equal(ours.weight[12:], ref.weight[12:])  # rows never seen: untouched


def test_hash_qr_and_mixed_lookups_by_hand() -> None:
    torch.manual_seed(1)
    ids = torch.tensor([0, 7, 99, 12345, 54321, 99999])
    h = HashTable(100_000, 4, rows=97)
    assert torch.equal(h(ids), h.table.weight[ids % 97])
    q = QRTable(100_000, 4, rows=700)
    m, nq = q.m, q.q
    assert m + nq <= 700 and m + 1 + math.ceil(100_000 / (m + 1)) > 700
    with torch.no_grad():
        q.quotient.weight.normal_()
    assert torch.equal(q(ids), q.quotient.weight[ids // m] * q.remainder.weight[ids % m])
    assert qr_split(100_000, 100) == (50, 50)  # below 2√N: the quotient taken mod 50
    hot = torch.tensor([12345, 7, 3])
    md = MixedDimTable(100_000, 8, hot, cold_rows=31, cold_dim=2)
    out = md(ids)
    assert torch.equal(out[1], md.hot.weight[1]) and torch.equal(out[3], md.hot.weight[0])
    for i in (0, 2, 4, 5):
        ref = md.cold.weight[int(ids[i]) % 31] @ md.proj
        assert torch.allclose(out[i], ref, atol=1e-6)


def test_int8_table_stores_rows_within_the_quantisation_bound() -> None:
    torch.manual_seed(2)
    w = torch.randn(20, 6)
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8
    assert ((w - q.float() * s[:, None]).abs() <= s[:, None] / 2 + 1e-7).all()
    t = Int8Table(1000, 6, rows=40, lr=0.1)
    ids = torch.tensor([3, 43, 5, 999])
    before = t.codes.clone()
    _step(t, ids, torch.randn(4, 6))  # QAT step: master updated, rows re-quantised
    touched = torch.unique(ids % 40)
    assert not torch.equal(t.codes[touched], before[touched])
    q2, s2 = quantize_rows(t.master.weight)
    assert torch.equal(t.codes, q2) and torch.allclose(t.scales, s2)
    t.eval()
    assert torch.equal(t(ids), t.codes[ids % 40].float() * t.scales[ids % 40, None])
    assert t.stored_bytes() == 40 * 6 + 40 * 4


@pytest.mark.parametrize("kind", PEER_KINDS)
def test_every_peer_fits_its_budget_and_learns(kind: str) -> None:
    n, d, budget = 20_000, 8, 20_000 * 8 * 4 // 30
    hot = np.arange(0, 20_000, 7)
    peer = build_peer(kind, n, d, None if kind == "dense" else budget, counts=hot, lr=0.05)
    stored = sum(p.numel() * p.element_size() for n_, p in peer.named_parameters()
                 if "gate" not in n_)
    assert stored == peer.stored_bytes()
    assert stored <= (n * d * 4 if kind == "dense" else budget)
    ids = torch.tensor([1, 7, 14, 19_999])
    target = torch.randn(4, d)
    first = ((peer(ids) - target) ** 2).sum().item()
    opt = torch.optim.Adam([p for p in peer.parameters() if p.requires_grad], lr=0.05) \
        if any(p.requires_grad for p in peer.parameters()) else None
    for _ in range(30):
        loss = ((peer(ids) - target) ** 2).sum()
        if opt:
            opt.zero_grad()
        loss.backward()
        if opt:
            opt.step()
    assert ((peer(ids) - target) ** 2).sum().item() < 0.5 * first


def test_tt_rank_is_the_largest_within_the_budget() -> None:
    from comera_engine.layers import TTEmbedding

    budget = 20_000 * 16 * 4 // 50
    r = tt_rank_for_budget(20_000, 16, budget)
    assert TTEmbedding(20_000, 16, rank=r).num_params() * 4 <= budget
    assert TTEmbedding(20_000, 16, rank=r + 1).num_params() * 4 > budget


def test_peer_dlrm_builds_peer_tables_above_min_rows() -> None:
    from comera_engine.models.dlrm import peer_dlrm

    sizes = criteo_cardinalities(SCALE)
    model = peer_dlrm(sizes, peer="qr", target=10.0)
    kinds = [type(t).__name__ for t in model.tables]
    assert kinds == ["QRTable" if n >= 200 else "Embedding" for n in sizes]
    dense, sparse = torch.randn(5, 13), torch.stack(
        [torch.randint(0, n, (5,)) for n in sizes], dim=1)
    assert model(dense, sparse).shape == (5,)


@pytest.mark.parametrize("kind", ["hash", "qr", "mixed", "int8", "dense"])
def test_peer_models_report_their_compression_against_dense_tables(kind: str) -> None:
    """A peer model's size metrics (what the runs list, Sweeps and Compare show) are
    measured against the same DLRM with dense fp32 tables, built independently."""
    from comera_engine.metrics import run_compression
    from comera_engine.models.dlrm import peer_dlrm
    from comera_engine.rank.report import size_metrics

    sizes = criteo_cardinalities(SCALE)
    torch.manual_seed(0)
    model = peer_dlrm(sizes, peer=kind, target=None if kind == "dense" else 10.0)
    reference = peer_dlrm(sizes, peer="dense", target=None)
    dense_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    own_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    big = [(t, n) for t, n in zip(model.tables, sizes) if not isinstance(t, nn.Embedding)]
    table_bytes = sum(p.numel() * p.element_size() for t, _ in big for p in t.parameters())
    table_dense = sum(n * 16 * 4 for _, n in big)  # the tiny preset's width 16, fp32
    assert {t.embedding_dim for t, _ in big} == {16}

    m = size_metrics(model, factorized=False)
    assert m["bytes/dense"] == dense_bytes
    assert m["bytes/effective"] == own_bytes
    assert m["compression/model"] == pytest.approx(dense_bytes / own_bytes)
    assert m["compression/tensorized"] == pytest.approx(table_dense / table_bytes)
    config = {"model": {"name": "custom", "dense": True, "kwargs": {"peer": kind}},
              "comera": {}}
    shown = run_compression(config, m).value
    if kind == "dense":
        assert shown == pytest.approx(1.0)
    else:  # each table at most a tenth of its dense bytes, whole rows: within 5 %
        assert shown == pytest.approx(10.0, rel=0.05)
    # before a run logs its sizes: the dense baseline is 1x, a peer model not known yet
    peer = {"model": {"name": "custom", "dense": True, "kwargs": {"peer": kind}}}
    assert run_compression(peer, {}).value == (1.0 if kind == "dense" else None)
