"""``TTLinear(layout="ttm")`` / ``model.linear_layout = "ttm"``: TT-matrix cores for TT
linears, checked against references written here (float64 einsums of the cores, sizes
counted by hand), through training, truncation, resume, export and the config checks."""

from __future__ import annotations

import json
import math
import string
from pathlib import Path

import pytest
import torch
from torch import nn

from comera_engine.cli import main
from comera_engine.config import config_from_dict
from comera_engine.errors import ConfigError
from comera_engine.layers import TTLinear, size_report, tensorize_layers, truncate, tt_layers
from tests.test_train import digits_cfg, metric_rows
from tests.test_train import run as train_run

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "experiments" / "configs" / "digits_tt_mlp.toml"


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def reference_weight(cores: list[torch.Tensor], gates: list[torch.Tensor],
                     masks: list[torch.Tensor], in_features: int, out_features: int
                     ) -> torch.Tensor:
    """``W`` ``(in, out)`` from TT-matrix cores ``(r, n_k, m_k, r')`` by one einsum, each
    gate (zeroed where masked) scaling its bond; then the padding cut off."""
    d = len(cores)
    letters = iter(string.ascii_letters)
    bonds = [next(letters) for _ in range(d + 1)]
    rows = [next(letters) for _ in range(d)]
    cols = [next(letters) for _ in range(d)]
    terms = [f"{bonds[k]}{rows[k]}{cols[k]}{bonds[k + 1]}" for k in range(d)]
    terms += [bonds[k + 1] for k in range(d - 1)]
    expr = ",".join(terms) + "->" + bonds[0] + "".join(rows) + "".join(cols) + bonds[d]
    ops = list(cores) + [g * m.to(g.dtype) for g, m in zip(gates, masks)]
    full = torch.einsum(expr, *ops)
    N = math.prod(c.shape[1] for c in cores)
    M = math.prod(c.shape[2] for c in cores)
    return full.reshape(N, M)[:in_features, :out_features]


@pytest.mark.parametrize("shape, fin, fout, rank", [
    ((37, 20), [4, 10], [3, 7], [5]),  # both sides padded (40 x 21)
    ((30, 24), [2, 3, 5], [2, 3, 4], [3, 4]),
])
def test_ttm_forward_and_gradients_equal_a_float64_reference_with_dead_gates(
        shape, fin, fout, rank) -> None:
    torch.manual_seed(0)
    layer = TTLinear(*shape, rank=rank, in_factors=fin, out_factors=fout, layout="ttm",
                     dtype=torch.float64)
    assert [tuple(c.shape[1:3]) for c in layer.tt.cores] == list(zip(fin, fout))
    with torch.no_grad():  # non-trivial gates; two entries dead (one pruned, one <= tau)
        for g in layer.tt.gates:
            g.uniform_(0.5, 1.5)
        layer.tt.gates[0][1] = 0.005
        layer.tt.bond_alive()[len(rank) - 1][0] = False
    x = torch.randn(6, shape[0], dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, shape[1], dtype=torch.float64)
    (layer(x) * w).sum().backward()

    cores = [c.detach().clone().requires_grad_() for c in layer.tt.cores]
    gates = [g.detach().clone().requires_grad_() for g in layer.tt.gates]
    masks = [(g.abs() > layer.tt.tau) & layer.tt.bond_alive()[k] for k, g in enumerate(gates)]
    bias = layer.bias.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    W = reference_weight(cores, gates, masks, *shape)
    yr = xr @ W + bias
    (yr * w).sum().backward()

    with torch.no_grad():
        assert torch.allclose(layer(x), yr, atol=1e-12)
        assert torch.allclose(layer.dense_weight(), W.t(), atol=1e-12)
    assert torch.allclose(x.grad, xr.grad, atol=1e-12)
    assert torch.allclose(layer.bias.grad, bias.grad, atol=1e-12)
    for a, b in zip(layer.tt.cores, cores):
        assert torch.allclose(a.grad, b.grad, atol=1e-12)
    for k, (a, b) in enumerate(zip(layer.tt.gate.grad.split(layer.tt.bond_ranks), gates)):
        assert torch.allclose(a * masks[k], b.grad * masks[k], atol=1e-12)
        assert (a[~masks[k]] == 0).all()  # dead entries get no gradient
    # a dead entry acts as a removed rank: its core slices receive exactly zero
    assert (layer.tt.cores[0].grad[..., 1] == 0).all()
    assert (layer.tt.cores[1].grad[1] == 0).all()
    dead = [2, 0] if len(rank) == 1 else [1, 1]  # entries per bond that are off
    assert layer.effective_ranks() == [r - n for r, n in zip(rank, dead)]


