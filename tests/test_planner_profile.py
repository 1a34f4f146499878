"""The planner's choice from a device profile and from the calibrated roofline fallback:
measured cases pick the fastest measured path, nearby cases the nearest measurement
scaled by the model, other shapes the model calibrated on the profile; a GPU without a
profile gets its datasheet peaks at the efficiencies fitted on the profiles there are;
the calibration recovers a device it was generated from; ``COMERA_PATHS`` restricts the
choice to a family; a graphed step plans for the graph."""

from __future__ import annotations

import json

import pytest
import torch

from comera_engine.layers import TTLinear
from comera_engine.tensor import planner
from comera_engine.tensor.costs import DEVICE_MODELS, Case, case_costs, path_seconds
from comera_engine.tensor.profile import (
    DEFAULT_FIT,
    DeviceProfile,
    Measurement,
    calibrate,
    fallback_model,
    model_from_fit,
)
from comera_engine.tensor.roofline import GPU_SPECS, spec_for_name

INS, OUTS = (12, 8, 8), (8, 8, 12)
R30 = (1, 12, 30, 30, 30, 12, 1)
H100 = spec_for_name("NVIDIA H100 80GB HBM3")
BASE = DEVICE_MODELS["cuda"]


def _case(tokens: int = 4096, graph: bool = True, ranks: tuple = R30) -> Case:
    return Case("tt_linear", INS, OUTS, ranks, tokens, "bfloat16", graph)


def _profile(tmp_path, name: str = "Test GPU", fit: dict | None = None) -> str:
    """A profile where, at 4096 tokens, the reconstructed path wins inside a graph and
    the halves path eagerly."""
    meas = [Measurement(_case(graph=True), {"dense": 0.20, "halves": 0.25, "sweep": 0.9,
                                            "nn.Linear": 0.07}),
            Measurement(_case(graph=False), {"dense": 0.40, "halves": 0.30, "sweep": 1.5})]
    prof = DeviceProfile(name, H100, meas, fit or calibrate(H100, meas, BASE),
                         meta={"fake": True})
    return str(prof.write(tmp_path / "profile.json"))


def test_a_measured_case_takes_the_fastest_measured_path(tmp_path, fresh_planner) -> None:
    fresh_planner.setenv("COMERA_DEVICE_PROFILE", _profile(tmp_path))
    for graph, want in ((True, "dense"), (False, "halves")):
        e = planner.explain(4096, INS, OUTS, R30, "cpu", torch.bfloat16, graph=graph)
        assert (e["path"], e["source"]) == (want, "measured"), e
        assert e["profile"].endswith("profile.json") and set(e["measured"]) == {
            "dense", "halves", "sweep"}
        assert e["seconds"]["dense"] == pytest.approx((0.20 if graph else 0.40) * 1e-3)
        assert e["model_source"].startswith("profile:")


def test_a_nearby_case_scales_the_nearest_measurement(tmp_path, fresh_planner) -> None:
    fresh_planner.setenv("COMERA_DEVICE_PROFILE", _profile(tmp_path))
    prof = DeviceProfile.read(tmp_path / "profile.json")
    dm = prof.model(DEVICE_MODELS["cpu"])
    near = _case(1024, True, (1, 12, 24, 24, 24, 12, 1))
    e = planner.explain_case(near, "cpu")
    assert e["source"] == "nearest"
    want = {p: ms * 1e-3 * path_seconds(near, p, dm) / path_seconds(_case(), p, dm)
            for p, ms in prof.measurements[0].path_ms().items()}
    assert e["seconds"] == pytest.approx(want)
    assert e["path"] == min(want, key=want.get)
    # a shape the profile never measured: the model calibrated on it
    other = planner.explain(64, [4, 4], [4, 4], [1, 3, 3, 3, 1], "cpu", torch.bfloat16)
    assert other["source"] == "model" and other["model_source"].startswith("profile:")
    costs = {c.path: c.seconds for c in case_costs(
        Case("tt_linear", (4, 4), (4, 4), (1, 3, 3, 3, 1), 64, "bfloat16"), dm)}
    assert other["path"] == min((p for p in costs if p != "fused"), key=costs.get)


