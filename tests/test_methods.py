"""The peer methods (docs/METHODS.md): fixed-rank TT of a target size, TT-SVD of a trained
dense model, tltorch's TT layers and the GaLore optimizer, each against an independent
reference (parameter counts from the shapes, float64 products, tensorly's own
reconstruction, the optimizer state's shapes)."""

from __future__ import annotations

import math
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from comera_engine.config import config_from_dict
from comera_engine.errors import ConfigError
from comera_engine.metrics import JSONLSink, NullSink, read_jsonl
from comera_engine.models import build_model
from comera_engine.preview import data_shape
from comera_engine.runplan import plan_initial_ranks
from comera_engine.train.loop import train
from comera_engine.train.methods import build_run_model, galore_optimizer, init_from_dense

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def digits(**over: Any) -> dict[str, Any]:
    """A digits TT-MLP config dict; ``over``: ``{"section.key": value}`` overrides."""
    raw: dict[str, Any] = {
        "name": "digits-methods",
        "model": {"name": "tt_mlp", "preset": "tiny", "tt_layers": ["hidden"]},
        "data": {"name": "digits"},
        "comera": {"target_compression": 10.0, "target_scope": "tensorized", "lr_cores": 3e-3,
                   "lr_gates": 1e-2, "lr_dense": 3e-3, "weight_decay": 0.0},
        "train": {"steps": 120, "batch_size": 64, "eval_every": 60, "ckpt_every": 0},
    }
    for key, value in over.items():
        section, name = key.split(".")
        raw[section][name] = value
    return raw


def snli_tiny(**over: Any) -> dict[str, Any]:
    raw = {"name": "snli", "model": {"name": "transformer_cls", "preset": "tiny",
                                     "tt_layers": ["embedding", "attention", "ffn"]},
           "data": {"name": "snli", "path": "x.jsonl", "seq_len": 32, "vocab_size": 3000},
           "comera": {"target_compression": 10.0, "target_scope": "tensorized"}}
    for key, value in over.items():
        section, name = key.split(".")
        raw[section][name] = value
    return raw


def run(raw: dict[str, Any], folder: Path, sink: Any = None) -> Any:
    cfg = config_from_dict(raw)
    cfg.base_dir = str(ROOT)
    folder.mkdir(parents=True, exist_ok=True)
    return train(cfg, folder, sink or NullSink(), stop_flag=threading.Event(), progress=False)


def planned_model(raw: dict[str, Any]) -> tuple[nn.Module, Any]:
    """The run's model (at the planned ranks) on a shape-only dataset description."""
    cfg = config_from_dict(raw)
    shape = data_shape(cfg.data)
    cfg, plan = plan_initial_ranks(cfg, shape)
    return build_run_model(cfg, shape, plan), plan