def test_ttm_init_has_nn_linear_variance_and_tt_svd_round_trips() -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        var = torch.stack([TTLinear(784, 256, rank=8, layout="ttm").dense_weight().var()
                           for _ in range(4)]).mean()
    assert 0.6 < float(var) * 3 * 784 < 1.6
    lin = nn.Linear(37, 20).double()
    full = TTLinear.from_linear(lin, layout="ttm", in_factors=[4, 10], out_factors=[3, 7])
    assert full.layout == "ttm" and full.tt.cores[0].dim() == 4
    assert torch.allclose(full.dense_weight(), lin.weight, atol=1e-10)
    low = TTLinear.from_linear(lin, rank=2, layout="ttm", in_factors=[4, 10],
                               out_factors=[3, 7])
    assert low.tt.ranks == [1, 2, 1]
    with pytest.raises(ValueError, match="layout"):
        TTLinear(8, 8, layout="blocktt")
    with pytest.raises(ValueError, match="path"):
        TTLinear(8, 8, layout="ttm", path="halves")


def test_ttm_size_truncation_and_planner_against_a_hand_count() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(37, 20), nn.ReLU(), nn.Linear(20, 5))
    rows = tensorize_layers(model, rank=6, include=["0"], d=2, layout="ttm")
    layer = model[0]
    assert isinstance(layer, TTLinear) and layer.layout == "ttm" and rows[0]["replaced"]
    (n1, n2), (m1, m2) = layer.in_factors, layer.out_factors
    r = layer.tt.ranks[1]
    cores = n1 * m1 * r + r * n2 * m2
    rep = size_report(model)
    assert rep["tensorized"]["dense_params"] == 37 * 20 + 20
    assert rep["tensorized"]["allocated_params"] == cores + 20
    assert rep["tensorized"]["compression"] == pytest.approx((37 * 20 + 20) / (cores + 20))
    assert rep["model"]["effective_params"] == cores + 20 + 20 * 5 + 5
    with torch.no_grad():  # prune two entries of the bond: effective size drops
        layer.tt.gates[0][:2] = 0.0
    assert size_report(model)["tensorized"]["effective_params"] == (
        n1 * m1 * (r - 2) + (r - 2) * n2 * m2 + 20)
    x = torch.randn(5, 37)
    before = model(x)
    assert truncate(model) == {"0": [(0, r, r - 2)]}
    assert layer.tt.cores[0].shape == (1, n1, m1, r - 2)
    assert torch.allclose(model(x), before, atol=1e-6)
    info = layer.explain(64)
    # the CPU keeps the reconstructed path; the factorised one (sweep) is costed too
    assert info["path"] == "dense" and list(info["paths"]) == ["dense", "sweep"]
    recon = (n1 * m1) * (r - 2) * (n2 * m2)  # W from the two cores
    assert info["reconstruct_macs"] == recon
    assert info["paths"]["dense"]["macs_fwd"] == recon + 64 * (n1 * n2) * (m1 * m2)


def _digits_ttm(**over) -> dict:
    raw = digits_cfg(train={"steps": 200, "batch_size": 64, "eval_every": 100,
                            "ckpt_every": 100},
                     comera={"target_compression": 30.0})
    raw["model"]["linear_layout"] = "ttm"
    for key, value in over.items():
        section, name = key.split(".")
        raw[section][name] = value
    return raw


def test_preview_reports_the_ttm_dense_path_and_reconstruction() -> None:
    from comera_engine.preview import make_preview

    pv = make_preview(config_from_dict(_digits_ttm()))
    assert pv.layers and all(lay.layout == "ttm" and lay.path == "dense" for lay in pv.layers)
    for lay in pv.layers:
        n, m = lay.shape
        assert lay.tt_macs > n * m  # the dense GEMM plus W's reconstruction per row
        assert lay.tt_params == sum(lay.ranks[k] * s * lay.ranks[k + 1]
                                    for k, s in enumerate(lay.mode_sizes)) + lay.bias
        assert lay.target_path == "dense"