def test_a_graphed_step_plans_for_the_graph(tmp_path, fresh_planner, count_calls) -> None:
    """The same layer under bf16 autocast takes the halves path eagerly and the
    reconstructed one while the trainer's graphed step plans (graph_planning)."""
    fresh_planner.setenv("COMERA_DEVICE_PROFILE", _profile(tmp_path))
    layer = TTLinear(768, 768, rank=30, in_factors=INS, out_factors=OUTS)
    x = torch.randn(4096, 768)
    dense = count_calls(planner, "tt_linear_dense")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
        assert not dense
        with planner.graph_planning():
            layer(x)
    assert len(dense) == 1


def test_a_gpu_without_a_profile_gets_its_calibrated_roofline(tmp_path, fresh_planner) -> None:
    fit = {**DEFAULT_FIT, "mac_eff": 0.3, "bw_eff": 0.8, "op_overhead": 4e-6,
           "graph_op_overhead": 1e-6, "path_factors": {"tt_linear/fused": 1.5}}
    other = DeviceProfile("NVIDIA H200", spec_for_name("NVIDIA H200"), [], fit)
    other.write(tmp_path / "nvidia-h200.json")
    fresh_planner.setenv("COMERA_PROFILE_DIR", str(tmp_path))
    fresh_planner.setattr(planner, "_cuda_name", lambda dev: "NVIDIA H100 80GB HBM3")
    fresh_planner.setattr(planner, "_cuda_major", lambda dev: 9)
    dm, prof = planner.device_model("cuda")
    assert prof is None and dm.source.startswith("roofline:NVIDIA H100 SXM")
    assert dm.mac_rate_16 == pytest.approx(989.4e12 / 2 * 0.3)
    assert dm.bandwidth == pytest.approx(3.35e12 * 0.8)
    assert dm.overhead(True) == 1e-6 and dm.factor("tt_linear", "fused") == 1.5
    case = _case(4096, True)
    costs = {c.path: c.seconds for c in case_costs(case, dm)}
    e = planner.explain_case(case, "cuda")  # no kernels here: fused is not a candidate
    assert e["source"] == "model" and e["path"] == min(
        (p for p in costs if p != "fused"), key=costs.get)
    # the same GPU with a profile of its own: the profile's model
    DeviceProfile("NVIDIA H100 80GB HBM3", H100, [], fit).write(
        tmp_path / "nvidia-h100-80gb-hbm3.json")
    planner.clear_caches()
    fresh_planner.setattr(planner, "_cuda_name", lambda dev: "NVIDIA H100 80GB HBM3")
    fresh_planner.setattr(planner, "_cuda_major", lambda dev: 9)
    assert planner.device_model("cuda")[0].source == "profile:nvidia-h100-80gb-hbm3.json"
    # no profile anywhere: the defaults
    assert fallback_model(H100, BASE, []).mac_rate_16 == pytest.approx(
        989.4e12 / 2 * DEFAULT_FIT["mac_eff"])


def test_every_datasheet_entry_is_found_by_its_own_name() -> None:
    for _, spec in GPU_SPECS:
        assert spec_for_name(spec.name) == spec, spec.name
    assert spec_for_name("NVIDIA GeForce GTX 1080") is None


