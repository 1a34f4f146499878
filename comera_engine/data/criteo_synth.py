"""Criteo-shaped clicks at full table size, from a click model that does not favour
low-rank tables (``data.name = "clicks_criteo"``).

Shape: 13 count fields and 26 categorical fields whose cardinalities are Criteo Kaggle's
(:data:`CRITEO_KAGGLE_CARDINALITIES`, the per-field counts of the DLRM and TT-Rec papers'
Kaggle preprocessing: 33.8 M rows in all, the largest 10.1 M), divided by ``scale`` (at
least 2 rows a field) for smaller machines and tests.

Ids: field ``f`` with ``N_f`` rows draws a popularity rank ``r ∈ {0, …, N_f - 1}`` from
the continuous power law on ``[1, N_f + 1)`` with density ``∝ x^(-a)`` (``a`` =
``zipf_exponent``), ``r = ⌊x⌋ - 1``, by inverse transform; the id is
``(r · m_f + o_f) mod N_f`` with ``m_f`` coprime to ``N_f`` (a bijection: popular ids are
scattered over the table, never the first rows).

Click model (``z`` the 13 standardised log counts, ``i_f`` the ids, ``F = 26``)::

    ℓ(x) = b + σ_id / √F · Σ_f w_f(i_f)
             + σ_pair / √(k · F(F-1)/2) · Σ_{f<g} ⟨v_f(i_f), v_g(i_g)⟩
             + σ_dense / √13 · Σ_j u_j z_j
    p(x) = E_ε[sigmoid(ℓ(x) + σ_noise · ε)],   ε ~ N(0, 1)   (Gauss–Hermite, 40 nodes)
    label ~ Bernoulli(p(x))

``w_f(i)`` ~ N(0, 1) and ``v_f(i)`` ~ N(0, I_k) are independent for every (field, id):
a hash of (world seed, field, id, slot) through splitmix64 and Box–Muller, computed on the
fly, so no per-id table is ever held (10^7 rows cost nothing) and the effects of a table,
as a matrix ``[w | v]`` of ``N_f × (1 + k)``, are i.i.d. Gaussian: full rank, and with TT
ranks as high as the shape allows (no low-rank structure to find). ``ε`` is noise no
feature explains. ``b`` is set so that the mean click rate is ``base_rate`` on a pilot
sample drawn from the world seed.

Seeds: ``seed`` is the world (the effects, ``b``) and the training draw; the eval split
is drawn with ``eval_seed`` from the same world (same population, other examples, a seed
no tuning used). The *Bayes AUC* is the AUC of the true ``p(x)`` on the eval split (exact
by construction: no model can rank the eval examples better in expectation); it is
printed and recorded in the data identity with the Bayes log-loss.

Generation is vectorised and chunked (:data:`CHUNK` rows at a time, each chunk its own
seeded stream), so memory is the output plus one chunk.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from comera_engine.data.base import (
    BaseDir,
    check_keys,
    field_name,
    get_float,
    get_int,
)
from comera_engine.data.clicks import NUM_DENSE, NUM_SPARSE, ClickData, bias_for_rate
from comera_engine.data.registry import dataset_info
from comera_engine.errors import ConfigError
from comera_engine.metrics import log_loss, roc_auc

__all__ = ["CHUNK", "CRITEO_KAGGLE_CARDINALITIES", "CriteoWorld",
           "build_clicks_criteo", "criteo_cardinalities", "generate_criteo", "hash_normal",
           "hash_uniform", "hot_ids", "noisy_sigmoid", "power_law_ranks", "training_hot_ids"]

#: Rows per field of Criteo Kaggle (Display Advertising Challenge) after the DLRM
#: preprocessing, as listed by DLRM (``day_fea_count``) and TT-Rec.
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
    14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
#: Rows generated at a time.
CHUNK = 1 << 16
#: Rows of the pilot sample that sets the bias.
PILOT = 1 << 14
_GH_NODES = 40
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def criteo_cardinalities(scale: float = 1.0) -> list[int]:
    """Criteo Kaggle's 26 cardinalities divided by ``scale`` (rounded up, at least 2; a
    field with fewer rows keeps its own)."""
    if not scale >= 1.0:
        raise ValueError(f"scale: must be >= 1 (it divides the cardinalities), got {scale}")
    return [c if c <= 2 else max(2, math.ceil(c / scale)) for c in CRITEO_KAGGLE_CARDINALITIES]


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _key(world: int, feature: int, slot: int) -> np.uint64:
    """The 64-bit key of (world seed, field, slot)."""
    base = np.array([world & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    k = _splitmix(_splitmix(base) ^ np.uint64(feature * 1_000_003 + 17))
    return _splitmix(k ^ np.uint64(slot * 7_919 + 3))[0]


def hash_uniform(world: int, feature: int, slot: int, ids: np.ndarray) -> np.ndarray:
    """Two uniforms in ``(0, 1)`` per id from one splitmix64 hash of ``key ⊕ id`` (``key``
    from world, field, slot): ``(hi32 + 0.5) / 2^32`` and ``(lo32 + 0.5) / 2^32``; float64
    ``ids.shape + (2,)``."""
    h = _splitmix(np.asarray(ids).astype(np.uint64) ^ _key(world, feature, slot))
    hi = (h >> np.uint64(32)).astype(np.float64)
    lo = (h & np.uint64(0xFFFFFFFF)).astype(np.float64)
    return (np.stack([hi, lo], axis=-1) + 0.5) * 2.0**-32


def hash_normal(world: int, feature: int, ids: np.ndarray, count: int) -> np.ndarray:
    """``count`` standard normals per id, independent for every (world, field, id, index):
    Box–Muller (``r cos θ``, ``r sin θ``) on the uniform pair of slot ``index // 2``;
    float64 ``ids.shape + (count,)``."""
    out = []
    for slot in range((count + 1) // 2):
        u = hash_uniform(world, feature, slot, ids)
        r = np.sqrt(-2.0 * np.log(u[..., 0]))
        theta = 2.0 * np.pi * u[..., 1]
        out += [r * np.cos(theta), r * np.sin(theta)]
    return np.stack(out[:count], axis=-1)


def power_law_ranks(u: np.ndarray, n: int, exponent: float) -> np.ndarray:
    """Ranks ``⌊x⌋ - 1 ∈ {0, …, n-1}`` with ``x`` on ``[1, n + 1)`` of density ``∝ x^(-a)``,
    by inverse transform of uniforms ``u`` (int64, the shape of ``u``)."""
    a = float(exponent)
    top = n + 1.0
    if abs(a - 1.0) < 1e-9:
        x = np.exp(u * math.log(top))
    else:
        x = (1.0 + u * (top ** (1.0 - a) - 1.0)) ** (1.0 / (1.0 - a))
    return np.clip(np.floor(x).astype(np.int64) - 1, 0, n - 1)


def _coprime_multiplier(world: int, feature: int, n: int) -> tuple[int, int]:
    """``(m, o)``: ``m`` coprime to ``n`` (below 2^31) and an offset, from the world."""
    h = int(_splitmix(np.array([_key(world, feature, 999)], dtype=np.uint64))[0])
    m = (h % (2**31 - 1)) | 1
    while math.gcd(m, n) != 1:
        m += 2
    return m, (h >> 33) % n


@dataclass(frozen=True)
class CriteoWorld:
    """The population: cardinalities, id law and click model (see the module docstring).

    ``bias`` is ``b``; :meth:`with_base_rate` sets it from a pilot sample.
    """

    cardinalities: tuple[int, ...]
    world_seed: int = 0
    zipf_exponent: float = 1.1
    interaction_dim: int = 4
    id_signal: float = 1.0
    pair_signal: float = 1.0
    dense_signal: float = 0.5
    noise: float = 0.5
    bias: float = 0.0
    dense_mu: tuple[float, ...] = field(default=())
    dense_sigma: tuple[float, ...] = field(default=())
    dense_weights: tuple[float, ...] = field(default=())

    @classmethod
    def create(cls, cardinalities: Sequence[int], world_seed: int = 0,
               base_rate: float = 0.25, **settings: Any) -> CriteoWorld:
        """A world with its count laws and weights from ``world_seed`` and ``b`` set so
        the mean click probability is ``base_rate`` (on :data:`PILOT` pilot rows)."""
        if len(cardinalities) != NUM_SPARSE or min(cardinalities) < 1:
            raise ValueError(f"cardinalities: need {NUM_SPARSE} positive counts")
        rng = np.random.default_rng([world_seed, 7])
        world = cls(tuple(int(c) for c in cardinalities), int(world_seed),
                    dense_mu=tuple(rng.uniform(0.0, 3.0, NUM_DENSE).tolist()),
                    dense_sigma=tuple(rng.uniform(0.5, 1.5, NUM_DENSE).tolist()),
                    dense_weights=tuple(rng.normal(0.0, 1.0, NUM_DENSE).tolist()),
                    **settings)
        pilot = world.draw(PILOT, seed=world_seed, stream=10**6)
        logits = world.logits(pilot["dense_raw"], pilot["sparse"])
        return world._replace_bias(bias_for_rate(
            lambda b: float(noisy_sigmoid(logits + b, world.noise).mean()), base_rate, steps=40))

    def _replace_bias(self, bias: float) -> CriteoWorld:
        return CriteoWorld(**{**self.__dict__, "bias": float(bias)})

    def id_effects(self, feature: int, ids: np.ndarray) -> np.ndarray:
        """``[w_f(ids), v_f(ids)]``: float64 ``ids.shape + (1 + k,)`` (``w`` first)."""
        return hash_normal(self.world_seed, feature, ids, 1 + self.interaction_dim)

    def draw(self, n: int, seed: int, stream: int = 0) -> dict[str, np.ndarray]:
        """``n`` rows of features: ``sparse`` int64 [n, 26], ``dense_raw`` int64 [n, 13]
        (rows from the random stream ``(seed, stream, chunk)``)."""
        sparse = np.empty((n, NUM_SPARSE), dtype=np.int64)
        dense_raw = np.empty((n, NUM_DENSE), dtype=np.int64)
        for c, start in enumerate(range(0, n, CHUNK)):
            stop = min(n, start + CHUNK)
            rng = np.random.default_rng([seed, stream, c])
            u = rng.random((stop - start, NUM_SPARSE))
            for f, card in enumerate(self.cardinalities):
                m, o = _coprime_multiplier(self.world_seed, f, card)
                ranks = power_law_ranks(u[:, f], card, self.zipf_exponent)
                sparse[start:stop, f] = (ranks * m + o) % card
            g = rng.standard_normal((stop - start, NUM_DENSE))
            dense_raw[start:stop] = np.floor(np.exp(np.asarray(self.dense_mu)
                                                    + np.asarray(self.dense_sigma) * g))
        return {"sparse": sparse, "dense_raw": dense_raw}

    def logits(self, dense_raw: np.ndarray, sparse: np.ndarray) -> np.ndarray:
        """``ℓ(x)`` float64 [n] (chunked)."""
        n = sparse.shape[0]
        out = np.empty(n, dtype=np.float64)
        F, k = NUM_SPARSE, self.interaction_dim
        pairs = F * (F - 1) / 2
        for start in range(0, n, CHUNK):
            ids = sparse[start:start + CHUNK]
            ids_sum = np.zeros(ids.shape[0])
            v_sum = np.zeros((ids.shape[0], k))
            v_sq = np.zeros(ids.shape[0])
            for f in range(F):
                e = self.id_effects(f, ids[:, f])
                ids_sum += e[:, 0]
                v = e[:, 1:]
                v_sum += v
                v_sq += np.einsum("nk,nk->n", v, v)
            pair = 0.5 * (np.einsum("nk,nk->n", v_sum, v_sum) - v_sq)  # Σ_{f<g} <v_f, v_g>
            z = self.standard_counts(dense_raw[start:start + CHUNK])
            out[start:start + CHUNK] = (
                self.bias + self.id_signal / math.sqrt(F) * ids_sum
                + (self.pair_signal / math.sqrt(max(k, 1) * pairs) * pair if k else 0.0)
                + self.dense_signal / math.sqrt(NUM_DENSE) * (z @ np.asarray(self.dense_weights)))
        return out

    def standard_counts(self, dense_raw: np.ndarray) -> np.ndarray:
        """``z_j = (log1p(count_j) - μ_j) / σ_j``: float64 [n, 13]."""
        return (np.log1p(dense_raw) - np.asarray(self.dense_mu)) / np.asarray(self.dense_sigma)

    def probability(self, logits: np.ndarray) -> np.ndarray:
        """``p = E_ε[sigmoid(ℓ + σ_noise ε)]`` by Gauss–Hermite quadrature."""
        return noisy_sigmoid(logits, self.noise)


def noisy_sigmoid(logits: np.ndarray, noise: float) -> np.ndarray:
    """``E[sigmoid(ℓ + noise · ε)]``, ``ε ~ N(0, 1)``, by 40-node Gauss–Hermite."""
    if noise == 0:
        return 1.0 / (1.0 + np.exp(-logits))
    x, w = np.polynomial.hermite.hermgauss(_GH_NODES)
    out = np.zeros_like(logits, dtype=np.float64)
    for xi, wi in zip(x, w):
        out += wi / (1.0 + np.exp(-(logits + noise * math.sqrt(2.0) * xi)))
    return out / math.sqrt(math.pi)


@dataclass
class CriteoSplit:
    """One generated split: tensors, the true probabilities and the raw counts."""

    data: ClickData
    probability: np.ndarray
    dense_raw: np.ndarray


def generate_criteo(world: CriteoWorld, n: int, seed: int, stream: int = 0) -> CriteoSplit:
    """``n`` examples of ``world`` drawn with ``seed``: features, ``p(x)``, labels."""
    if n < 1:
        raise ValueError(f"num_samples: must be >= 1, got {n}")
    rows = world.draw(n, seed, stream)
    p = world.probability(world.logits(rows["dense_raw"], rows["sparse"]))
    rng = np.random.default_rng([seed, stream, 10**9])
    labels = (rng.random(n) < p).astype(np.float32)
    dense = np.log1p(rows["dense_raw"]).astype(np.float32)
    data = ClickData(torch.from_numpy(dense), torch.from_numpy(rows["sparse"]),
                     torch.from_numpy(labels))
    return CriteoSplit(data, p, rows["dense_raw"])


def hot_ids(sparse: np.ndarray, top: int | None = None) -> dict[str, np.ndarray]:
    """Per field ``f<j>``: its ids in ``sparse`` [n, 26] by falling frequency (ties by
    id), the first ``top`` (int64)."""
    out = {}
    for j in range(sparse.shape[1]):
        ids, counts = np.unique(sparse[:, j], return_counts=True)
        order = np.lexsort((ids, -counts))
        out[f"f{j}"] = ids[order][:top].astype(np.int64)
    return out


def training_hot_ids(cfg: Mapping[str, Any], top: int | None = None) -> dict[str, np.ndarray]:
    """:func:`hot_ids` of the training split the ``[data]`` table ``cfg`` generates (the
    ids only: no click is computed)."""
    defaults = dataset_info("clicks_criteo").defaults
    world = _world_from(cfg, defaults)
    n = get_int(cfg, "num_samples", defaults["num_samples"], minimum=2)
    return hot_ids(world.draw(n, world.world_seed, stream=0)["sparse"], top)


# --------------------------------------------------------------------------- builder

_SETTINGS = {  # key -> (low, high) of the float settings, closed
    "zipf_exponent": (0.0, 5.0), "id_signal": (0.0, 100.0), "pair_signal": (0.0, 100.0),
    "dense_signal": (0.0, 100.0), "noise": (0.0, 100.0),
}


def _world_from(cfg: Mapping[str, Any], defaults: Mapping[str, Any]) -> CriteoWorld:
    scale = get_float(cfg, "scale", defaults["scale"], 1.0, 1e9, open_interval=False)
    settings = {k: get_float(cfg, k, defaults[k], lo, hi, open_interval=False)
                for k, (lo, hi) in _SETTINGS.items()}
    settings["interaction_dim"] = get_int(cfg, "interaction_dim", defaults["interaction_dim"])
    rate = get_float(cfg, "base_rate", defaults["base_rate"], 0.0, 1.0)
    return CriteoWorld.create(criteo_cardinalities(scale), get_int(cfg, "seed", defaults["seed"]),
                              base_rate=rate, **settings)


def shape(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The dataset's shapes without generating it (the dashboard preview)."""
    defaults = dataset_info("clicks_criteo").defaults
    scale = float(cfg.get("scale") or defaults["scale"])
    sizes = criteo_cardinalities(scale)
    return {"task": "ctr", "num_classes": 2, "vocab_size": None, "seq_len": None,
            "meta": {"num_dense": NUM_DENSE, "num_sparse": NUM_SPARSE, "bucket_sizes": sizes,
                     "cardinalities": sizes}}