def counted_sizes(model: nn.Module) -> tuple[int, int]:
    """``(dense, compressed)`` parameters of the tensorized layers, counted from the
    modules' tensors and their nominal shapes (not through the engine's size code)."""
    from comera_engine.layers import PEER_LAYERS, TT_LAYERS

    dense = comp = 0
    for m in model.modules():
        if isinstance(m, (*TT_LAYERS, *PEER_LAYERS)):
            bias = m.bias.numel() if getattr(m, "bias", None) is not None else 0
            if hasattr(m, "in_features"):
                dense += m.in_features * m.out_features + bias
            else:
                dense += m.num_embeddings * m.embedding_dim
            tensors = list(m.tt.cores) if hasattr(m, "tt") else m.factors()
            comp += sum(t.numel() for t in tensors) + bias
    return dense, comp


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize("over, field", [
    ({"comera.method": "svd"}, "comera.method"),
    ({"model.tt_impl": "tensorly"}, "model.tt_impl"),
    ({"model.tt_impl": "tltorch"}, "comera.method"),  # gates: needs method "fixed"
    ({"comera.method": "tt_svd"}, "model.init_from"),  # nothing to decompose
    ({"comera.method": "tt_svd", "model.init_from": "runs/x", "model.tt_impl": "tltorch"},
     "model.tt_impl"),  # TT-SVD fills the engine's layers
    ({"model.init_from": "runs/x"}, "model.init_from"),  # only for tt_svd
    ({"train.steps": 0}, "train.steps"),  # evaluate-only needs init_from
    ({"train.optimizer": "galore"}, "train.optimizer"),  # GaLore: the dense model
    ({"train.optimizer": "sgd"}, "train.optimizer"),
    ({"model.dense": True, "train.optimizer": "galore", "train.galore_rank": 0},
     "train.galore_rank"),
    ({"model.dense": True, "train.optimizer": "galore", "train.galore_scale": 0},
     "train.galore_scale"),
])
def test_method_switches_are_validated_naming_the_field(over: dict, field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        config_from_dict(digits(**over))
    assert exc.value.field == field and "\n" not in str(exc.value)


# ------------------------------------------------------------------------------ fixed ranks


@pytest.mark.parametrize("target", [5.0, 10.0, 30.0, 100.0])
@pytest.mark.parametrize("which", ["digits", "snli_tiny", "snli_small"])
def test_fixed_ranks_meet_the_target_size(which: str, target: float) -> None:
    raw = {"digits": digits, "snli_tiny": snli_tiny, "snli_small": snli_tiny}[which](
        **{"comera.method": "fixed", "comera.target_compression": target})
    if which == "snli_small":
        raw["model"]["preset"] = "small"
    with torch.device("meta"):
        model, plan = planned_model(raw)
    dense, comp = counted_sizes(model)
    reached = dense / comp
    assert 1.0 <= reached / target <= 1.10, (reached, plan.note)
    assert plan.start == comp and plan.bond_ranks is not None
    gates = [g for n, g in model.named_parameters() if n.endswith(".tt.gate")]
    assert gates and not any(g.requires_grad for g in gates)


def test_fixed_ranks_are_useful_and_follow_the_plan() -> None:
    """Every bond within its useful cap (no rank a TT-SVD could not fill), and the plan's
    ranks are the model's."""
    from comera_engine.layers import factorized_layers
    from comera_engine.rank.target import bond_caps

    with torch.device("meta"):
        model, plan = planned_model(snli_tiny(**{"comera.method": "fixed",
                                                 "comera.target_compression": 30.0}))
    layers = [m for _, m in factorized_layers(model)]
    for layer, ranks in zip(layers, plan.bond_ranks):
        assert list(layer.tt.ranks[1:-1]) == list(ranks)
        assert all(r <= c for r, c in zip(ranks, bond_caps(tuple(layer.tt.mode_sizes),
                                                            tuple(ranks))))


def test_fixed_run_trains_gate_free_and_logs_its_size(tmp_path: Path) -> None:
    sink = JSONLSink(tmp_path / "m.jsonl")
    res = run(digits(**{"comera.method": "fixed"}), tmp_path / "run", sink)
    sink.close()
    m = res.metrics
    assert res.status == "finished" and m["eval/acc"] > 0.85
    assert 1.0 <= m["compression/tensorized"] / 10.0 <= 1.10
    assert m["compression/target_met"] == 1.0 and "stage" not in m
    assert not any(k.startswith("lr/gates") for k in m)  # frozen gates: not optimised
    ranks = [r for r in read_jsonl(tmp_path / "m.jsonl") if r["type"] == "ranks"]
    assert ranks and all(r["ranks"] == ranks[0]["ranks"] for r in ranks)  # never pruned


# ------------------------------------------------------------------------------ TT-SVD


def _dense_and_tt(raw: dict[str, Any], rank: int) -> tuple[nn.Module, nn.Module, Any]:
    cfg = config_from_dict(raw)
    shape = data_shape(cfg.data)
    torch.manual_seed(0)
    dense = build_model(cfg.model, shape, dense=True).double()
    with torch.no_grad():  # a "trained" dense model: every weight random, biases too
        for p in dense.parameters():
            p.normal_(0.0, 0.3)
        for m in dense.modules():  # as training keeps it: the padding row stays zero
            if isinstance(m, nn.Embedding) and m.padding_idx is not None:
                m.weight[m.padding_idx] = 0.0
    import dataclasses

    tt = build_model(dataclasses.replace(cfg.model, rank=rank, embedding_rank=rank
                                         if cfg.model.name != "tt_mlp" else None),
                     shape).double()
    init_from_dense(tt, dense)
    return dense.eval(), tt.eval(), shape


@pytest.mark.parametrize("which", ["digits", "snli"])
def test_tt_svd_at_full_rank_reproduces_the_dense_model_in_float64(which: str) -> None:
    """Full ranks: the TT model computes the dense model's outputs (float64, every TT
    layer decomposed, every other tensor copied). Lower ranks: the decomposed weights
    drift further from the dense ones as the rank falls."""
    from comera_engine.layers import tt_layers

    raw = digits() if which == "digits" else snli_tiny()
    out_err, weight_err = [], []
    for rank in (10_000, 16, 8, 4, 2, 1):  # 10_000: every bond at its full TT rank
        dense, tt, shape = _dense_and_tt(raw, rank)
        g = torch.Generator().manual_seed(1)
        if which == "digits":
            args = (torch.rand(16, 64, generator=g, dtype=torch.float64),)
        else:
            ids = torch.randint(1, shape.vocab_size, (4, 12), generator=g)
            args = (ids, torch.zeros_like(ids), torch.ones_like(ids))
        with torch.no_grad():
            ref, out = dense(*args), tt(*args)
            out_err.append(float((out - ref).norm() / ref.norm()))
            mods = dict(dense.named_modules())
            parts = [(layer.dense_weight(), mods[name].weight) for name, layer in tt_layers(tt)]
            weight_err.append(sum(float((a - b).norm() ** 2) for a, b in parts) ** 0.5
                              / sum(float(b.norm() ** 2) for _, b in parts) ** 0.5)
    assert out_err[0] < 1e-10 and weight_err[0] < 1e-10, (out_err, weight_err)
    assert min(out_err[1:]) > 1e-3
    assert all(a < b for a, b in zip(weight_err, weight_err[1:])), weight_err


def test_tt_svd_run_evaluates_at_step_0_and_fine_tunes(tmp_path: Path) -> None:
    dense = run(digits(**{"model.dense": True, "train.steps": 100}), tmp_path / "dense")
    # full ranks, no training: the dense model's numbers (float32 rounding apart)
    sink = JSONLSink(tmp_path / "svd.jsonl")
    full = run(digits(**{"comera.method": "tt_svd", "model.init_from": str(tmp_path / "dense"),
                         "comera.target_compression": None, "model.rank": 10_000,
                         "train.steps": 0}), tmp_path / "svd_full", sink)
    sink.close()
    assert full.status == "finished" and full.step == 0 and full.checkpoint
    assert full.metrics["eval/acc"] == pytest.approx(dense.metrics["eval/acc"], abs=1e-9)
    assert full.metrics["eval/loss"] == pytest.approx(dense.metrics["eval/loss"], rel=1e-4)
    rows = [r for r in read_jsonl(tmp_path / "svd.jsonl")
            if r["type"] == "metrics" and "eval/acc" in r["values"]]
    assert len(rows) == 1 and rows[0]["step"] == 0
    # at the 10x target: worse before fine-tuning, better after a few steps
    at10 = digits(**{"comera.method": "tt_svd", "model.init_from": str(tmp_path / "dense"),
                     "train.steps": 0})
    before = run(at10, tmp_path / "svd10")
    after = run(at10 | {"train": {**at10["train"], "steps": 60}}, tmp_path / "svd10ft")
    for res in (before, after):
        assert 1.0 <= res.metrics["compression/tensorized"] / 10.0 <= 1.10
    assert before.metrics["eval/loss"] > dense.metrics["eval/loss"]
    assert after.metrics["eval/loss"] < before.metrics["eval/loss"]


def test_tt_svd_refuses_a_tt_run_or_a_missing_folder(tmp_path: Path) -> None:
    run(digits(**{"train.steps": 5, "comera.target_compression": None}), tmp_path / "tt")
    for source, words in ((tmp_path / "tt", "TT run"), (tmp_path / "nope", "not found")):
        with pytest.raises(ConfigError) as exc:
            run(digits(**{"comera.method": "tt_svd", "model.init_from": str(source),
                          "train.steps": 0}), tmp_path / "svd")
        assert exc.value.field == "model.init_from" and words in str(exc.value)


# ------------------------------------------------------------------------------ tltorch


def _tl_dense(factors: list[torch.Tensor]) -> torch.Tensor:
    """tensorly's own TT-matrix reconstruction ``(∏ rows, ∏ cols)``."""
    import tensorly as tl
    from tensorly.tt_matrix import tt_matrix_to_tensor

    with tl.backend_context("pytorch"):
        t = tt_matrix_to_tensor([f.detach() for f in factors])
    rows = math.prod(f.shape[1] for f in factors)
    return t.reshape(rows, -1)


def test_tltorch_linear_and_embedding_equal_their_dense_matrices() -> None:
    pytest.importorskip("tltorch")
    from comera_engine.layers import TLTorchEmbedding, TLTorchLinear

    torch.manual_seed(0)
    lin = TLTorchLinear(60, 96, rank=[3, 5], in_factors=[4, 4, 4], out_factors=[4, 4, 6],
                        dtype=torch.float64)  # 60 inputs padded to 64
    x = torch.randn(2, 5, 60, dtype=torch.float64)
    W = _tl_dense(lin.factors())  # (96, 64): outputs x padded inputs
    ref = x @ W[:, :60].t() + lin.bias
    assert torch.allclose(lin(x), ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(lin.dense_weight(), W[:, :60])
    assert lin.num_params() == 1 * 16 * 3 + 3 * 16 * 5 + 5 * 24 * 1 + 96

    emb = TLTorchEmbedding(50, 8, rank=4, padding_idx=0, vocab_factors=[4, 4, 4],
                           dim_factors=[2, 2, 2], dtype=torch.float64)
    ids = torch.tensor([[0, 3, 49], [7, 7, 1]])
    E = _tl_dense(emb.factors())[:50]
    ref = E[ids] * (ids != 0).unsqueeze(-1)
    assert torch.allclose(emb(ids), ref, rtol=1e-12, atol=1e-12)
    # the initial distribution of the engine's layers: nn.Linear's weight variance
    big = TLTorchLinear(256, 256, rank=8)
    assert big.dense_weight().var().item() == pytest.approx(1 / (3 * 256), rel=0.2)


def test_tltorch_digits_run_trains_at_the_target(tmp_path: Path) -> None:
    pytest.importorskip("tltorch")
    res = run(digits(**{"model.tt_impl": "tltorch", "comera.method": "fixed"}), tmp_path)
    m = res.metrics
    assert res.status == "finished" and m["eval/acc"] > 0.85
    assert 1.0 <= m["compression/tensorized"] / 10.0 <= 1.10
    assert m["lr/cores"] == 3e-3  # tltorch cores learn at lr_cores


def test_tltorch_transformer_builds_at_the_target() -> None:
    pytest.importorskip("tltorch")
    from comera_engine.layers import TLTorchEmbedding, TLTorchLinear

    model, _ = planned_model(snli_tiny(**{"model.tt_impl": "tltorch",
                                          "comera.method": "fixed"}))
    kinds = {type(m) for m in model.modules()}
    assert {TLTorchLinear, TLTorchEmbedding} <= kinds
    dense, comp = counted_sizes(model)
    assert 1.0 <= dense / comp / 10.0 <= 1.10
    ids = torch.randint(1, 3000, (2, 32))
    logits = model(ids, torch.zeros_like(ids), torch.ones_like(ids))
    logits.sum().backward()
    assert logits.shape == (2, 3)


def test_tltorch_embedding_cores_take_lr_embedding() -> None:
    """The peer's embedding factors join the ``embedding`` group as the engine's cores
    do, so a comparison at a given ``lr_embedding`` is like for like."""
    pytest.importorskip("tltorch")
    from comera_engine.config import CoMERAConfig
    from comera_engine.layers import TLTorchEmbedding, TLTorchLinear
    from comera_engine.rank import CoMERA

    model, _ = planned_model(snli_tiny(**{"model.tt_impl": "tltorch",
                                          "comera.method": "fixed"}))
    cfg = CoMERAConfig(method="fixed", lr_cores=1e-4, lr_embedding=3e-3, lr_dense=1e-3)
    groups = {g["name"]: g for g in CoMERA(model, config=cfg).make_optimizer().param_groups}
    emb = [f for m in model.modules() if isinstance(m, TLTorchEmbedding) for f in m.factors()]
    lin = [f for m in model.modules() if isinstance(m, TLTorchLinear) for f in m.factors()]
    assert {id(p) for p in groups["embedding"]["params"]} == {id(p) for p in emb}
    assert {id(p) for p in groups["cores"]["params"]} == {id(p) for p in lin}
    assert (groups["embedding"]["lr"], groups["cores"]["lr"]) == (3e-3, 1e-4)


def test_missing_tltorch_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tltorch", None)  # import fails
    with pytest.raises(ConfigError) as exc:
        planned_model(digits(**{"model.tt_impl": "tltorch", "comera.method": "fixed"}))
    assert exc.value.field == "model.tt_impl" and "pip install" in str(exc.value)


def test_tt_svd_still_works_after_tltorch_switched_tensorlys_backend() -> None:
    pytest.importorskip("tltorch")
    import numpy as np

    from comera_engine.tensor.tt import tt_svd

    a = np.random.default_rng(0).standard_normal((3, 4, 5))
    cores = tt_svd(a)
    full = np.einsum("aib,bjc,ckd->ijk", *cores)
    assert np.allclose(full, a)


# ------------------------------------------------------------------------------ GaLore


def test_galore_state_is_low_rank_and_a_dense_run_trains(tmp_path: Path) -> None:
    pytest.importorskip("galore_torch")
    raw = digits(**{"model.dense": True, "train.optimizer": "galore", "train.galore_rank": 16,
                    "train.galore_update_proj_gap": 50, "train.steps": 150})
    sink = JSONLSink(tmp_path / "m.jsonl")
    res = run(raw, tmp_path / "run", sink)
    sink.close()
    losses = [r["values"]["loss/task"] for r in read_jsonl(tmp_path / "m.jsonl")
              if r["type"] == "metrics" and "loss/task" in r["values"]]
    assert res.status == "finished"
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10
    assert res.metrics["eval/acc"] > 0.85

    # the optimizer's state (GaLore's "std" projection: a weight (m, n) with m >= n keeps
    # moments (m, r) and a projection (r, n)): a 256x256 weight keeps (256, 16) moments,
    # not (256, 256); the 10x256 classifier is plain AdamW
    cfg = config_from_dict(raw)
    model = build_model(cfg.model, data_shape(cfg.data))
    opt = galore_optimizer(model, cfg)
    x = torch.rand(8, 64)
    nn.functional.cross_entropy(model(x), torch.randint(0, 10, (8,))).backward()
    opt.step()
    for weight, (m, n) in ((model.body[3].weight, (256, 256)), (model.body[0].weight, (256, 64))):
        state = opt.state[weight]
        assert weight.shape == (m, n)
        assert state["exp_avg"].shape == state["exp_avg_sq"].shape == (m, 16)
        assert state["projector"].ortho_matrix.shape == (16, n)
    assert opt.state[model.out.weight]["exp_avg"].shape == (10, 256)
    assert {g["name"] for g in opt.param_groups} == {"galore", "dense"}


def test_galore_run_resumes_identically(tmp_path: Path) -> None:
    """The projector lives in the checkpoint as a matrix: a resumed run continues with the
    same projections and moments."""
    pytest.importorskip("galore_torch")
    raw = digits(**{"model.dense": True, "train.optimizer": "galore", "train.galore_rank": 16,
                    "train.galore_update_proj_gap": 7, "train.steps": 30})
    raw["train"].update(ckpt_every=12, eval_every=30)
    straight = run(raw, tmp_path / "a")
    stop = run(raw | {"train": {**raw["train"], "steps": 12}}, tmp_path / "b")
    assert stop.status == "finished"
    cfg = config_from_dict(raw)
    cfg.base_dir = str(ROOT)
    resumed = train(cfg, tmp_path / "b", NullSink(), resume=True,
                    stop_flag=threading.Event(), progress=False)
    assert resumed.step == 30
    assert resumed.metrics["eval/loss"] == pytest.approx(straight.metrics["eval/loss"],
                                                         rel=1e-6)