def test_the_calibration_recovers_the_device_it_was_made_from() -> None:
    """Timings made by a known model (on the fit's grid) give that model back, and path
    factors of 1."""
    true = {"mac_eff": float(torch.logspace(-2, 0, 15, dtype=torch.float64)[10]),
            "bw_eff": float(torch.logspace(torch.log10(torch.tensor(0.03)), 0, 12,
                                           dtype=torch.float64)[8]),
            "op_overhead": 8e-6, "graph_op_overhead": 2e-6, "path_factors": {}}
    dm = model_from_fit(H100, true, BASE, "true")
    meas = []
    for tokens in (32, 512, 4096, 16384):
        for r in (8, 30, 64):
            for graph in (False, True):
                c = Case("tt_linear", INS, OUTS, (1, 12, r, r, r, 12, 1), tokens, "bfloat16",
                         graph)
                meas.append(Measurement(c, {p: path_seconds(c, p, dm) * 1e3
                                            for p in ("dense", "halves", "sweep")}))
    fit = calibrate(H100, meas, BASE)
    assert fit["mac_eff"] == pytest.approx(true["mac_eff"], rel=0.45)
    assert fit["bw_eff"] == pytest.approx(true["bw_eff"], rel=0.4)
    assert fit["op_overhead"] == pytest.approx(8e-6, rel=0.5)
    assert fit["graph_op_overhead"] == pytest.approx(2e-6, rel=0.3)
    assert all(0.7 < f < 1.4 for f in fit["path_factors"].values()), fit["path_factors"]


def test_paths_restricts_the_choice_to_a_family(fresh_planner) -> None:
    args = (4096, INS, OUTS, R30)
    assert planner.plan(*args) == "halves"
    fresh_planner.setenv("COMERA_PATHS", "reconstructed")
    assert planner.plan(*args) == "dense"
    fresh_planner.setenv("COMERA_PATHS", "factorised")
    assert planner.plan(1, INS, OUTS, [1, 12, 96, 96, 96, 12, 1]) == "sweep"
    fresh_planner.setenv("COMERA_PATHS", "fused")  # no kernels here: the op's own choice
    assert planner.plan(*args) == "halves"


def test_a_bad_profile_file_is_named(tmp_path, fresh_planner) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "comera-device-profile/1", "device": {}}))
    fresh_planner.setenv("COMERA_DEVICE_PROFILE", str(bad))
    with pytest.raises(ValueError, match="bad.json"):
        planner.plan(4096, INS, OUTS, R30)


def test_a_profile_round_trips_and_installs_its_kernel_configs(tmp_path, fresh_planner) -> None:
    from comera_engine.kernels import configs

    path = _profile(tmp_path)
    prof = DeviceProfile.read(path)
    prof.kernels = {"chain": [{"shape": [4096, 768, 30, 3072], "dtype": "bfloat16",
                               "config": {"BLOCK_B": 64, "BLOCK_K": 32, "BLOCK_M": 64,
                                          "SPLIT": 8}, "ms": 0.1}]}
    prof.write(path)
    again = DeviceProfile.read(path)
    assert again.to_json() == prof.to_json() | {"device": again.to_json()["device"]}
    fresh_planner.setenv("COMERA_DEVICE_PROFILE", path)
    try:
        planner.device_model("cpu")
        assert configs.config("chain", (4000, 768, 30, 3072), "bfloat16")["SPLIT"] == 8
        assert configs.config("chain", (4000, 768, 30, 3072), "float32") == configs.DEFAULTS[
            "chain"]
    finally:
        configs.reset()


def test_the_committed_profiles_load_and_each_plans_its_gpu(fresh_planner) -> None:
    """Every profile committed with the package reads back, names a GPU the roofline
    knows, holds measured cases, and is the one the planner uses for that GPU."""
    from comera_engine.tensor import profile as profile_mod

    fresh_planner.undo()  # the packaged profiles, as a user's install has them
    planner.clear_caches()
    files = sorted(profile_mod.PACKAGE_DIR.glob("*.json"))
    assert files, "no profile is committed in comera_engine/tensor/profiles"
    for path in files:
        prof = DeviceProfile.read(path)
        assert profile_mod.slug(prof.name) + ".json" == path.name
        assert prof.measurements and spec_for_name(prof.name) is not None
        assert profile_mod.find_profile(prof.name).name == prof.name
        fresh_planner.setattr(planner, "_cuda_name", lambda dev, n=prof.name: n)
        assert planner.device_model("cuda")[1].name == prof.name
    planner.clear_caches()