def build_clicks_criteo(cfg: Mapping[str, Any], base_dir: BaseDir = None) -> Any:
    """Generated Criteo-shaped clicks (or, with ``data.path``, a Criteo TSV read with the
    scaled Criteo cardinalities as its bucket counts): the ``clicks`` items."""
    from comera_engine.data.clicks import _click_bundle, _click_meta, build_clicks
    from comera_engine.data.identity import content_sha256, dataset_identity

    defaults = dataset_info("clicks_criteo").defaults
    check_keys(cfg, defaults)
    if cfg.get("path") is not None:  # a real Criteo TSV, the same pipeline as `clicks`
        scale = get_float(cfg, "scale", defaults["scale"], 1.0, 1e9, open_interval=False)
        sizes = criteo_cardinalities(scale)
        keep = {k: cfg[k] for k in ("path", "eval_path", "seed") if cfg.get(k) is not None}
        bundle = build_clicks({**keep, "bucket_sizes": sizes}, base_dir)
        bundle.meta["cardinalities"] = sizes
        return bundle
    world = _world_from(cfg, defaults)
    n_train = get_int(cfg, "num_samples", defaults["num_samples"], minimum=2)
    n_eval = get_int(cfg, "num_eval", defaults["num_eval"], minimum=2)
    seed, eval_seed = world.world_seed, get_int(cfg, "eval_seed", defaults["eval_seed"])
    if eval_seed == seed:
        raise ConfigError(field_name("eval_seed"), "must differ from data.seed (the eval "
                                                   "examples are drawn with their own seed)")
    train = generate_criteo(world, n_train, seed, stream=0)
    ev = generate_criteo(world, n_eval, eval_seed, stream=1)
    labels = ev.data.labels.numpy()
    bayes = {"bayes_auc_eval": roc_auc(ev.probability, labels),
             "bayes_log_loss_eval": log_loss(ev.probability, labels)}
    print(f"clicks_criteo: {n_train:,} train / {n_eval:,} eval rows, "
          f"{sum(world.cardinalities):,} table rows; Bayes AUC on eval "
          f"{bayes['bayes_auc_eval']:.4f}, Bayes log-loss {bayes['bayes_log_loss_eval']:.4f}",
          file=sys.stderr)
    sizes = list(world.cardinalities)
    params = {k: getattr(world, k) for k in ("zipf_exponent", "interaction_dim", "id_signal",
                                              "pair_signal", "dense_signal", "noise")}
    identity = dataset_identity(
        "clicks_criteo", "synthetic", {"train": n_train, "eval": n_eval}, seed,
        params={**params, "cardinalities": sizes, "eval_seed": eval_seed,
                "base_rate": cfg.get("base_rate", defaults["base_rate"]), "bias": world.bias},
        extra={**bayes, "content_sha256": content_sha256(ev.data.sparse, ev.data.labels)})
    meta = _click_meta(sizes, train.data.labels)
    meta["cardinalities"] = sizes
    meta["eval_probability"] = torch.from_numpy(ev.probability)
    meta.update(bayes)
    return _click_bundle("clicks_criteo", train.data, ev.data, identity, meta)