def test_comera_digits_ttm_meets_the_target_resumes_and_exports(tmp_path: Path) -> None:
    from comera_engine.export import export_run, load

    raw = _digits_ttm()
    full, records = train_run(raw, tmp_path / "full")
    assert full.status == "finished"
    assert 0.9 <= full.metrics["compression/tensorized"] / 30.0 <= 1.1
    assert full.metrics["eval/acc"] > 0.8
    # ttm layers were pruned and physically truncated: the checkpoint holds 4-D cores
    meta = json.loads((tmp_path / "full" / "checkpoints" / "step_000200.json").read_text())
    core = next(v for k, v in meta["shapes"].items() if k.endswith("tt.cores.1"))
    assert len(core) == 4
    # stop at 100 (a checkpoint), resume: the same metrics step by step
    part, _ = train_run(raw, tmp_path / "part", stop_at=100)
    assert part.status == "stopped"
    resumed, part_records = train_run(raw, tmp_path / "part", resume=True)
    assert resumed.status == "finished" and resumed.step == 200
    a, b = metric_rows(records), metric_rows(part_records)
    for step in a:
        assert a[step] == b[step], f"step {step}"
    # export: the compressed file reloads with equal outputs, as does ONNX
    from comera_engine.export.run import load_run_model

    trained, _ = load_run_model(tmp_path / "full")
    x = torch.randn(16, 64)
    res = export_run(tmp_path / "full", format="compressed", out=tmp_path / "c.safetensors")
    loaded = load(res.path)
    assert all(m.layout == "ttm" for _, m in tt_layers(loaded))
    with torch.no_grad():
        # the export takes raw pixels (tests/test_export_raw.py); .network takes x as is
        assert (trained(x) - loaded.network(x)).abs().max() <= 1e-6
    pytest.importorskip("onnxruntime")
    res_o = export_run(tmp_path / "full", format="onnx", out=tmp_path / "m.onnx")
    assert res_o.onnx_max_abs_diff is not None and res_o.onnx_max_abs_diff <= 1e-5


def test_fixed_and_tt_svd_build_ttm_layers() -> None:
    from tests.test_methods import counted_sizes, planned_model

    model, _ = planned_model(_digits_ttm(**{"comera.method": "fixed"}))
    layers = [m for _, m in tt_layers(model)]
    assert layers and all(m.layout == "ttm" for m in layers)
    dense, comp = counted_sizes(model)
    assert 1.0 <= dense / comp / 30.0 <= 1.1
    # TT-SVD into TTM cores: at full rank the dense model's outputs (float64)
    from comera_engine.models import build_model
    from comera_engine.preview import data_shape
    from comera_engine.train.methods import init_from_dense

    cfg = config_from_dict(_digits_ttm(**{"model.rank": 10_000}))
    shape = data_shape(cfg.data)
    torch.manual_seed(0)
    dense = build_model(cfg.model, shape, dense=True).double()
    tt = build_model(cfg.model, shape).double()
    init_from_dense(tt, dense)
    x = torch.rand(8, 64, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(tt.eval()(x), dense.eval()(x), atol=1e-10)


def test_tensorized_tree_export_round_trips(tmp_path: Path) -> None:
    from comera_engine.export import export_model, load

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(37, 20), nn.ReLU(), nn.Linear(20, 16))
    tensorize_layers(model, rank=3, d=2, layout="ttm")
    with torch.no_grad():
        model[0].tt.gates[0][0] = 0.0  # a dead entry: sliced out on export
    res = export_model(model, tmp_path / "t.safetensors", "compressed", {})
    loaded = load(res.path)
    x = torch.randn(4, 37)
    with torch.no_grad():
        assert (model(x) - loaded(x)).abs().max() <= 1e-6
    assert loaded[0].layout == "ttm" and loaded[0].tt.ranks == [1, 2, 1]


@pytest.mark.parametrize("over, field", [
    ({"model.linear_layout": "blocktt"}, "model.linear_layout"),
    ({"model.linear_layout": "tt", "model.tt_impl": "tltorch", "comera.method": "fixed"},
     "model.linear_layout"),
])
def test_layout_refusals_name_the_field_in_one_line(over, field, capsys) -> None:
    """A layout that is not one, and the paper's tt layout asked of tltorch's linears
    (TT matrices: "ttm" with tltorch is what they are, and accepted)."""
    raw = digits_cfg()
    for key, value in over.items():
        section, name = key.split(".")
        raw[section][name] = value
    with pytest.raises(ConfigError) as exc:
        config_from_dict(raw)
    assert exc.value.field == field and "\n" not in str(exc.value)
    args = ["train", str(DIGITS), "--no-store", "--no-progress"]
    for key, value in over.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"comera: error: {field}"), err


def test_tltorch_linears_accept_the_ttm_layout_they_have() -> None:
    raw = digits_cfg()
    raw["model"].update(linear_layout="ttm", tt_impl="tltorch")
    raw["comera"]["method"] = "fixed"
    cfg = config_from_dict(raw)
    assert cfg.model.linear_layout == "ttm" and cfg.model.tt_impl == "tltorch"
