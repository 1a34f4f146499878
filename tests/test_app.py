"""Dashboard pages under Streamlit's AppTest: widgets, validation messages, empty states,
launch-once, stop, export; plus the preview arithmetic and the ``comera app`` launcher.

Most tests seed a temporary run store through the store API; one module fixture trains a
real (short) run through the launcher for the export page.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import statistics
import struct
import threading
import time
from pathlib import Path

import pytest
import tomllib

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

from comera_engine.store import RunStore  # noqa: E402
from tests.app_checks import (  # noqa: E402
    HOME,
    ROOT,
    TIMEOUT,
    blank_when_missing,
    log_axes,
    no_exception,
    page_figures,
    tile_rows,
    unlabelled_log_axes,
)

PAGES = {
    "new": "views/new_experiment.py",
    "live": "views/live_run.py",
    "compare": "views/compare.py",
    "learn": "views/learn.py",
    "export": "views/export.py",
}

# ------------------------------------------------------------------ helpers


def store_at(home: Path) -> RunStore:
    return RunStore(home / "comera.db")


def app(page: str | None = None) -> AppTest:
    at = AppTest.from_file(HOME, default_timeout=TIMEOUT).run()
    if page is not None:
        at.switch_page(PAGES[page]).run()
    return at


def live_charts(at: AppTest) -> dict[str, dict]:
    """The Live page's in-place charts (``app.lib.livechart``): key -> Plotly figure."""
    from app.lib.livechart import figure_of

    return {e.proto.id.rsplit("-", 2)[-2] + "-" + e.proto.id.rsplit("-", 1)[-1]:
            figure_of(e.proto.json_args) for e in at.get("component_instance")
            if e.proto.component_name.endswith("live_chart")}


def texts(at: AppTest) -> str:
    parts = [m.value for m in at.markdown] + [c.value for c in at.caption]
    parts += [e.value for e in at.error] + [w.value for w in at.warning]
    parts += [i.value for i in at.info] + [s.value for s in at.subheader]
    return "\n".join(str(p) for p in parts)


def config(name: str = "digits-tt-mlp", steps: int = 600, target: float | None = 20.0,
           dense: bool = False, rank: int = 8) -> dict:
    comera = {"gamma": 0.01, "target_scope": "tensorized", "switch": 300}
    if target is not None:
        comera["target_compression"] = target
    return {
        "name": name,
        "model": {"name": "tt_mlp", "preset": "tiny", "dense": dense, "rank": rank,
                  "tt_layers": ["hidden"]},
        "data": {"name": "digits", "split_fraction": 0.8},
        "comera": comera,
        "train": {"steps": steps, "batch_size": 64, "eval_every": 100, "ckpt_every": 300},
    }


def seed_run(st: RunStore, name: str = "digits-tt-mlp", status: str = "finished",
             steps: int = 600, upto: int = 600, dense: bool = False, target: float = 20.0,
             acc: float = 0.93, comp: float = 24.0) -> str:
    """A run with metrics, rank snapshots, a stage switch and events, written through the
    store API (what a trainer's StoreSink would have written)."""
    rid = st.create_run(name, config(name, steps, target, dense), "running")
    t = time.time()
    rows = []
    for s in range(1, upto + 1, 5):
        frac = s / steps
        rows += [
            (s, "loss/task", 2.3 * (1 - frac) + 0.1, t),
            (s, "loss/total", 2.3 * (1 - frac) + 0.12, t),
            (s, "acc/train", min(1.0, acc * frac + 0.1), t),
            (s, "compression/model", 1.0 if dense else comp * 0.6, t),
            (s, "compression/tensorized", 1.0 if dense else comp, t),
            (s, "perf/samples_per_s", 500.0 + s % 7, t),
            (s, "mem/rss_mb", 400.0 + s / 100, t),
            (s, "params/effective", 85000.0 if dense else 6000.0, t),
            (s, "bytes/effective", 340000.0 if dense else 24000.0, t),
            (s, "stage", 1.0 if s >= 300 else 0.0, t),
            (s, "lr/dense", 3e-3 * min(1.0, s / 50), t),  # warm-up, then constant
        ]
        if not dense:
            rows.append((s, "lr/gates", 1e-2, t))
        if s % 100 == 1:
            rows += [(s, "eval/acc", acc * frac, t), (s, "eval/loss", 1.0 - frac / 2, t)]
    st.write_batch(rid, metrics=rows)
    if not dense:
        st.log_ranks(rid, 1, {"body.0": [4, 8, 8, 8, 8], "body.3": [8, 8, 8, 8, 8]})
        if upto >= 350:
            st.log_ranks(rid, 350, {"body.0": [4, 6, 5, 6, 8], "body.3": [8, 7, 6, 7, 8]})
            st.log_event(rid, "rank_change", "body.0 bond 2: 8 -> 6", 350)
    if upto >= 300:
        st.log_event(rid, "stage", "late stage after step 300 (z_f = 0.12)", 300)
        st.log_event(rid, "checkpoint", "step_000300.safetensors (stage)", 300)
    if status != "running":
        st.set_status(rid, status, "RuntimeError: boom" if status == "failed" else None)
    else:
        st.heartbeat(rid)
    return rid


def launched_folder(st: RunStore, rid: str, checkpoint_at: int | None = None) -> Path:
    """The run's folder as the launcher and its trainer leave it: its ``config.toml``
    and, at step ``checkpoint_at``, a checkpoint that reads back (a sidecar naming one
    tensor, and a safetensors file holding it)."""
    folder = st.run_dir(rid)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(
        (ROOT / "experiments" / "configs" / "digits_tt_mlp.toml").read_text())
    if checkpoint_at is not None:
        stem = folder / "checkpoints" / f"step_{checkpoint_at:06d}"
        stem.parent.mkdir(exist_ok=True)
        head = json.dumps({"model/w": {"dtype": "F32", "shape": [1],
                                       "data_offsets": [0, 4]}}).encode()
        data = struct.pack("<Q", len(head)) + head + bytes(4)
        stem.with_suffix(".safetensors").write_bytes(data)
        stem.with_suffix(".json").write_text(json.dumps(
            {"step": checkpoint_at, "shapes": {"w": [1]},
             "sha256": hashlib.sha256(data).hexdigest()}))
    return folder


# ------------------------------------------------------------------ every page: empty store


@pytest.mark.parametrize("page", [None, "live", "compare", "export"])
def test_empty_store_pages_offer_the_default_experiment(home: Path, page: str | None) -> None:
    at = app(page)
    no_exception(at)
    assert "No runs yet" in texts(at)
    labels = [b.label for b in at.button]
    assert "Launch the default experiment" in labels
    assert "Design an experiment" in labels


def test_learn_page_widgets_and_live_numbers(home: Path) -> None:
    at = app("learn")
    no_exception(at)
    assert len(at.tabs) == 4
    assert {s.label for s in at.slider} >= {"TT rank", "Rank", "Allocated rank of the bond",
                                              "Size pressure so far (γ × steps)"}
    params = next(m for m in at.metric if m.label == "Parameters").value
    at.slider(key="l-rank").set_value(32).run()
    no_exception(at)
    assert next(m for m in at.metric if m.label == "Parameters").value != params
    at.selectbox(key="l-src").set_value("random").run()
    no_exception(at)
    assert any("random matrix" in i.value for i in at.info)
    at.selectbox(key="l-lay").set_value("interleaved").run()
    no_exception(at)
    assert next(m for m in at.metric if m.label == "Planner picks").value in (
        "halves", "sweep", "dense")
    assert len(at.get("plotly_chart")) >= 7
    # every gate pushed below τ: the bond keeps its strongest direction, as the default
    # schedules' rank floor does (it showed rank 0, 0 parameters and ∞×)
    at.slider(key="l-g-p").set_value(1.0).run()
    no_exception(at)
    assert next(m for m in at.metric if m.label == "Effective rank").value.startswith("1 / ")
    assert next(m for m in at.metric if m.label == "Compression vs dense").value != "∞×"
    assert any("comera.rank_floor" in c.value for c in at.caption)


def test_the_article_a_count_takes() -> None:
    from app.lib.fmt import a_or_an

    assert [a_or_an(n) for n in (3, 8, 11, 12, 18, 80, 86, 100, 800)] == [
        "a", "an", "an", "a", "an", "an", "an", "a", "an"]


def test_learn_cores_tab_counts_the_cores_and_bounds_of_the_chosen_factors(home: Path
                                                                           ) -> None:
    """The TT cores tab's texts follow the factors picked: how many cores, and the bound
    of each inner rank (it said "six here" and "r1 ≤ 12" whatever was picked)."""
    from app.lib.learn import bounds_text, in_words, rank_bounds

    assert rank_bounds([12, 8, 8], [8, 8, 12]) == [12, 96, 768, 96, 12]
    assert rank_bounds([24, 32], [32, 24]) == [24, 768, 24]
    assert bounds_text([24, 32], [32, 24]) == "r1 ≤ 24, r2 ≤ 768, r3 ≤ 24"
    assert bounds_text([24, 32], [32, 24], 30) == (
        "r1 ≤ 24, r2 ≤ 768, r3 ≤ 24; at rank 30, r1 and r3 are held at their bound")
    assert bounds_text([6, 4, 4, 8], [8, 4, 4, 6], 8).endswith(
        "; at rank 8, r1 and r7 are held at their bound")
    assert bounds_text([12, 8, 8], [8, 8, 12], 12) == "r1 ≤ 12, r2 ≤ 96, r3 ≤ 768, r4 ≤ 96, " \
        "r5 ≤ 12"
    assert (in_words(6), in_words(4), in_words(13)) == ("six", "four", "13")
    at = app("learn")
    no_exception(at)
    assert "reshape $W$ into a 6-way tensor" in texts(at) and "(six here)" in texts(at)
    assert "r1 ≤ 12, r2 ≤ 96, r3 ≤ 768, r4 ≤ 96, r5 ≤ 12; at rank 30, r1 and r5" in texts(at)
    for factors, way, word, bounds in (
            ("24·32 | 32·24", 4, "four", "r1 ≤ 24, r2 ≤ 768, r3 ≤ 24; at rank 30, r1 and r3"),
            ("6·4·4·8 | 8·4·4·6", 8, "eight", "r1 ≤ 6, r2 ≤ 24, r3 ≤ 96, r4 ≤ 768, r5 ≤ 96, "
                                               "r6 ≤ 24, r7 ≤ 6; at rank 30, r1, r2, r6 and r7")):
        at.radio(key="l-fac").set_value(factors).run()
        no_exception(at)
        assert f"768 = {factors.split(' | ')[0]} for the inputs" in texts(at)
        article = "an" if way == 8 else "a"  # "an 8-way"
        assert f"reshape $W$ into {article} {way}-way tensor" in texts(at)
        assert f"({word} here)" in texts(at)
        assert bounds in texts(at)
        assert "six here" not in texts(at) and "r1 ≤ 12" not in texts(at)


def test_learn_tt_svd_holds_after_tltorch_switched_tensorlys_backend() -> None:
    """The Learn page's TT-SVD after a tltorch peer's preview in the same dashboard process
    (importing tltorch sets tensorly's global backend to PyTorch): the matrix's TT cores,
    contracted back here in float64, give the reconstruction and the error it reports."""
    import numpy as np
    import tensorly as tl

    from app.lib.learn import from_tensor, to_tensor, tt_approx

    m = np.random.default_rng(0).standard_normal((256, 256))
    want = tt_approx(m, "interleaved", 3)
    with tl.backend_context("pytorch"):
        got = tt_approx(m, "interleaved", 3)
    assert got.core_shapes == want.core_shapes
    assert np.array_equal(got.reconstruction, want.reconstruction)
    from comera_engine import tt_svd

    cores = tt_svd(to_tensor(m, "interleaved"), max_rank=3)
    full = cores[0]
    for c in cores[1:]:
        full = np.tensordot(full, c, axes=([-1], [0]))
    rec = from_tensor(full.reshape(full.shape[1:-1]), "interleaved")
    assert np.allclose(got.reconstruction, rec, atol=1e-12)
    assert got.rel_error == pytest.approx(np.linalg.norm(rec - m) / np.linalg.norm(m),
                                          rel=1e-9)


# ------------------------------------------------------------------ new experiment


def test_new_experiment_widgets_and_preview(home: Path) -> None:
    at = app("new")
    no_exception(at)
    assert at.selectbox(key="preset").value == "digits_tt_mlp"
    labels = {w.label for w in [*at.selectbox, *at.text_input, *at.radio, *at.toggle]}
    assert labels >= {
        "Start from", "Dataset", "Model size", "Dense baseline", "Target compression (×)",
        "Max rank (linear layers)", "Late-stage switch", "Late stage from step", "Device",
        "Precision", "Steps", "CUDA Graph", "Enforce a target compression",
        "Initial ranks from the target", "TT linear layout",
    }
    assert "cpu" in at.selectbox(key="device").options[0].lower()
    metrics = {m.label: m.value for m in at.metric}
    assert {"Parameters", "Compression (TT layers)", "MACs / example",
            "Estimated training memory"} <= set(metrics)
    assert metrics["Compression (TT layers)"].endswith("×")
    # at the end of the run: the 60x target itself (the pace prunes to it), not the
    # whole-rank illustration of the per-layer table
    comp = next(m for m in at.metric if m.label == "Compression (TT layers)")
    assert comp.proto.delta == "60.0× at the end"
    table = at.dataframe[0].value
    assert list(table["layer"]) == ["body.0", "body.3"]
    assert set(table["path"]) <= {"halves", "sweep", "dense"}
    launch = at.button(key="launch")
    assert launch.label == "Launch" and not launch.disabled
    charts = at.get("plotly_chart")
    assert len(charts) == 4
    # start, target and floor as one bar: the digits preset asks 60x and, its ranks not
    # fixed, starts where `comera train` starts it: about 3x the target size (<= 20x)
    from comera_engine.preview import preview

    shipped = preview(tomllib.loads((ROOT / "experiments/configs/digits_tt_mlp.toml")
                                    .read_text()))
    bar = {t.get("name"): t for t in json.loads(charts[0].proto.spec)["data"]}
    start, target, floor = (bar[n]["x"][0] for n in ("start", "target", "floor"))
    assert target == 60.0 and floor > target
    assert start == pytest.approx(shipped.compression(), abs=0.05) and start <= 20.0
    assert bar[None]["base"][0] == start and bar[None]["x"][0] == pytest.approx(floor - start)
    assert at.toggle(key="digits_tt_mlp:auto_rank").value
    assert any("Starts at max rank" in c.value for c in at.caption)
    # the greyed rank field shows no rank the run does not start at, but where it comes from
    chosen = at.text_input(key="digits_tt_mlp:rank:tiny:auto")
    assert chosen.disabled and not chosen.value and "from the target" in chosen.placeholder
    # the toggle off: the preset's rank 8 is the start
    at.toggle(key="digits_tt_mlp:auto_rank").set_value(False).run()
    assert at.text_input(key="digits_tt_mlp:rank:tiny").value == "8"
    raw8 = tomllib.loads((ROOT / "experiments/configs/digits_tt_mlp.toml").read_text())
    raw8["model"]["rank"] = 8
    bar = {t.get("name"): t for t in json.loads(at.get("plotly_chart")[0].proto.spec)["data"]}
    assert bar["start"]["x"][0] == pytest.approx(preview(raw8).compression(), abs=0.05)
    assert bar["start"]["x"][0] != pytest.approx(start, abs=0.05)
    # the paper's tt layout at the same rank: its own start (cores of other shapes)
    at.radio(key="digits_tt_mlp:layout").set_value("tt").run()
    raw8["model"]["linear_layout"] = "tt"
    bar = {t.get("name"): t for t in json.loads(at.get("plotly_chart")[0].proto.spec)["data"]}
    assert bar["start"]["x"][0] == pytest.approx(preview(raw8).compression(), abs=0.05)
    at.radio(key="digits_tt_mlp:layout").set_value("ttm").run()
    charts = at.get("plotly_chart")
    charts = charts[1:]
    # the per-layer bars carry the table's numbers: dense, TT as allocated, TT at target
    params = json.loads(charts[0].proto.spec)["data"]
    assert [t["name"] for t in params] == ["dense", "TT (allocated)", "TT at target"]
    assert list(params[0]["x"]) == list(table["dense"])
    assert list(params[2]["x"]) == list(table["at target"])
    macs = json.loads(charts[1].proto.spec)["data"]
    assert list(macs[1]["text"]) == list(table["path"])


def test_new_experiment_validation_messages(home: Path) -> None:
    at = app("new")
    at.text_input(key="digits_tt_mlp:target").set_value("1.0").run()
    no_exception(at)
    errs = " ".join(e.value for e in at.error)
    assert "comera.target_compression: must be a finite ratio > 1" in errs
    assert at.button(key="launch").disabled

    at.text_input(key="digits_tt_mlp:target").set_value("5000.0").run()
    assert "beyond the smallest TT model" in " ".join(e.value for e in at.error)
    assert at.button(key="launch").disabled

    at.text_input(key="digits_tt_mlp:target").set_value("40.0").run()
    at.text_input(key="digits_tt_mlp:steps").set_value("0").run()
    assert "train.steps: must be a positive integer" in " ".join(e.value for e in at.error)

    at.text_input(key="digits_tt_mlp:switch_step").set_value("300").run()
    at.text_input(key="digits_tt_mlp:steps").set_value("200").run()
    assert not at.error
    assert "starts the late stage after step 100, not 300" in " ".join(
        w.value for w in at.warning)  # the engine's switch_by (tests/test_form.py)
    assert not at.button(key="launch").disabled

    # values a widget used to clamp silently reach the engine and are refused by it
    at.text_input(key="digits_tt_mlp:target").set_value("1e9").run()
    assert "comera.target_compression: 1e+09x is beyond the smallest TT model" in " ".join(
        e.value for e in at.error)
    assert at.button(key="launch").disabled
    at.text_input(key="digits_tt_mlp:target").set_value("40.0").run()
    at.text_input(key="digits_tt_mlp:steps").set_value("-5").run()
    assert "train.steps: must be a positive integer, got -5" in " ".join(
        e.value for e in at.error)
    assert at.button(key="launch").disabled
    at.text_input(key="digits_tt_mlp:steps").set_value("").run()  # blank: not "got None"
    errs = " ".join(e.value for e in at.error)
    assert "train.steps: must be an integer; the field is empty" in errs
    assert "None" not in errs and at.button(key="launch").disabled
    at.text_input(key="digits_tt_mlp:steps").set_value("200").run()
    at.text_input(key="digits_tt_mlp:name").set_value("bad\x1bname").run()
    assert "name: control characters" in " ".join(e.value for e in at.error)
    assert at.button(key="launch").disabled
    at.text_input(key="digits_tt_mlp:name").set_value("mine").run()
    assert not at.error and not at.button(key="launch").disabled
    at.text_input(key="digits_tt_mlp:name").set_value("").run()  # blank: named for the run
    assert not at.error
    assert tomllib.loads(at.code[0].value)["name"] == "digits-tt-mlp · 40×"  # what launches

    at.text_input(key="digits_tt_mlp:batch").set_value("5000").run()
    assert "train.batch_size: 5000 exceeds" in " ".join(e.value for e in at.error)
    at.text_input(key="digits_tt_mlp:batch").set_value("64").run()

    at.selectbox(key="digits_tt_mlp:precision").set_value("bf16").run()
    assert "bf16 autocast on a CPU" in " ".join(w.value for w in at.warning)

    at.toggle(key="digits_tt_mlp:auto_rank").set_value(False).run()
    at.text_input(key="digits_tt_mlp:rank:tiny").set_value("0").run()
    assert "model.rank: must be a positive integer" in " ".join(e.value for e in at.error)


@pytest.mark.parametrize("field, typed", [
    ("steps", "1e9"), ("steps", "2.5"), ("steps", "ten"), ("batch", "64.0"),
    ("seed", "1e3"), ("target", "much"), ("patience", "1.5"),
])
def test_number_fields_refuse_never_coerce(home: Path, field: str, typed: str) -> None:
    """Issue 46 item 5: what is typed stays as typed and reaches the engine; the form
    shows the engine's own one-line message beside the field and disables Launch."""
    from comera_engine.config import parse_value
    from comera_engine.errors import ConfigError
    from comera_engine.launch import resolve_config

    at = app("new")
    if field == "patience":
        at.selectbox(key="digits_tt_mlp:late_switch").set_value("plateau").run()
    at.text_input(key=f"digits_tt_mlp:{field}").set_value(typed).run()
    no_exception(at)
    assert at.text_input(key=f"digits_tt_mlp:{field}").value == typed  # not rewritten
    raw = tomllib.loads((ROOT / "experiments/configs/digits_tt_mlp.toml").read_text())
    section, key = {"steps": ("train", "steps"), "batch": ("train", "batch_size"),
                    "seed": ("train", "seed"), "target": ("comera", "target_compression"),
                    "patience": ("comera", "plateau_patience")}[field]
    raw[section][key] = parse_value(typed)
    if field == "patience":
        raw["comera"]["switch"] = "plateau"
    with pytest.raises(ConfigError) as engine:
        resolve_config(raw)
    assert str(engine.value) in [e.value for e in at.error]  # the engine's own line
    assert "\n" not in str(engine.value)
    assert at.button(key="launch").disabled
    assert at.button(key="sw-launch").disabled


def test_new_experiment_every_preset_previews(home: Path) -> None:
    at = app("new")
    for key in at.selectbox(key="preset").options:
        at.selectbox(key="preset").set_value(key).run()
        no_exception(at)
        assert any(s.value == "Tensorisation preview" for s in at.subheader)
    # a preset whose data file is not on this machine says so beside the dataset
    if "dlrm_criteo_paper" in at.selectbox(key="preset").options:
        at.selectbox(key="preset").set_value("dlrm_criteo_paper").run()
        assert any("data.path" in e.value and "not on this server" in e.value
                   for e in at.error)
        assert at.button(key="launch").disabled
    # a data set read from the Hugging Face hub by name says it needs the network first
    at.selectbox(key="preset").set_value("snli_transformer_tiny").run()
    pick = at.selectbox(key="snli_transformer_tiny:data")
    hub = [i for i, label in enumerate(pick.options) if "Hugging Face hub" in label]
    assert hub, "no hub data set offered for the NLI transformer"
    assert not any("Hugging Face hub by name" in c.value for c in at.caption)
    pick.set_value(hub[0]).run()
    no_exception(at)
    assert any("Hugging Face hub by name" in c.value and "network" in c.value
               for c in at.caption)


def test_the_forms_expanders_keep_their_identity_when_fields_come_and_go(
        home: Path) -> None:
    """The form's expanders (More settings, All settings, Sweep several targets) are
    keyed: a switch above them that adds or removes fields (the target, the dense
    baseline) leaves an open one open. Unkeyed, each was a new element at its new place,
    and the browser drew it closed: Sweep several targets shut on the user who turned the
    target off to sweep another key."""
    at = app("new")

    def ids(at: AppTest) -> dict[str, str]:
        return {e.label: e._block_id for e in at.expander}

    before = ids(at)
    assert set(before) >= {"More settings", "All settings · edit as TOML",
                           "Sweep several targets"}
    assert all(before.values()), before
    at.toggle(key="digits_tt_mlp:use_target").set_value(False).run()
    no_exception(at)
    assert ids(at) == before
    at.toggle(key="digits_tt_mlp:dense").set_value(True).run()
    assert ids(at) == before


def test_dense_baseline_and_model_scope_target(home: Path) -> None:
    at = app("new")
    at.toggle(key="digits_tt_mlp:dense").set_value(True).run()
    no_exception(at)
    assert next(m for m in at.metric if m.label == "Compression").value == "1.0×"
    at.toggle(key="digits_tt_mlp:dense").set_value(False).run()
    at.radio(key="digits_tt_mlp:scope").set_value("model").run()
    at.text_input(key="digits_tt_mlp:target").set_value("60.0").run()
    assert any("out of reach" in e.value or "beyond the smallest" in e.value for e in at.error)


class FakeLaunch:
    """Stands in for ``comera_engine.launch.launch``: records the run, starts nothing."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls = 0
        self.delay = delay
        self.lock = threading.Lock()

    def __call__(self, config, overrides=(), store=None, name=None, gpus=None, nproc=1,
                 max_concurrent=None) -> str:
        with self.lock:
            self.calls += 1
        time.sleep(self.delay)
        return store.create_run(config["name"], config, "queued")


def test_launch_from_form_is_idempotent(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeLaunch()
    monkeypatch.setattr("comera_engine.launch.launch", fake)
    at = app("new")
    at.text_input(key="digits_tt_mlp:steps").set_value("1000").run()
    at.button(key="launch").click().run()
    no_exception(at)
    st = store_at(home)
    runs_ = st.list_runs()
    assert fake.calls == 1 and len(runs_) == 1
    assert runs_[0]["config"]["train"]["steps"] == 1000
    # we are on the live page of that run (its name drawn as typed: fmt.literal)
    from app.lib.fmt import literal

    assert any(literal(runs_[0]["name"]) in m.value for m in at.markdown)
    # the same submission again (double click / resubmitted form): no second run
    at.switch_page(PAGES["new"]).run()
    assert any("launched from this form" in i.value and runs_[0]["id"] in i.value
               for i in at.info)
    at.button(key="launch").click().run()
    assert fake.calls == 1 and len(st.list_runs()) == 1
    # "Launch another" is an explicit fresh submission
    at.switch_page(PAGES["new"]).run()
    at.button(key="launch_another").click().run()
    at.button(key="launch").click().run()
    assert fake.calls == 2 and len(st.list_runs()) == 2


def test_a_run_launched_from_a_preset_gets_a_name_of_its_own(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run launched from the form is named for what it is, unique in the store: the
    config's name and what the run asks ("mnli-transformer-paper · 20×"), #2, #3 once a
    run has it; it kept the preset's name, the same for every run launched from it. A
    name typed in the form is the run's, as typed; a sweep's cells are named after the
    config."""
    from app.lib.form import auto_run_name
    from app.lib.runs import unique_name

    monkeypatch.setattr("comera_engine.launch.launch", FakeLaunch())
    mnli = {"name": "mnli-transformer-paper", "model": {"preset": "paper"}}
    assert auto_run_name(mnli, "paper", False, 20.0) == "mnli-transformer-paper · 20×"
    assert auto_run_name(mnli, "tiny", True, 20.0) == "mnli-transformer-paper · tiny · dense"
    assert auto_run_name(mnli, None, False, None) == "mnli-transformer-paper · no target"
    assert unique_name("a", ["a", "a #2", "b"]) == "a #3" and unique_name("c", ["a"]) == "c"
    assert len(unique_name("x" * 120, ["x" * 120])) == 120
    at = app("new")
    assert at.text_input(key="digits_tt_mlp:name").value == ""  # blank: named for the run
    assert at.text_input(key="digits_tt_mlp:name").placeholder == "digits-tt-mlp · 60×"
    at.button(key="launch").click().run()
    at.switch_page(PAGES["new"]).run()
    at.button(key="launch_another").click().run()
    at.button(key="launch").click().run()
    at.switch_page(PAGES["new"]).run()
    at.text_input(key="digits_tt_mlp:target").set_value("30").run()
    at.button(key="launch").click().run()
    st = store_at(home)
    assert sorted(r["name"] for r in st.list_runs()) == [
        "digits-tt-mlp · 30×", "digits-tt-mlp · 60×", "digits-tt-mlp · 60× #2"]
    at.switch_page(PAGES["new"]).run()
    at.text_input(key="digits_tt_mlp:name").set_value("digits-tt-mlp · 60×").run()
    at.button(key="launch").click().run()  # typed: as typed, even when taken
    assert [r["name"] for r in st.list_runs()].count("digits-tt-mlp · 60×") == 2


def test_guarded_launch_once_across_concurrent_sessions(home: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    from app.lib import runs as runs_lib
    from app.lib.defaults import default_config

    fake = FakeLaunch(delay=0.3)
    monkeypatch.setattr("comera_engine.launch.launch", fake)
    results: list[tuple[str, bool]] = []

    def session() -> None:  # every session opens its own store connection
        results.append(runs_lib.guarded_launch(store_at(home), default_config(), "tok-1"))

    threads = [threading.Thread(target=session) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert fake.calls == 1
    assert len({rid for rid, _ in results}) == 1
    assert sorted(started for _, started in results) == [False, False, False, True]


def test_empty_state_button_launches_default_once(home: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeLaunch()
    monkeypatch.setattr("comera_engine.launch.launch", fake)
    a, b = app(), app()  # two sessions that both saw the empty store
    a.button(key="overview-default").click().run()
    b.button(key="overview-default").click().run()
    no_exception(a)
    no_exception(b)
    st = store_at(home)
    assert fake.calls == 1 and len(st.list_runs()) == 1
    rid = st.list_runs()[0]["id"]
    assert st.list_runs()[0]["config"]["name"] == "digits-tt-mlp · 60×"  # its own name
    for at in (a, b):  # both landed on the live page of the same run
        assert any(rid in c.value for c in at.caption)


# ------------------------------------------------------------------ live run


def test_live_page_shows_a_running_run(home: Path) -> None:
    st = store_at(home)
    seed_run(st, "older", "finished")
    rid = seed_run(st, "digits-live", "running", upto=400)
    at = app("live")
    no_exception(at)
    assert at.selectbox(key="live-run").value == rid
    metrics = {m.label: m.value for m in at.metric}
    step = next(m for m in at.metric if m.label == "Step")
    assert (step.value, step.proto.delta) == ("396", "of 600")  # never cut to "396 / 6…"
    assert metrics["Compression (TT layers)"] == "24.0×"
    assert "Samples / s" in metrics and "Process memory (RSS)" in metrics
    assert not at.button(key="stop").disabled
    assert at.button(key="resume").disabled
    charts = live_charts(at)
    assert len(charts) == 8 and "ch-gpu" not in charts  # a CPU run: no GPU chart, one line
    rates = {tr["name"]: tr["y"] for tr in charts["ch-lr"]["data"]}
    assert set(rates) == {"dense", "gates"} and charts["ch-lr"]["layout"]["yaxis"]["type"] == "log"
    assert rates["dense"][0] == pytest.approx(3e-3 / 50) and rates["gates"][-1] == 1e-2
    assert "none to plot, this run trains on the CPU" in texts(at)
    spec = {k: fig["layout"] for k, fig in charts.items()}
    assert spec["ch-acc"]["yaxis"]["tickformat"] == ".0%"  # % like the accuracy tile
    assert spec["ch-acc"]["yaxis"]["title"]["text"] == "accuracy"
    assert spec["ch-loss"]["yaxis"]["title"]["text"] == "loss"
    assert spec["ch-mem"]["yaxis"]["rangemode"] == "tozero"
    assert "TT layers" in spec["ch-comp"]["title"]["text"]
    body = texts(at)
    assert "running" in body and "Refreshing every 1 s" in body
    events = at.dataframe[0].value
    assert {"stage", "checkpoint", "rank change"} <= set(events["kind"])
    assert blank_when_missing(at) == 0  # every event has its step
    # the trainer log: its last 30 lines, the newest included (the browser test checks
    # that the panel shows its last line)
    log = st.log_path(rid)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(f"step {i} loss 0.{i:03d}\n" for i in range(1, 245)))
    at.run()
    (code,) = [c for c in at.code if "step 244" in c.value]
    assert code.value.splitlines() == [f"step {i} loss 0.{i:03d}" for i in range(215, 245)]


def test_pages_render_while_a_frozen_process_holds_the_store_lock(home: Path) -> None:
    """A process stopped (SIGSTOP) in the middle of a write holds the store's write lock:
    the pages still render from what is recorded (their reap of vanished runs gives up
    after ``REAP_WAIT_S``; it waited the store's 30 s, past this test's page timeout),
    and once the lock is free a later rerun marks the vanished run crashed."""
    from app.lib.ui import REAP_WAIT_S
    from tests.store_checks import frozen_lock_holder

    st = store_at(home)
    rid = seed_run(st, "vanished", "running", upto=50)
    long_ago = time.time() - 3600
    st.update_run(rid, started_at=long_ago, heartbeat_at=long_ago)  # no sign of life
    with frozen_lock_holder(st.path):
        at = AppTest.from_file(HOME, default_timeout=REAP_WAIT_S + 20).run()
        at.switch_page(PAGES["live"]).run()
        no_exception(at)
        assert at.selectbox(key="live-run").value == rid
        assert store_at(home).get_run(rid)["status"] == "running"  # as recorded
    at.session_state["_last_reap"] = 0.0  # the next rerun reaps
    at.run()
    assert store_at(home).get_run(rid)["status"] == "crashed"


def test_live_page_says_what_a_starting_run_is_doing(home: Path) -> None:
    """A run at step 0 that is preparing its data says so instead of showing empty
    charts; a phase whose progress is known (evaluating) is a progress bar."""
    st = store_at(home)
    rid = st.create_run("starting", config("starting"), "running")
    st.heartbeat(rid)  # alive
    st.set_phase(rid, "preparing data")
    at = app("live")
    no_exception(at)
    assert at.selectbox(key="live-run").value == rid
    assert [i.value for i in at.info] == ["Preparing data…"]
    assert "now preparing data" in texts(at)
    assert not live_charts(at) and "charts appear with the first training step" in texts(at)
    assert [(p.value, p.text) for p in at.progress] == [(0, "step 0 of 600")]
    t = time.time()
    st.write_batch(rid, metrics=[(s, "loss/task", 1.0 / s, t) for s in range(1, 101)],
                   phase=("evaluating", 0.4), heartbeat=True)
    at.run()
    no_exception(at)
    bars = [(p.value, p.text) for p in at.progress]
    assert bars == [(16, "step 100 of 600"), (40, "Evaluating · 40 %")]
    assert not at.info and "now evaluating" in texts(at)
    assert len(live_charts(at)) == 7  # metrics: the charts are back
    st.set_phase(rid, "training")
    at.run()
    assert [p.text for p in at.progress] == ["step 100 of 600"]  # the step bar says it
    st.set_phase(rid, "done")
    st.set_status(rid, "finished")
    at.run()
    assert "now " not in texts(at) and [p.text for p in at.progress] == ["step 100 of 600"]


def test_live_page_states_the_target_outcome_and_slower_paths(home: Path) -> None:
    """The run's final word on its target, the TT paths its step runs and any fallback
    to a slower path (a CUDA graph capture that failed) are banners above the charts,
    read from the store."""
    st = store_at(home)
    rid = seed_run(st, "missed", "finished", upto=600)
    st.log_event(rid, "slow_path", "CUDA graph off: capture failed: RuntimeError: x", 4)
    st.log_event(rid, "paths", "tt_linear 768×768 r30 ×4096 bfloat16, graph: dense "
                 "(measured)", 4)
    st.log_event(rid, "target", "target 60x · reached 42.2x: missed by 30 % (why)", 600)
    at = app("live")
    no_exception(at)
    assert any("missed by 30 %" in w.value for w in at.warning)
    assert any(i.value.startswith("TT paths: tt_linear 768×768") for i in at.info)
    assert any("CUDA graph off: capture failed" in w.value and "step 4" in w.value
               for w in at.warning)
    met = seed_run(st, "met", "finished", upto=600)
    st.log_event(met, "target", "target 60x · reached 60.3x (+0 %)", 600)
    from app.lib import runs

    assert runs.notices(st, st.get_run(met)) == [
        ("success", "target 60x · reached 60.3x (+0 %)")]
    assert runs.notices(st, st.get_run(rid))[0][0] == "warning"


def test_the_cpu_threads_note_is_shown_while_the_run_is_in_flight(home: Path) -> None:
    """The CPU threads note (the launcher's, then the trainer's ``threads`` event) is
    shown while the run is in flight, with the runs in flight counted as the page is
    drawn; a finished run's page, and a resumed run still waiting for its slot, show none
    (the note stayed on finished runs' pages with the count of when it was written)."""
    from app.lib import runs

    def threads_notes(at: AppTest) -> list[str]:
        return [i.value for i in at.info if i.value.startswith("CPU threads")]

    st = store_at(home)
    rid = seed_run(st, "threaded", "running", upto=100)
    st.log_event(rid, "threads", "2 thread(s): 2 cores shared by 1 run(s) in flight "
                 "(OMP_NUM_THREADS)", 0)
    others = [seed_run(st, f"other {i}", "running", upto=10) for i in range(2)]
    at = app("live")
    at.selectbox(key="live-run").set_value(rid).run()
    no_exception(at)
    assert threads_notes(at) == ["CPU threads: 2 thread(s): 2 cores shared by 3 run(s) in "
                                 "flight (OMP_NUM_THREADS)"]
    st.set_status(others[0], "finished")
    at.run()
    assert threads_notes(at) == ["CPU threads: 2 thread(s): 2 cores shared by 2 run(s) in "
                                 "flight (OMP_NUM_THREADS)"]
    st.set_status(rid, "finished")
    at.run()
    no_exception(at)
    assert at.selectbox(key="live-run").value == rid and not threads_notes(at)
    assert not [t for _, t in runs.notices(st, st.get_run(rid)) if "thread" in t]
    # resumed: queued again, waiting for a slot (not in flight), then dispatched
    st.update_run(rid, status="queued", dispatched_at=None)
    assert not [t for _, t in runs.notices(st, st.get_run(rid)) if "thread" in t]
    st.update_run(rid, dispatched_at=time.time())
    assert ("info", "CPU threads: 2 thread(s): 2 cores shared by 2 run(s) in flight "
            "(OMP_NUM_THREADS)") in runs.notices(st, st.get_run(rid))
    # a text without the count keeps it and says the count now
    assert runs.threads_now(st, st.get_run(rid), "1 thread(s)") == (
        "1 thread(s) (2 run(s) in flight now)")


def test_a_stopped_then_resumed_run_shows_progress_not_its_old_verdict(home: Path) -> None:
    """The trainer writes a ``target`` event when an attempt ends, stopped ones too; the
    page states a verdict only for a run that finished its steps. Stopped: where it
    stopped, toward the target; resumed and training on: progress, never the verdict."""
    from app.lib import runs

    st = store_at(home)
    rid = seed_run(st, "resumed", "stopped", steps=20000, upto=551, comp=26.8, target=60.0)
    st.log_event(rid, "target", "target 60x · reached 26.8x: missed by 55 % (the late stage "
                 "did not prune enough by step 551)", 551)
    (level, text), *_ = runs.notices(st, st.get_run(rid))
    assert level == "info" and "missed" not in text
    assert text == ("target 60x · 26.8x at step 551 of 20,000 when it stopped: resume it to "
                    "go on toward the target")
    st.set_status(rid, "running")  # resumed: it trains on toward the target
    st.heartbeat(rid)
    at = app("live")
    no_exception(at)
    shown = " ".join(x.value for x in [*at.info, *at.warning, *at.success])
    assert "missed" not in shown
    assert "target 60x · now 26.8x at step 551 of 20,000 (still training)" in shown
    st.set_status(rid, "finished")  # an attempt that ran its steps: its verdict
    st.log_event(rid, "target", "target 60x · reached 60.3x (+0 %)", 20000)
    st.update_run(rid, last_step=20000)
    assert runs.notices(st, st.get_run(rid))[0] == ("success",
                                                   "target 60x · reached 60.3x (+0 %)")


def test_live_page_failed_run_shows_the_error(home: Path) -> None:
    st = store_at(home)
    seed_run(st, "broken", "failed", upto=100)
    at = app("live")
    no_exception(at)
    assert any("RuntimeError: boom" in e.value for e in at.error)
    assert at.button(key="stop").disabled
    gone = st.create_run("gone", config("gone"), "running")
    st.set_status(gone, "crashed", "crashed: its process is gone and it reported no final "
                                   "status")
    at.run()  # the new run among the options
    at.selectbox(key="live-run").set_value(gone).run()
    (said,) = [e.value for e in at.error if "process is gone" in e.value]
    assert said.count("crashed") == 1  # the status once, not "crashed: crashed:"


def test_a_link_to_a_run_the_store_does_not_hold_says_so(home: Path) -> None:
    """``?run=`` naming no run (an old or mistyped link): the page says so above the
    newest run it shows, keeps the link's id while it refreshes (the notice stays), and
    drops both once a run is picked."""
    st = store_at(home)
    older = seed_run(st, "older", upto=100)
    newest = seed_run(st, "newest", upto=100)
    at = AppTest.from_file(HOME, default_timeout=TIMEOUT).run()
    at.switch_page(PAGES["live"])
    at.query_params["run"] = "doesnotexist"
    at.run()
    no_exception(at)
    (notice,) = [w.value for w in at.warning if "doesnotexist" in w.value]
    assert "No run `doesnotexist` in the run store" in notice and "newest" in notice
    assert at.selectbox(key="live-run").value == newest
    at.run()  # a refresh: the link and its notice stay
    assert "doesnotexist" in str(at.query_params["run"])
    assert any("doesnotexist" in w.value for w in at.warning)
    at.selectbox(key="live-run").set_value(older).run()
    assert not any("doesnotexist" in w.value for w in at.warning)
    assert older in str(at.query_params["run"])


def test_stop_button_stops_and_enables_resume(home: Path) -> None:
    st = store_at(home)
    rid = st.create_run("waiting", config("waiting"), "queued")
    at = app("live")
    assert at.selectbox(key="live-run").value == rid
    assert not at.button(key="stop").disabled
    at.button(key="stop").click().run()
    no_exception(at)
    assert st.get_run(rid)["status"] == "stopped"
    launched_folder(st, rid)  # stopped before its first checkpoint: resumes from the start
    at.run()
    assert "stopped" in texts(at)
    assert "Resume: continue the stopped run from its start" in texts(at)  # said, not hidden
    assert at.button(key="stop").disabled and not at.button(key="resume").disabled


def test_resume_button_resumes_a_stopped_run(home: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    st = store_at(home)
    rid = seed_run(st, "paused", "stopped", upto=200)
    launched_folder(st, rid, checkpoint_at=200)
    calls: list[str] = []

    def fake_resume(run_id: str, store: RunStore | None = None) -> str:
        calls.append(run_id)
        store.set_status(run_id, "queued", only_from=("stopped",))
        return run_id

    monkeypatch.setattr("comera_engine.launch.resume", fake_resume)
    at = app("live")
    assert at.button(key="stop").disabled and not at.button(key="resume").disabled
    at.button(key="resume").click().run()
    no_exception(at)
    assert calls == [rid] and st.get_run(rid)["status"] == "queued"
    assert "Refreshing every 1 s" in texts(at)


def test_a_run_that_failed_is_offered_resume_only_from_a_checkpoint(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed run is offered Resume only where a resume can work: from a checkpoint
    that reads back. One that failed before its first checkpoint (the mnli preset's run,
    its data unreachable) was offered it, and a resume would only start it afresh into
    the same failure: the button is disabled and says to launch it again, as the
    launcher's resume refuses it. A crashed one (killed) starts afresh."""
    from app.lib import runs as runs_lib
    from comera_engine.launch import LaunchError, resume

    st = store_at(home)
    rid = st.create_run("mnli · 20×", config("mnli"), "running")
    st.set_status(rid, "failed", "ConnectionError: the hub is unreachable")
    folder = launched_folder(st, rid)
    at = app("live")
    no_exception(at)
    resume_button = at.button(key="resume")
    assert resume_button.disabled and "before its first checkpoint" in resume_button.help
    assert any("Not resumable" in c.value and "launch it again" in c.value
               for c in at.caption)
    with pytest.raises(LaunchError, match=f"^run: {rid} failed before its first checkpoint"):
        resume(rid, store=st)  # the same rule, the same words
    assert st.get_run(rid)["status"] == "failed"
    st.update_run(rid, status="crashed")
    assert runs_lib.resume_offer(st, st.get_run(rid)) == (
        True, "Continue the crashed run from its start (it crashed before its first "
              "checkpoint).")
    st.update_run(rid, status="failed")
    launched_folder(st, rid, checkpoint_at=300)  # the trainer had written one
    at.run()
    resume_button = at.button(key="resume")
    assert not resume_button.disabled and "step_000300" in resume_button.help
    assert not any("Not resumable" in c.value for c in at.caption)
    calls: list[str] = []
    monkeypatch.setattr("comera_engine.launch.resume",
                        lambda run_id, store=None: calls.append(run_id) or run_id)
    at.button(key="resume").click().run()
    assert calls == [rid]
    # the verdict is kept while nothing in the folder changes: a page pass hashes nothing
    from comera_engine.store import layout

    hashed: list[object] = []
    sha256 = layout.file_sha256
    monkeypatch.setattr(layout, "file_sha256", lambda p: hashed.append(p) or sha256(p))
    runs_lib._OFFERS.clear()
    assert runs_lib.resume_offer(st, st.get_run(rid))[0] and len(hashed) == 1
    assert runs_lib.resume_offer(st, st.get_run(rid))[0] and len(hashed) == 1
    # a damaged checkpoint is no resume point (bytes changed in place, or cut short); a
    # stopped run resumes without one
    ckpt = folder / "checkpoints" / "step_000300.safetensors"
    flipped = bytearray(ckpt.read_bytes())
    flipped[-1] ^= 0xFF
    ckpt.write_bytes(bytes(flipped))
    offered, why = runs_lib.resume_offer(st, st.get_run(rid))
    assert not offered and "checksum mismatch" in why and len(hashed) == 2
    ckpt.write_bytes(ckpt.read_bytes()[:-2])
    offered, why = runs_lib.resume_offer(st, st.get_run(rid))
    assert not offered and why.startswith("The run has no checkpoint that reads back")
    ckpt.unlink()
    st.update_run(rid, status="stopped")
    assert runs_lib.resume_offer(st, st.get_run(rid))[0]
    (folder / "config.toml").unlink()  # what the launcher's resume starts from
    assert runs_lib.resume_offer(st, st.get_run(rid)) == (
        False, "The run has no config.toml in its folder to resume from.")


def test_live_page_on_a_gpu_run(home: Path) -> None:
    st = store_at(home)
    rid = st.create_run("gpu-run", config("gpu-run"), "running", device="cuda", gpus="1")
    t = time.time()
    st.write_batch(rid, metrics=[
        (s, n, v, t) for s in range(1, 50) for n, v in (
            ("loss/task", 1.0 / s), ("mem/gpu_used_mb", 9000.0 + s),
            ("mem/gpu_total_mb", 81559.0), ("mem/cuda_max_allocated_mb", 2100.0),
            ("mem/cuda_max_reserved_mb", 2600.0), ("perf/tokens_per_s", 1.2e5))
    ])
    st.write_batch(rid, metrics=[(s, "sys/gpu_util_percent", 80.0 + s, t) for s in (10, 20)])
    st.heartbeat(rid)
    at = app("live")
    no_exception(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Peak GPU memory (allocated)"] == "2.05 GiB" and "Tokens / s" in metrics
    tile = next(m for m in at.metric if m.label == "Peak GPU memory (allocated)")
    assert tile.proto.delta == "device 8.84 GiB used" and "max_memory_allocated" in tile.help
    mem = {tr["name"] for tr in live_charts(at)["ch-mem"]["data"] if tr.get("name")}
    assert mem == {"GPU memory used (device)", "Peak GPU memory (allocated)",
                   "Peak GPU memory (reserved)"}
    # the GPU panel: what the trainer read (utilisation from NVML, memory of the device)
    gpu = {tr["name"]: tr for tr in live_charts(at)["ch-gpu"]["data"] if tr.get("name")}
    assert list(gpu["GPU utilisation %"]["y"]) == [90.0, 100.0]
    used = list(gpu["GPU memory used % (of the device)"]["y"])
    assert used[0] == pytest.approx(100 * 9001.0 / 81559.0)
    assert used[-1] == pytest.approx(100 * 9049.0 / 81559.0)
    assert "GPU 1" in texts(at) and "trains on the CPU" not in texts(at)


def test_tiles_are_wide_enough_for_their_values(home: Path) -> None:
    """On a 1024 px screen with the sidebar open a tile's value fits on one line: the
    Live page's six tiles come in two rows of three (six side by side were 81 px wide
    there, and "430 MiB" or "0.1031" took two lines), the New experiment's preview (half
    the page) and Learn's TT-SVD (a long rank list) in rows of two, and every page's style
    shrinks a value's type with its tile."""
    seed_run(store_at(home))
    at = app("live")
    no_exception(at)
    rows = tile_rows(at)
    assert rows == [["Step", "Task loss", "Eval accuracy"],
                    ["Compression (TT layers)", "Samples / s", "Process memory (RSS)"]], rows
    at = app("new")
    no_exception(at)
    assert [len(row) for row in tile_rows(at)] == [2, 2]
    at = app("learn")
    no_exception(at)
    assert tile_rows(at)[:2] == [["Parameters", "Compression"], ["Relative error", "Ranks"]]
    assert max(len(row) for row in tile_rows(at)) <= 4
    (style,) = [h.proto.body for h in at.get("html") if "stMetricValue" in h.proto.body]
    assert "container-type: inline-size" in style and "cqi" in style


def test_each_memory_figure_has_one_label_everywhere(home: Path) -> None:
    """"Peak memory" meant three things on three pages (the Sweeps page: GPU allocated or
    the last process RSS; Compare: GPU allocated or a model + optimizer estimate; the
    Live tile: the device's used memory). Each quantity has its own label, the same on
    every page, with what it measures beside it; no page says just "peak memory"."""
    from app.lib import fmt
    from tests.test_app_sweeps import seed_sweep

    labels = [fmt.memory_label(k) for k in fmt.MEMORY]
    assert len(set(labels)) == len(labels)
    st = store_at(home)
    cpu = seed_run(st, "cpu-run")  # process RSS logged
    gpu = st.create_run("gpu-run", config("gpu-run"), "running", device="cuda", gpus="0")
    st.write_batch(gpu, metrics=[(s, n, v, time.time()) for s in (1, 2) for n, v in (
        ("mem/cuda_max_allocated_mb", 2100.0), ("mem/gpu_used_mb", 9000.0),
        ("eval/acc", 0.9), ("compression/tensorized", 20.0))])
    st.set_status(gpu, "finished")
    sid, cells = seed_sweep(st)
    for rid in cells:  # a CPU sweep: its cells' memory is their process RSS
        st.write_batch(rid, metrics=[(100, "mem/rss_mb", 500.0, time.time())])
    shown: dict[str, set[str]] = {}  # label -> the pages that show it

    def open_page(page: str, **query: str) -> AppTest:
        at = AppTest.from_file(HOME, default_timeout=TIMEOUT).run()
        at.switch_page(PAGES.get(page, f"views/{page}.py"))
        at.query_params.update(query)
        at.run()
        no_exception(at)
        words = texts(at) + " ".join(
            str(c) for d in at.dataframe for c in d.value.columns) + " ".join(
            f"{m.label} {m.help}" for m in at.metric) + json.dumps(page_figures(at))
        assert "peak memory" not in words.lower() and "torch peak" not in words, page
        for kind in fmt.MEMORY:
            if fmt.memory_label(kind) in words:
                shown.setdefault(kind, set()).add(page)
        return at

    for rid, kind in ((cpu, "rss"), (gpu, "gpu_peak")):
        at = open_page("live", run=rid)
        (tile,) = [m for m in at.metric if m.label == fmt.memory_label(kind)]
        assert tile.help == fmt.memory_help(kind)
    at = open_page("new")
    (tile,) = [m for m in at.metric if m.label == fmt.memory_label("estimate")]
    assert tile.help == fmt.memory_help("estimate")
    at = open_page("compare")
    at.multiselect(key="cmp-runs").set_value([cpu, gpu]).run()
    final = at.dataframe[0].value.set_index("run")
    gpu_row = f"gpu-run ({gpu[-4:]})"
    assert final.loc[gpu_row, fmt.memory_label("gpu_peak")] == "2.05 GiB"
    assert final.loc[gpu_row, fmt.memory_label("model_state")] == ""
    at = open_page("sweeps", sweep=sid)
    groups = at.dataframe[0].value
    assert set(groups[fmt.memory_label("rss")]) == {"500 MiB"}
    assert fmt.memory_label("gpu_peak") not in groups.columns
    assert shown["rss"] >= {"live", "sweeps"} and shown["gpu_peak"] >= {"live", "compare"}
    assert shown["estimate"] == {"new"} and "model_state" in shown


def test_new_experiment_lists_gpus_and_launches_on_one(home: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import streamlit as st_mod

    from app.lib.devices import GPU

    st_mod.cache_data.clear()
    gpus = [GPU(0, "NVIDIA H100", 81559.0), GPU(1, "Tiny GPU", 0.1)]
    monkeypatch.setattr("app.lib.devices.list_gpus", lambda: gpus)
    fake = FakeLaunch()
    seen: dict[str, object] = {}

    def launch(config, overrides=(), store=None, name=None, gpus=None, **kw) -> str:
        seen.update(gpus=gpus, device=config["train"]["device"])
        return fake(config, store=store)

    monkeypatch.setattr("comera_engine.launch.launch", launch)
    try:
        at = app("new")
        assert at.selectbox(key="device").options == [
            "CPU", "GPU 0: NVIDIA H100 (80 GiB)", "GPU 1: Tiny GPU (0 GiB)"]
        at.selectbox(key="device").set_value("cuda:1").run()
        assert any("exceeds 90% of GPU 1" in e.value for e in at.error)
        assert at.button(key="launch").disabled
        at.selectbox(key="device").set_value("cuda:0").run()
        # the form has no error (the sweep's per-cell check, run on this machine, may say
        # it has no CUDA: these GPUs are pretend)
        assert not [e for e in at.error if "(cell " not in e.value]
        assert not any("CUDA Graphs need a GPU" in c.value for c in at.caption)
        at.button(key="launch").click().run()
        no_exception(at)
        assert seen == {"gpus": "0", "device": "cuda"}
    finally:
        st_mod.cache_data.clear()


# ------------------------------------------------------------------ compare


def test_compare_page(home: Path) -> None:
    st = store_at(home)
    seed_run(st, "tt-20x", target=20.0, acc=0.93, comp=24.0)
    seed_run(st, "tt-50x", target=50.0, acc=0.90, comp=50.0)
    seed_run(st, "dense", dense=True, acc=0.95)
    at = app("compare")
    no_exception(at)
    assert len(at.multiselect(key="cmp-runs").value) == 3
    # accuracy vs compression, vs bytes, vs training memory; the metric chart
    assert len(at.get("plotly_chart")) == 5
    final, diff = at.dataframe[0].value, at.dataframe[1].value
    assert len(final) == 3 and bool(final["dense"].any())
    assert {"model.dense", "comera.target_compression"} <= set(diff["field"])
    assert "No dense baseline" not in texts(at)
    at.selectbox(key="cmp-m1").set_value("compression/tensorized").run()
    no_exception(at)
    # the picker names metrics in words, not by their keys
    picker = at.selectbox(key="cmp-m1")
    assert "Compression (TT layers)" in picker.options and not any(
        re.fullmatch(r"[a-z_]+/[a-z_]+", o) for o in picker.options)
    # one compression figure per run, with its scope (the target's): the seeded TT runs
    # log 24x / 50x on the TT layers (0.6 of that on the whole model); the dense
    # baseline has no TT layers: 1x of the whole model
    assert sorted(zip(final["compression"], final["scope"])) == [
        (1.0, "whole model"), (24.0, "TT layers"), (50.0, "TT layers")]
    # which method trained each run
    assert sorted(final["method"]) == ["CoMERA, schedule paced"] * 2 + ["dense baseline"]
    # throughput: the median over each run's steps, not its last step's figure
    import statistics

    logged = [500.0 + s % 7 for s in range(1, 601, 5)]
    assert statistics.median(logged) != logged[-1]
    assert list(final["samples/s"]) == [statistics.median(logged)] * 3
    # accuracy in percent (issue 46 item 3), and the memory the method changes on a CPU:
    # the model and its optimizer state, not the ~400 MiB of process RSS seeded
    assert sorted(final["eval acc"]) == pytest.approx(sorted(
        100 * a * 501 / 600 for a in (0.93, 0.90, 0.95)))  # the last eval, step 501
    st.write_batch(st.list_runs()[0]["id"], metrics=[(1, "params/allocated", 2**20, time.time())])
    at = app("compare")
    final = at.dataframe[0].value
    row = final[final["Model + optimizer memory (estimate)"] != ""]
    assert list(row["Model + optimizer memory (estimate)"]) == ["16 MiB"]  # 2**20 x 16 B
    assert set(final["Peak GPU memory (allocated)"]) == {""}  # no run trained on a GPU
    specs = [json.loads(c.proto.spec)["layout"] for c in at.get("plotly_chart")]
    # the plot is titled by the quantity it plots, not by the New experiment page's
    # "Estimated training memory" (another quantity)
    (mem,) = [s for s in specs if "optimizer memory" in str(s.get("title"))]
    assert "Accuracy vs model + optimizer memory (estimate)" in str(mem["title"])
    assert "training memory" not in json.dumps(specs)
    assert mem["xaxis"]["title"]["text"].startswith("Model + optimizer memory (estimate) (MiB")


def test_compare_downloads_the_compared_runs_metrics_as_one_csv(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compare offers the compared runs' metrics as one CSV, read when the button is
    pressed: a row per run and step, the run's id and name, then each metric as the store
    holds it (a metric not logged at a step blank); a run not compared is not in it."""
    import csv
    import io

    from streamlit.runtime.media_file_manager import MediaFileManager

    st = store_at(home)
    tt = seed_run(st, "tt-20x", steps=100, upto=100)
    dense = seed_run(st, "dense", steps=100, upto=50, dense=True)
    seed_run(st, "not compared", steps=100, upto=100)
    served: dict[str, tuple] = {}  # the deferred downloads the page registers, by id
    real = MediaFileManager.add_deferred

    def record(self, data, mimetype, coordinates, file_name=None, **kw):  # noqa: ANN001, ANN202
        file_id = real(self, data, mimetype, coordinates, file_name=file_name, **kw)
        served[file_id] = (data, mimetype, file_name)
        return file_id

    monkeypatch.setattr(MediaFileManager, "add_deferred", record)
    at = app("compare")
    at.multiselect(key="cmp-runs").set_value([tt, dense]).run()
    no_exception(at)
    (button,) = [b for b in at.get("download_button") if b.proto.id.endswith("cmp-dl-csv")]
    data, mimetype, file_name = served[button.proto.deferred_file_id]
    assert (mimetype, file_name) == ("text/csv", f"compare-{tt[-4:]}-{dense[-4:]}-metrics.csv")
    table = list(csv.DictReader(io.StringIO(data())))
    assert list(table[0])[:3] == ["run", "name", "step"]
    assert {(r["run"], r["name"]) for r in table} == {(tt, "tt-20x"), (dense, "dense")}
    # every metric of both runs at every step it was logged, as the store holds it
    for rid in (tt, dense):
        rows = {int(r["step"]): r for r in table if r["run"] == rid}
        for name in st.metric_names(rid):
            logged = st.series(rid, name, max_points=10_000)
            assert [float(rows[s][name]) for s in logged["step"]] == pytest.approx(
                logged["value"]), (rid, name)
            assert sum(rows[s][name] != "" for s in rows) == len(logged["step"]), (rid, name)
    assert len(table) == len(range(1, 101, 5)) + len(range(1, 51, 5))
    assert "lr/gates" not in st.metric_names(dense)
    assert all(r["lr/gates"] == "" for r in table if r["run"] == dense)


def test_compare_diffs_the_configs_as_the_engine_reads_them(home: Path) -> None:
    """Compare's config diff is of the configs with their defaults filled in: the
    embedded default states ``data.split_fraction = 0.8`` and a shipped TOML leaves it to
    that default (it read "— vs 0.8"), and an unset ``model.rank`` of a run with a target
    reads "from the target" (it read "—")."""
    from app.lib.defaults import default_config

    st = store_at(home)
    stated = default_config()
    left = default_config()
    del left["data"]["split_fraction"]  # as digits_tt_mlp_paper.toml: the default
    fixed = default_config()
    fixed["model"]["rank"] = 6
    t = time.time()
    for name, cfg in (("stated", stated), ("left", left), ("fixed", fixed)):
        rid = st.create_run(name, {**cfg, "name": name}, "running")
        st.write_batch(rid, metrics=[(1, "loss/task", 1.0, t)])
        st.set_status(rid, "finished")
    at = app("compare")
    no_exception(at)
    diff = at.dataframe[1].value
    assert set(diff["field"]) == {"name", "model.rank"}
    (rank,) = diff[diff["field"] == "model.rank"].to_dict("records")
    assert sorted(v for k, v in rank.items() if k != "field") == [
        "6", "from the target", "from the target"]
    assert any("with its defaults filled in" in c.value for c in at.caption)


def test_config_fields_fill_defaults_and_say_where_an_unset_rank_comes_from() -> None:
    """The fields Compare diffs: every default filled in by the engine's config reading
    (and the dataset's), an unset rank "from the target" only where the run chooses it
    so; a config the engine does not read is listed as stored."""
    from app.lib.runs import FROM_TARGET, config_fields

    tt = config(target=20.0)
    del tt["model"]["rank"]
    fields = config_fields(tt)
    assert fields["model.rank"] == FROM_TARGET and "model.embedding_rank" not in fields
    assert (fields["data.seed"], fields["train.lr"], fields["comera.schedule"]) == (
        0, 1e-3, "paced")
    assert config_fields(config(rank=8))["model.rank"] == 8
    for change in ({"schedule": "paper"}, {"ranks_from_target": False}):  # the preset's
        assert "model.rank" not in config_fields({**tt, "comera": {**tt["comera"], **change}})
    assert "model.rank" not in config_fields({**tt, "model": {**tt["model"], "dense": True}})
    assert "model.rank" not in config_fields(config(target=None) | {"model": tt["model"]})
    fixed = {**tt, "comera": {**tt["comera"], "method": "fixed", "schedule": "paper"}}
    assert config_fields(fixed)["model.rank"] == FROM_TARGET
    old = {**tt, "comera": {**tt["comera"], "retired_key": 1}}
    assert config_fields(old)["comera.retired_key"] == 1  # as stored, nothing filled in
    assert "train.lr" not in config_fields(old)


def test_a_dense_baseline_is_stated_as_the_whole_dense_model(home: Path) -> None:
    """A dense baseline has no TT layers: Overview, Compare and Live state its
    compression as the whole model's, 1× (it read "1.0×" on the "TT layers" scope), from
    the config the store holds; the TT runs keep their TT-layer figure."""
    st = store_at(home)
    seed_run(st, "tt-20x", target=20.0, comp=24.0)
    dense = seed_run(st, "dense", dense=True)
    at = app()
    no_exception(at)
    table = at.dataframe[0].value
    scope = dict(zip(table["name"], table["scope"]))
    comp = dict(zip(table["name"], table["compression"]))
    assert scope == {"tt-20x": "TT layers", "dense": "whole model"}
    assert comp == {"tt-20x": 24.0, "dense": 1.0}
    at.switch_page(PAGES["compare"]).run()
    no_exception(at)
    final = at.dataframe[0].value
    assert sorted(zip(final["scope"], final["compression"])) == [("TT layers", 24.0),
                                                                  ("whole model", 1.0)]
    # the axis is the TT runs' scope: the dense model is 1× in any (its own mark)
    (pareto,) = [json.loads(c.proto.spec)["layout"] for c in at.get("plotly_chart")
                 if "Accuracy vs compression" in c.proto.spec]
    assert pareto["xaxis"]["title"]["text"] == "compression vs dense (TT layers; ×, log)"
    at = app("live")
    at.selectbox(key="live-run").set_value(dense).run()
    no_exception(at)
    (tile,) = [m for m in at.metric if m.label.startswith("Compression")]
    assert (tile.label, tile.value, tile.proto.delta) == (
        "Compression (whole model)", "1.0×", "dense model")
    assert "(TT layers)" not in " ".join(m.label for m in at.metric)


# ------------------------------------------------------------------ export (real run)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A real 40-step digits run through the launcher (supervisor + trainer)."""
    from app.lib.defaults import default_config
    from comera_engine.launch import launch

    h = tmp_path_factory.mktemp("trained") / "home"
    st = RunStore(h / "comera.db")
    cfg = default_config()
    cfg["train"].update(steps=40, eval_every=20, ckpt_every=20)
    cfg["comera"]["switch"] = 20
    rid = launch(cfg, store=st)
    deadline = time.time() + 150
    while time.time() < deadline:
        run = st.get_run(rid)
        if run["status"] not in ("queued", "running", "stopping"):
            break
        time.sleep(0.5)
    run = st.get_run(rid)
    if run["status"] != "finished":
        pytest.fail(f"training run ended {run['status']}: {run['error']}")
    return h, rid


@pytest.fixture()
def trained_home(trained: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
                 ) -> tuple[Path, str]:
    """:func:`trained`'s store in ``COMERA_HOME``; the app runs from the repository root."""
    h, _ = trained
    monkeypatch.setenv("COMERA_HOME", str(h))
    monkeypatch.chdir(ROOT)
    return trained


def test_export_page_exports_a_real_checkpoint(trained_home: tuple[Path, str]) -> None:
    h, rid = trained_home
    at = app("export")
    no_exception(at)
    assert at.selectbox(key="exp-run").value == rid
    assert at.selectbox(key="exp-ckpt").options
    assert set(at.radio(key="exp-format").options) >= {"Compressed TT", "Dense", "ONNX"}
    assert not at.get("download_button")
    at.button(key="exp-go").click().run()
    no_exception(at)
    downloads = at.get("download_button")
    assert len(downloads) >= 2  # the model and its card
    # the card loads the file by the name it is downloaded as (issue 46)
    assert any(f'comera_engine.load("digits-tt-mlp-{rid}-step40.safetensors")' in m.value
               for m in at.markdown)
    # the page and the card name the file as it arrives, not as the store keeps it
    assert any(m.value.endswith(f"`digits-tt-mlp-{rid}-step40.safetensors`")
               for m in at.markdown if m.value.startswith("####"))
    card = next(m.value for m in at.markdown if m.value.startswith("# Model card"))
    assert f"**File**: `digits-tt-mlp-{rid}-step40.safetensors`" in card
    assert "`model.safetensors`" not in card
    exports = RunStore(h / "comera.db").artifacts(rid, kind="export_compressed")
    assert exports and exports[0]["exists"]
    assert Path(exports[0]["path"]).resolve().is_relative_to(h.resolve())
    # int8 from the page, as `comera export --dtype int8` (issue 46): a file of its own
    at.radio(key="exp-dtype").set_value("int8").run()
    at.button(key="exp-go").click().run()
    no_exception(at)
    exports = RunStore(h / "comera.db").artifacts(rid, kind="export_compressed")
    int8 = [Path(a["path"]) for a in exports if Path(a["path"]).name == "model.int8.safetensors"]
    assert int8 and int8[0].is_file() and Path(exports[0]["path"]).is_file()
    from comera_engine.export import read_metadata

    assert read_metadata(int8[0])["storage"]["dtype"] == "int8"
    assert any(f"digits-tt-mlp-{rid}-step40.int8.safetensors" in m.value for m in at.markdown)


def test_a_dense_export_describes_the_dense_file(trained_home: tuple[Path, str]) -> None:
    """A CoMERA run exported in the dense format: the tiles describe the file (its
    bytes, 1× against dense), not the run's compression (its compressed export's tile
    and card state it), which is named as the Compressed TT format's."""
    at = app("export")
    at.button(key="exp-go").click().run()
    no_exception(at)
    (run_tile,) = [m for m in at.metric if m.label == "Compression (TT layers)"]
    assert run_tile.value not in ("1.0×", "–")
    at.radio(key="exp-format").set_value("dense").run()
    at.button(key="exp-go").click().run()
    no_exception(at)
    tiles = {m.label: m for m in at.metric}
    assert "Compression (TT layers)" not in tiles
    dense = tiles["Compression (this dense file)"]
    assert dense.value == "1.0×"
    assert dense.proto.delta == f"compressed TT: {run_tile.value} (TT layers)"
    assert tiles["File bytes vs dense model bytes"].value == "1.0×"
    assert run_tile.value not in {m.value for m in at.metric}
    assert any(f"{run_tile.value} (TT layers), applies to the **Compressed TT** format" in c.value
               for c in at.caption)


def test_earlier_exports_list_each_file_once_by_its_download_name(home: Path) -> None:
    """An export made twice rewrites its file: Earlier exports lists it once (it was
    listed per export, the same file twice), each file by the name it downloads as (all
    read ``model.safetensors``, whichever checkpoint they came from)."""
    st = store_at(home)
    rid = seed_run(st, "digits")
    folder = launched_folder(st, rid, checkpoint_at=600)
    files = []
    for step, name in ((300, "model.safetensors"), (600, "model.safetensors"),
                       (600, "model.int8.safetensors")):
        f = folder / "exports" / f"step_{step:06d}" / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x" * 8)
        files.append(f)
    for f in (files[0], files[1], files[2], files[1]):  # the step-600 file made again
        st.log_artifact(rid, "export_compressed", f)
    at = app("export")
    no_exception(at)
    rows = [m.value.split(" · ")[0] for m in at.markdown if " · compressed · " in m.value]
    assert rows == [f"`digits-{rid}-step600.safetensors`",
                    f"`digits-{rid}-step600.int8.safetensors`",
                    f"`digits-{rid}-step300.safetensors`"]


#: A compression figure with its scope, as every place writes it: "60.6× (TT layers)",
#: "60.6x (TT layers)"; a tile says its scope in its label.
FIGURE = re.compile(r"(∞|\d[\d,]*\.\d)\s?[×x]\)?,?\s?\((TT layers|whole model)\)")


def test_one_compression_figure_per_scope_everywhere(trained_home: tuple[Path, str],
                                                      tmp_path: Path, capsys) -> None:
    """Issue 46 item 3: every compression figure a finished run shows (the Live tile, the
    trainer's log, `comera export`'s line, the Export page, the model card) is one
    number per scope, each written with its scope; the bytes ratio is named as such."""
    from comera_engine.cli import main
    from comera_engine.launch import logs

    h, rid = trained_home
    seen: dict[str, dict[str, set[str]]] = {}

    def read(source: str, text: str) -> None:
        found = FIGURE.findall(text)
        assert found, f"no compression figure with its scope in the {source}: {text!r}"
        for value, scope in found:
            seen.setdefault(scope, {}).setdefault(value, set()).add(source)

    def tiles(at: AppTest) -> str:
        return " ".join(f"{m.value} ({m.label.split('(', 1)[1]}" for m in at.metric
                        if m.label.startswith("Compression ("))

    at = app("live")
    no_exception(at)
    read("Live tiles", tiles(at))
    log = logs(rid, store=h / "comera.db")
    assert "smaller" not in log and "vs dense" not in log  # the old unnamed figures
    read("trainer log (its last bar)", [line for line in log.splitlines()
                                        if FIGURE.search(line)][-1])
    assert main(["export", rid, "--out", str(tmp_path / "m.safetensors")]) == 0
    out = capsys.readouterr().out.splitlines()
    line = next(x for x in out if x.startswith("compression "))
    assert "file bytes vs dense model bytes" in line
    read("comera export line", line)
    card = Path(next(x for x in out if x.startswith("model card ")).removeprefix("model card "))
    read("model card", card.read_text(encoding="utf-8"))
    at = app("export")
    at.button(key="exp-go").click().run()
    no_exception(at)
    read("Export page", tiles(at))
    assert any(m.label == "File bytes vs dense model bytes" for m in at.metric)
    assert set(seen) == {"TT layers", "whole model"}
    for scope, values in seen.items():
        assert len(values) == 1, f"{scope}: {values}"  # one number, wherever it is read
    (sources,) = seen["TT layers"].values()  # the run's scope: in every place
    assert sources == {"Live tiles", "trainer log (its last bar)", "comera export line",
                       "model card", "Export page"}


@pytest.mark.usefixtures("trained_home")
def test_live_and_compare_pages_on_a_real_run() -> None:
    at = app("live")
    no_exception(at)
    assert {m.label: m.value for m in at.metric}["Step"] == "40"
    assert "finished" in texts(at)
    at.switch_page(PAGES["compare"]).run()
    no_exception(at)
    at.switch_page(PAGES["export"]).run()
    no_exception(at)


# ------------------------------------------------------------------ library pieces


def test_preview_matches_size_report() -> None:
    import torch

    from comera_engine import size_report
    from comera_engine.launch import resolve_config
    from comera_engine.models import build_model
    from comera_engine.preview import data_shape, make_preview

    cfg = resolve_config(config(target=40.0))
    pv = make_preview(cfg, "cpu")
    torch.manual_seed(0)
    rep = size_report(build_model(cfg.model, data_shape(cfg.data)))
    by_name = {row["name"]: row for row in rep["layers"]}
    assert [layer.name for layer in pv.layers] == list(by_name)
    for layer in pv.layers:
        assert layer.tt_params == by_name[layer.name]["allocated_params"]
        assert layer.dense_params == by_name[layer.name]["dense_params"]
    assert pv.alloc_total == rep["model"]["allocated_params"]
    assert pv.dense_total == rep["model"]["dense_params"]
    # at the target the TT layers fit the budget
    assert pv.target_tt <= pv.dense_tt / 40.0
    assert pv.compression("target") >= 40.0
    assert pv.tt_macs < pv.dense_macs


def test_presets_always_include_the_embedded_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from app.lib import presets
    from app.lib.defaults import DEFAULT_CONFIG_TOML, DEFAULT_PRESET, default_config
    from comera_engine.launch import resolve_config

    monkeypatch.setattr(presets, "config_dirs", lambda: [])
    found = presets.load_presets()
    assert list(found) == [DEFAULT_PRESET]
    assert resolve_config(default_config()).model.name == "tt_mlp"
    repo_copy = ROOT / "experiments" / "configs" / f"{DEFAULT_PRESET}.toml"
    if repo_copy.is_file():  # the embedded copy stays the repository's default
        import tomllib

        assert tomllib.loads(DEFAULT_CONFIG_TOML) == tomllib.loads(repo_copy.read_text())


def test_config_diff_and_token() -> None:
    from app.lib.runs import config_diff, config_token

    a, b = config(target=20.0), config(target=50.0, dense=True)
    fields = {row["field"] for row in config_diff({"a": a, "b": b})}
    assert fields == {"comera.target_compression", "model.dense"}
    assert config_token("n", a) == config_token("n", json.loads(json.dumps(a)))
    assert config_token("n", a) != config_token("n", b) != config_token("m", b)


def test_run_app_command_binds_localhost(tmp_path: Path) -> None:
    from app import launcher

    cmd = launcher.streamlit_command()
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--server.port") + 1] == "8501"
    assert cmd[cmd.index("run") + 1].endswith("app/Home.py")
    with pytest.raises(ValueError, match="port"):
        launcher.streamlit_command(port=0)
    env = launcher.app_env(tmp_path / "store" / "comera.db")
    assert env["COMERA_HOME"] == str((tmp_path / "store").resolve())
    assert str(ROOT) in env["PYTHONPATH"].split(":")


def test_streamlit_config_is_local_and_private() -> None:
    import tomllib

    cfg = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    assert cfg["server"]["address"] == "127.0.0.1"
    assert cfg["server"]["port"] == 8501
    assert cfg["server"]["headless"] is True
    assert cfg["browser"]["gatherUsageStats"] is False
    # an unexpected exception's message and traceback (server paths) stay on the console
    assert cfg["client"]["showErrorDetails"] == "type"


def test_the_browser_is_shown_server_paths_outside_the_store_by_file_name(tmp_path) -> None:
    """An engine message or a model card naming a server file in full (a config's data
    file, a run folder elsewhere) is shown by the file's name; a path in the run store,
    a URL, a ratio or a unit are left as they are."""
    from app.lib.fmt import server_paths_hidden

    store = tmp_path / "store"
    (store / "run1").mkdir(parents=True)
    text = (f"data.train: file not found: {tmp_path}/own/data/train.csv (give a CSV). "
            f'"dir": "/home/ann/runs/r7/", `{tmp_path}/cfg.toml`; kept: {store}/run1/m.onnx, '
            "http://127.0.0.1:8501/live, 10 MB/s, 1/3 of it")
    shown = server_paths_hidden(text, store)
    assert shown == ("data.train: file not found: train.csv (give a CSV). "
                     '"dir": "r7", `cfg.toml`; kept: ' + f"{store}/run1/m.onnx, "
                     "http://127.0.0.1:8501/live, 10 MB/s, 1/3 of it")
    assert str(tmp_path / "own") not in shown


def test_rank_heatmap_rows_span_the_run() -> None:
    from app.lib.plots import ema, rank_rows

    hist = [{"step": 1, "layer": "a", "ranks": [4, 8]}, {"step": 10, "layer": "a", "ranks": [3, 8]},
            {"step": 1, "layer": "b", "ranks": [8]}]
    rows, edges, z = rank_rows(hist, until=30)
    assert rows == ["a · bond 1", "a · bond 2", "b · bond 1"]
    assert edges == [1, 10, 30]
    assert z == [[4.0, 3.0], [8.0, 8.0], [8.0, 8.0]]  # b forward-filled
    assert ema([1.0, None, 3.0], 0.5)[0] == 1.0 and ema([1.0, None, 3.0], 0.5)[1] is None


def test_a_chart_grows_by_its_legend_rows_instead_of_squashing_its_plot() -> None:
    """Compare's curves for many runs: a legend below the chart took the plot's height
    (71 px of 300 left for 6 runs' names); the chart grows by the rows past the first, so
    the plot keeps its height; one or two short names change nothing."""
    from app.lib.plots import LEGEND_ROW_PX, legend_rows, lines_spec

    x, y = [1, 2, 3], [1.0, 2.0, 3.0]
    names = [f"digits-tt-mlp · {t}× · seed {s}" for t in (5, 10, 30) for s in (0, 1)]
    assert legend_rows(names) >= 3
    many = lines_spec([(n, x, y) for n in names], "loss")["layout"]["height"]
    assert many == 300 + LEGEND_ROW_PX * (legend_rows(names) - 1)
    assert lines_spec([("a", x, y), ("b", x, y)], "loss")["layout"]["height"] == 300
    assert lines_spec([(names[0], x, y)], "loss")["layout"]["height"] == 300


def test_a_smoothed_loss_on_a_log_axis_follows_the_typical_step() -> None:
    """A loss at 1e-6 with one step in 15 spiking to 0.05 (what a run near zero loss
    logs): on the log axis the smoothed line is a geometric mean and stays within a
    decade or two of the typical step; an average of the values sat near the spikes.
    On a linear axis the average is kept."""
    from app.lib.plots import lines_spec

    x = list(range(300))
    y = [0.05 if i % 15 == 0 else 1e-6 for i in x]
    log_line = lines_spec([("run", x, y)], "loss", log_y=True, smooth=0.1)["data"][-1]["y"]
    lin_line = lines_spec([("run", x, y)], "loss", smooth=0.1)["data"][-1]["y"]
    median = sorted(y)[len(y) // 2]
    late = log_line[100:]
    assert max(late) < 100 * median  # within two decades of the typical step
    assert min(lin_line[100:]) > 1000 * median  # the plain average: near the spikes
    mean_log = sum(math.log(v) for v in y[100:]) / 200
    assert math.log(statistics.median(late)) == pytest.approx(mean_log, abs=1.0)


# ------------------------------------------------------------------ start from a config


def test_an_uploaded_config_starts_the_form_and_names_only_what_is_offered(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 46 item 1: a TOML uploaded from the browser is kept in the run store's
    folder (its name reduced to a plain file name) and the form starts from it; one that
    names code or files the dashboard does not offer is refused before launch."""
    fake = FakeLaunch()
    monkeypatch.setattr("comera_engine.launch.launch", fake)
    text = (ROOT / "experiments/configs/digits_tt_mlp.toml").read_text()
    text = text.replace('name = "digits-tt-mlp"', 'name = "uploaded-digits"')
    text = re.sub(r"(?m)^steps = \d+", "steps = 77", text)
    at = app("new")
    at.file_uploader(key="upload").set_value(("../../mine x.toml", text.encode(),
                                             "application/toml")).run()
    no_exception(at)
    assert at.selectbox(key="preset").value == "upload:mine_x"
    assert (home / "configs" / "mine_x.toml").read_text() == text
    assert at.text_input(key="upload:mine_x:steps").value == "77"
    assert not at.error and not at.button(key="launch").disabled
    at.button(key="launch").click().run()
    assert fake.calls == 1
    launched = store_at(home).list_runs()[0]["config"]
    assert (launched["name"], launched["train"]["steps"]) == ("uploaded-digits · 60×", 77)

    # code or files not offered: refused, and nothing of it is called, imported or read
    # (the engine's checks called the factory and read the file's header after the refusal)
    pwned, secret = home.parent / "pwned", home.parent / "secret.csv"
    secret.write_text("hidden_a,hidden_b\n1,2\n")
    evil = (f'name = "x"\n[model]\nfactory = "os:system"\nkwargs = {{ command = "touch '
            f'{pwned}" }}\n[data]\nname = "digits"\n')
    snoop = ('name = "y"\n[model]\nname = "tt_mlp"\n[data]\nname = "files"\n'
             f'train = "{secret}"\nlabel = "zzz"\n')
    for stem, text, problem in (
            ("evil", evil, "model.factory: 'os:system' is not a model this dashboard offers"),
            ("snoop", snoop, "data.train: names a file this dashboard does not offer")):
        at = app("new")
        at.file_uploader(key="upload").set_value((f"{stem}.toml", text.encode(),
                                                 "application/toml")).run()
        no_exception(at)
        assert at.selectbox(key="preset").value == f"upload:{stem}"
        assert problem in " ".join(e.value for e in at.error)
        assert at.button(key="launch").disabled
        at.text_input(key=f"upload:{stem}:steps").set_value("90").run()  # a rerun
        assert not pwned.exists() and "hidden_a" not in texts(at)
    at = app("new")  # the same through All settings · Edit as TOML, and a swept key
    at.toggle(key="digits_tt_mlp:as_toml").set_value(True).run()
    at.text_area(key="digits_tt_mlp:toml").set_value(evil).run()
    assert "model.factory: 'os:system' is not a model" in " ".join(e.value for e in at.error)
    at = app("new")
    at.text_area(key="sw-grid").set_value('model.factory="os:system"').run()
    no_exception(at)
    assert any(e.value.startswith("Other keys: model.factory: 'os:system' is not a model")
               for e in at.error)
    assert at.button(key="sw-launch").disabled and not pwned.exists()
    at.file_uploader(key="upload").set_value(("bad.toml", b"name = \n", "text/plain")).run()
    assert any(e.value.startswith("config: not valid TOML") for e in at.error)


def test_a_bad_uploaded_config_shows_every_problem_and_cannot_launch(home: Path) -> None:
    """An uploaded config is checked as written, and every problem is said, a line each
    naming the field and the fix (only the first was), with Launch disabled until the
    file is fixed; a value a widget does not offer (comera.switch = "sometimes") was
    replaced by the widget's first choice and launched, or broke the page (precision
    "fp64"). A file that is not a config is not loaded: both missing tables are named,
    and Launch stays disabled until the file leaves the uploader."""
    text = (ROOT / "experiments/configs/digits_tt_mlp.toml").read_text()
    bad = (text.replace("tau = 0.01", "tau = 3.0\nbatch_sise = 4")
           .replace("switch = 100", 'switch = "sometimes"')
           .replace("grad_clip = 1.0", 'grad_clip = -1.0\nprecision = "fp64"'))
    at = app("new")
    at.file_uploader(key="upload").set_value(("bad.toml", bad.encode(), "text/plain")).run()
    no_exception(at)
    assert at.selectbox(key="preset").value == "upload:bad"
    errors = [e.value for e in at.error]
    problems = ["comera.tau: must be a fraction in [0, 1)",
                "comera.batch_sise: unknown key (did you mean train.batch_size?)",
                "comera.switch: unknown value 'sometimes'",
                "train.grad_clip: must be a finite number >= 0, got -1.0",
                "train.precision: unknown value 'fp64'"]
    for problem in problems:  # each said once
        assert sum(e.startswith(problem) for e in errors) == 1, (problem, errors)
    assert "Fix 5 problems above to launch." in errors
    assert "bad.toml as uploaded: 5 problems" in texts(at)
    assert at.button(key="launch").disabled and at.button(key="sw-launch").disabled
    fixed = text.replace("steps = 600", "steps = 80")  # the same file, mended
    at.file_uploader(key="upload").set_value(("bad.toml", fixed.encode(), "text/plain")).run()
    assert not at.error and not at.button(key="launch").disabled

    at.file_uploader(key="upload").set_value(("notes.toml", b'title = "not a run"\n',
                                             "text/plain")).run()
    no_exception(at)
    assert at.selectbox(key="preset").value == "upload:bad"  # not loaded
    errors = [e.value for e in at.error]
    for table in ("model", "data"):
        assert f"{table}: missing; a run config has [model] and [data] tables" in errors
    assert "notes\\.toml was not loaded" in texts(at)  # drawn as typed (fmt.literal)
    assert at.button(key="launch").disabled
    at.file_uploader(key="upload").set_value(None).run()  # out of the uploader
    assert not at.error and not at.button(key="launch").disabled
    # an uploaded config the user no longer wants leaves the store's folder and the list
    assert (home / "configs" / "bad.toml").is_file()
    at.button(key="remove-upload").click().run()
    no_exception(at)
    assert not (home / "configs" / "bad.toml").exists()
    assert "upload:bad" not in at.selectbox(key="preset").options
    assert at.selectbox(key="preset").value != "upload:bad"
    assert not any(b.key == "remove-upload" for b in at.button)  # a preset: none to remove
    from app.lib.presets import remove_upload

    (home / "comera.toml").write_text("kept")  # a key names a file in configs/ or nothing
    for key in ("upload:../comera", "upload:", "config:digits", "upload:bad"):
        assert not remove_upload(home, key)
    assert (home / "comera.toml").read_text() == "kept"


def test_edit_as_toml_launches_the_text(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """"Edit as TOML" shows the form's config as text; the edited text is what launches,
    validated by the engine, and it may name only files the dashboard offers."""
    fake = FakeLaunch()
    monkeypatch.setattr("comera_engine.launch.launch", fake)
    at = app("new")
    code = " ".join(c.value for c in at.code)
    assert "[comera]" in code and "lr_cores = 0.003" in code and "lr = 0.001" in code
    assert 'lr_schedule = "constant"' in code and "warmup_steps = 0" in code
    at.selectbox(key="digits_tt_mlp:lr_schedule").set_value("cosine").run()
    at.text_input(key="digits_tt_mlp:warmup_steps").set_value("20").run()
    code = " ".join(c.value for c in at.code)
    assert 'lr_schedule = "cosine"' in code and "warmup_steps = 20" in code
    at.toggle(key="digits_tt_mlp:as_toml").set_value(True).run()
    area = at.text_area(key="digits_tt_mlp:toml")
    assert tomllib.loads(area.value)["train"]["steps"] == 600
    area.set_value(area.value.replace("steps = 600", "steps = 2.5")).run()
    assert "train.steps: must be an integer, got 2.5" in " ".join(e.value for e in at.error)
    assert at.button(key="launch").disabled
    area = at.text_area(key="digits_tt_mlp:toml")
    area.set_value(area.value.replace("steps = 2.5", "steps = 90")).run()
    assert not at.error and not at.button(key="launch").disabled
    at.button(key="launch").click().run()
    assert store_at(home).list_runs()[0]["config"]["train"]["steps"] == 90

    at = app("new")
    at.toggle(key="digits_tt_mlp:as_toml").set_value(True).run()
    area = at.text_area(key="digits_tt_mlp:toml")
    area.set_value(area.value.replace('name = "digits"', 'name = "files"\n'
                                      'train = "/etc/hosts"\nlabel = "y"')).run()
    assert "data.train: names a file this dashboard does not offer" in " ".join(
        e.value for e in at.error)
    assert at.button(key="launch").disabled


def test_metric_history_downloads(home: Path) -> None:
    """Issue 46 item 6: a run's (and a sweep's) whole metric history as CSV and JSON,
    one row per step, the store's values; the Live page offers both."""
    import csv
    import io

    from app.lib import runs as runs_lib

    st = store_at(home)
    rid = seed_run(st, "hist", steps=100, upto=100)
    rows = runs_lib.metric_history(st, [rid])
    assert [r["step"] for r in rows] == list(range(1, 101, 5))
    table = list(csv.DictReader(io.StringIO(runs_lib.history_csv(rows))))
    assert table[0]["run"] == rid and table[0]["step"] == "1"
    loss = st.series(rid, "loss/task")
    assert [float(r["loss/task"]) for r in table] == pytest.approx(list(loss["value"]))
    assert table[1]["eval/acc"] == ""  # not evaluated at step 6: blank, not 0
    doc = json.loads(runs_lib.history_json(rows))
    assert doc[rid]["metrics"]["eval/acc"] == [[1, pytest.approx(0.93 / 100)]]
    labelled = runs_lib.metric_history(st, [rid], {rid: "5× seed 0"})
    assert labelled[0]["cell"] == "5× seed 0"
    at = app("live")
    no_exception(at)
    assert {"Metrics (CSV)", "Metrics (JSON)"} <= {b.label for b in at.get("download_button")}


def charted_pages(rid: str, sid: str) -> dict[str, dict[str, dict]]:
    """Every chart of the pages that draw charts, by page and key (``page_figures``):
    New experiment, Learn, Compare, the run ``rid`` on Live run and the sweep ``sid`` on
    Sweeps; no page raises."""
    out = {}
    for page, query in (("new", {}), ("learn", {}), ("compare", {}), ("live", {"run": rid}),
                        ("sweeps", {"sweep": sid})):
        at = AppTest.from_file(HOME, default_timeout=TIMEOUT).run()
        at.switch_page(PAGES.get(page, f"views/{page}.py"))
        at.query_params.update(query)
        at.run()
        no_exception(at)
        out[page] = page_figures(at)
    return out


def test_every_log_axis_is_labelled_with_whole_figures(home: Path) -> None:
    """A log axis reads 1, 2, 5, 10, 20k (each decade only over many decades, finer over
    less than a factor 3), never Plotly's own "9 10 2 3" (a decade's minor digits): on
    every page's charts with one (the preview's size and per-layer bars, Learn's error
    and cost curves, Compare's loss and fronts, a sweep's front, the Live learning
    rates)."""
    from app.lib.plots import log_axis
    from tests.test_app_sweeps import seed_sweep

    def shown(axis: dict, lo: float, hi: float) -> list[str]:
        return [t for v, t in zip(axis["tickvals"], axis["ticktext"]) if lo <= v <= hi]

    assert shown(log_axis(values=[3, 900]), 1, 1000) == [
        "1", "2", "5", "10", "20", "50", "100", "200", "500", "1k"]
    assert shown(log_axis(values=[1, 3e4]), 1, 1e5) == ["1", "10", "100", "1k", "10k", "100k"]
    assert shown(log_axis(values=[0.35, 0.45]), 0.3, 0.5) == ["0.3", "0.4", "0.5"]
    assert shown(log_axis(values=[2e-3, 1e-2], suffix="×"), 1e-3, 1e-2) == [
        "0.001×", "0.002×", "0.005×", "0.01×"]
    st = store_at(home)
    rid = seed_run(st, "tt-20x", target=20.0, acc=0.93, comp=24.0)
    seed_run(st, "tt-50x", target=50.0, acc=0.90, comp=50.0)
    seed_run(st, "dense", dense=True, acc=0.95)
    sid, _ = seed_sweep(st)
    found: dict[str, dict] = {}
    for page, figures in charted_pages(rid, sid).items():
        assert not unlabelled_log_axes(figures), (page, unlabelled_log_axes(figures))
        found.update(log_axes(figures))
    keys = " ".join(found)
    for chart in ("pv-size", "pv-params", "pv-macs", "l-curve", "l-cost-rank",
                  "l-cost-batch", "cmp-c1", "cmp-pareto", "sw-pareto", "ch-lr"):
        assert chart in keys, (chart, keys)


def test_no_chart_has_its_tool_bar_across_its_title(home: Path) -> None:
    """Plotly's tool bar (shown on hover) covered the title of a chart in two or three
    columns at 1024 px: drawn across the figure's top right, it is about 220 px wide.
    Every chart on every page has it down its right edge (about 25 px wide) and its
    title from its left edge, so a title that fits beside the bar is clear of it."""
    from app.lib import plots
    from tests.test_app_sweeps import seed_sweep

    st = store_at(home)
    rid = seed_run(st, "tt-20x", target=20.0, acc=0.93, comp=24.0)
    seed_run(st, "dense", dense=True, acc=0.95)
    sid, _ = seed_sweep(st)
    figures = {f"{page} {key}": fig for page, charts in charted_pages(rid, sid).items()
               for key, fig in charts.items()}
    figures.update({f"spec {case}": spec for case, spec in _specs()})
    assert len(figures) > 20
    titled = 0
    for key, fig in figures.items():
        layout = fig["layout"]
        assert layout["modebar"]["orientation"] == "v", key
        title = layout.get("title") or {}
        if title.get("text"):
            titled += 1
            assert (title["x"], title["xanchor"]) == (0.0, "left"), key
    assert titled > 15
    assert plots.look()["modebar"] == plots.look("A title")["modebar"] == {"orientation": "v"}


def test_compare_draws_one_front_per_data_set(home: Path) -> None:
    """Issue 46 item 6: runs on two data sets get two fronts (never one across them),
    the table names each run's data set, and the Overview has data set and duration."""
    st = store_at(home)
    seed_run(st, "tt-20x", target=20.0, acc=0.93, comp=24.0)
    seed_run(st, "tt-50x", target=50.0, acc=0.90, comp=50.0)
    cfg = {**config("cancer"), "task": "classify",
           "data": {"name": "files", "train": "/somewhere/train.csv", "label": "y"}}
    for name, acc, comp in (("cancer-5x", 0.97, 5.0), ("cancer-10x", 0.95, 10.0)):
        rid = st.create_run(name, cfg, "running")
        st.write_batch(rid, metrics=[(10, "eval/acc", acc, time.time()),
                                     (10, "compression/tensorized", comp, time.time())])
        st.set_status(rid, "finished")
    at = app("compare")
    no_exception(at)
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    (front,) = [s for s in specs if "Accuracy vs compression" in str(s["layout"]["title"])]
    names = {t.get("name") for t in front["data"]}
    assert {"Pareto front · digits", "Pareto front · files: train.csv (classify)"} <= names
    assert "Pareto front" not in names  # no front across the two
    assert "2 data sets" in texts(at) and "/somewhere" not in texts(at)
    assert set(at.dataframe[0].value["data set"]) == {"digits", "files: train.csv (classify)"}
    # the cancer runs logged no loss, size or throughput: blank cells, never "None"/"nan",
    # in columns that stay numeric (they sort as numbers)
    final = at.dataframe[0].value
    assert blank_when_missing(at) > 0 and final["eval loss"].isna().sum() == 2
    assert all(final[c].dtype.kind == "f" for c in ("eval acc", "eval loss", "samples/s"))
    cancer = final[final["data set"] == "files: train.csv (classify)"]
    assert set(cancer["model size"]) == {""}
    assert set(cancer["Model + optimizer memory (estimate)"]) == {""}
    # accuracy in percent on every front: axis and hover (issue 46 item 3)
    drawn = [s for s in specs if "Accuracy vs" in str(s["layout"]["title"]) and s["data"]]
    assert len(drawn) == 2  # compression and bytes (no training memory was logged)
    for spec in drawn:
        assert spec["layout"]["yaxis"]["tickformat"].endswith("%")
        assert all("%{y:.1%}" in t["hovertemplate"] for t in spec["data"]
                   if t.get("mode") == "markers+text")
    at = app()
    table = at.dataframe[0].value
    assert {"data set", "duration"} <= set(table.columns)
    assert set(table["data set"]) == {"digits", "files: train.csv"}
    assert blank_when_missing(at) > 0  # the cancer runs' params


def test_compare_tells_the_methods_apart_and_names_points_by_what_differs(home: Path) -> None:
    """A sweep of peers on Compare: each method its own legend entry and colour (one front
    across them), the int8 weights of a pruned run a peer, not a second dense baseline;
    a point is named beside it by the words that tell it from the others (the hover has
    the run's whole name); with more points than a figure can name, hover only."""
    from app.lib import plots

    st = store_at(home)
    cells = {"dense": ({"dense": True}, {}, 0.97, 1.0),
             "prune_int8": ({"dense": True, "quantize": "int8"}, {}, 0.95, 40.0),
             "fixed": ({}, {"method": "fixed"}, 0.93, 30.0),
             "comera": ({}, {}, 0.96, 30.0)}
    ids = {}
    for method, (model, comera, acc, comp) in cells.items():
        cfg = config(f"sweep digits {method} · 30× seed 0")
        cfg["model"].update(model)
        cfg["comera"].update(comera)
        rid = ids[method] = st.create_run(cfg["name"], cfg, "running")
        st.write_batch(rid, metrics=[(10, "eval/acc", acc, time.time()),
                                     (10, "compression/model", comp, time.time()),
                                     (10, "compression/tensorized", comp, time.time())])
        st.set_status(rid, "finished")
    at = app("compare")
    no_exception(at)
    assert "No dense baseline" not in texts(at)
    (front,) = [json.loads(c.proto.spec) for c in at.get("plotly_chart")
                if "Accuracy vs compression" in str(json.loads(c.proto.spec)["layout"])]
    traces = {t["name"]: t for t in front["data"] if t.get("name")}
    assert set(traces) == {"Pareto front", "dense baseline", "CoMERA, schedule paced",
                           "fixed-rank TT",
                           "int8 weights (torchao) of a trained dense or pruned run"}
    colours = {t["marker"]["color"] for n, t in traces.items() if n != "Pareto front"}
    assert len(colours) == 4  # one per method, the dense stars apart
    assert traces["dense baseline"]["x"] == [1.0] and traces["dense baseline"]["y"] == [0.97]
    # the front: CoMERA (30x, 96 %) and the pruned int8 (40x, 95 %) beat fixed ranks
    assert list(zip(traces["Pareto front"]["x"], traces["Pareto front"]["y"])) == [
        (1.0, 0.97), (30.0, 0.96), (40.0, 0.95)]
    comera = traces["CoMERA, schedule paced"]
    assert comera["text"] == [f"comera · 30× seed 0 ({ids['comera'][-4:]})"]
    assert comera["customdata"] == [f"sweep digits comera · 30× seed 0 ({ids['comera'][-4:]})"]
    assert comera["hovertemplate"].startswith("%{customdata}")
    # a figure of more points than it can name names the front's (the rest on hover)
    many = [{"label": f"run {i}", "dense": False, "acc": 0.5 + (i % 2) / 10, "comp": 1.0 + i}
            for i in range(plots.MAX_LABELS + 1)]
    (dots,) = [t for t in plots.pareto(many, "comp", "acc", "x", "y", "t").data
               if t.name == plots.TT_METHOD]
    assert list(dots.customdata) == [p["label"] for p in many]
    # (the front: run 8, the largest x, then run 7, the best y below it)
    assert list(dots.text) == [""] * 7 + ["run 7", "run 8"]
    (dots,) = [t for t in plots.pareto(many[:-1], "comp", "acc", "x", "y", "t").data
               if t.name == plots.TT_METHOD]
    assert list(dots.text) == [f"run {i}" for i in range(plots.MAX_LABELS)]


def test_overview_draws_running_runs_as_cards_and_sums_up_the_queue(home: Path) -> None:
    """A store with a reproduction's queue (dozens of cells waiting): the Overview draws
    a card for each running run up to eight, says how many more run and how many wait
    (and in how many sweeps) in one line, and counts running and queued apart; the
    dense-baseline column marks the dense model as trained, not its int8 weights."""
    st = store_at(home)
    sid = st.create_sweep("peers", {"name": "peers"}, {"comera.target_compression": [5]}, 1)
    for i in range(10):
        st.create_run(f"running {i}", config(f"running {i}"), "running")
    for i in range(30):
        st.create_run(f"waiting {i}", config(f"waiting {i}"), "queued",
                      sweep_id=sid if i % 2 else None,
                      cell={"overrides": {}, "seed": i} if i % 2 else None)
    dense = config("dense", dense=True)
    int8 = config("int8", dense=True)
    int8["model"]["quantize"] = "int8"
    for cfg in (dense, int8):
        rid = st.create_run(cfg["name"], cfg, "running")
        st.set_status(rid, "finished")
    at = app()
    no_exception(at)
    metrics = {m.label: m.value for m in at.metric}
    assert (metrics["Running"], metrics["Queued"], metrics["Runs"]) == ("10", "30", "42")
    watch = [b for b in at.button if b.label == "Watch"]
    assert len(watch) == 8
    assert "2 more running; 30 queued (1 sweep), waiting for a free slot: in the table " \
        "below." in texts(at)
    table = at.dataframe[0].value
    assert len(table) == 42
    baseline = dict(zip(table["name"], table["dense"]))
    # the cards redraw themselves while runs are live (a fragment on a timer): a run's
    # step moves on the card without a reload
    import streamlit

    timers: list = []
    real = streamlit.fragment

    def fragment(fn=None, *, run_every=None, **kw):  # noqa: ANN001, ANN202
        timers.append(run_every)
        return real(fn, run_every=None, **kw)

    streamlit.fragment = fragment
    try:
        again = app()
    finally:
        streamlit.fragment = real
    assert timers and timers[-1] and timers[-1] > 0
    no_exception(again)
    assert baseline["dense"] and not baseline["int8"]
    # the dense run's config carries the 20x of the config it came from; nothing in it
    # pursues it (int8 weights keep theirs: the size of the run they quantize)
    target = dict(zip(table["name"], table["target"]))
    assert target["running 0"] == target["int8"] == 20.0
    assert target["dense"] != target["dense"]  # NaN: a blank cell


def test_the_overview_reads_the_run_list_once_per_pass(home: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """One pass of the Overview reads the store's run list once: its tiles, its table and
    its live cards' first draw share the read (the cards read it again beside it); a
    redraw of the cards alone, on their timer, reads the store anew."""
    import sys

    import streamlit

    st = store_at(home)
    seed_run(st, "done")
    seed_run(st, "live", status="running", upto=100)
    readers: list[str] = []  # the file each read of the run list came from
    real = RunStore.list_runs

    def counting(self: RunStore, *args: object, **kwargs: object) -> list[dict]:
        readers.append(Path(sys._getframe(1).f_code.co_filename).name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(RunStore, "list_runs", counting)
    cards: list[tuple] = []  # the cards' function and what each pass handed it
    real_fragment = streamlit.fragment

    def fragment(fn=None, **kw):  # noqa: ANN001, ANN202
        drawn = real_fragment(fn, **kw)

        def draw(*args: object) -> object:
            cards.append((fn, args))
            return drawn(*args)
        return draw

    monkeypatch.setattr(streamlit, "fragment", fragment)
    at = app()
    no_exception(at)
    assert [b.label for b in at.button] == ["Watch"]  # the live run's card
    # the sidebar's own read (Home.py, on every page) and the page's one
    assert sorted(readers) == ["overview.py", "ui.py"]
    at.run()
    assert sorted(readers) == ["overview.py"] * 2 + ["ui.py"] * 2
    readers.clear()
    fn, args = cards[-1]
    fn(*args)  # the cards redrawn alone, as Streamlit calls them on their timer
    assert readers == ["overview.py"]


def test_a_run_asks_a_target_only_if_it_pursues_one() -> None:
    """One answer for every page, the CLI's list and the sweep report: the TT methods,
    structured pruning and int8 weights (of the run whose size they keep) keep
    ``comera.target_compression``; a dense baseline asks none, whatever its config
    carries."""
    from comera_engine.metrics import run_target

    tt = config("tt")
    assert run_target(tt) == 20.0
    assert run_target({**tt, "comera": {**tt["comera"], "method": "fixed"}}) == 20.0
    prune = {**config("prune", dense=True), "comera": {**tt["comera"], "method": "prune"}}
    assert run_target(prune) == 20.0
    assert run_target(config("dense", dense=True)) is None
    for dense in (True, False):
        q = config("q", dense=dense)
        q["model"]["quantize"] = "int8"
        assert run_target(q) == 20.0
    assert run_target(config("none", target=None)) is None
    assert run_target(None) is None
    hashed = config("hash", dense=True)
    hashed["model"]["kwargs"] = {"peer": "hash", "target": 20.0}
    assert run_target(hashed) == 20.0
    hashed["model"]["kwargs"]["peer"] = "dense"
    assert run_target(hashed) is None


def test_a_sweep_of_int8_weights_states_the_whole_model(home: Path) -> None:
    """The sweep report of int8 weights of a dense run states the compression in the
    scope it is measured in, the whole model, as the run's own pages state it (the
    config's scope is the TT layers')."""
    from comera_engine.launch.sweep import sweep_report

    st = store_at(home)
    sid = st.create_sweep("int8", {"name": "int8"}, {"model.dense": [True]}, 1)
    cfg = config("int8", dense=True)
    cfg["model"]["quantize"] = "int8"
    rid = st.create_run("int8", cfg, "running", sweep_id=sid,
                        cell={"overrides": {"model.dense": True}, "seed": 0})
    st.write_batch(rid, metrics=[(0, "eval/acc", 0.97, time.time()),
                                 (0, "compression/model", 3.8, time.time()),
                                 (0, "compression/tensorized", 1.0, time.time())])
    st.set_status(rid, "finished")
    (cell,) = sweep_report(st, sid)["cells"]
    assert (cell["scope"], cell["compression"]) == ("model", 3.8)


def test_a_tile_number_keeps_to_seven_characters() -> None:
    """The Live page's loss tile wrapped ``0.0005601`` over two lines."""
    from app.lib.fmt import num

    assert [num(v) for v in (0.0005601, 1.234e-5, 2.3026, 0.25, 1234.5, -0.0123456)] == [
        "0.00056", "1.2e-05", "2.303", "0.25", "1234", "-0.0123"]
    assert num(None) == num(float("nan")) == "–"


def test_distinct_labels_drop_only_the_words_every_label_starts_with() -> None:
    from app.lib.runs import distinct_labels

    assert distinct_labels(["sweep digits comera · 10×", "sweep digits fixed · 10×"]) == [
        "comera · 10×", "fixed · 10×"]
    assert distinct_labels(["a b", "a b"]) == ["b", "b"]  # never empty
    assert distinct_labels(["a", "a b"]) == ["a", "a b"]
    assert distinct_labels(["one run"]) == ["one run"]
    assert distinct_labels(["x y", "z y"]) == ["x y", "z y"]


def test_point_labels_stay_in_the_figure_and_legends_under_titles() -> None:
    """Issue 46: Compare's point labels were cut at the plot's edges and legends ran
    over titles. A label in the right fifth of the x range (log10 on a log axis) goes
    left of its point, in the left fifth right of it, else centred; labels are not
    clipped by the axes; the title stands alone at the top, the legend at the bottom;
    percent ticks never repeat one label."""
    from app.lib import plots

    # log10: 0, 1, 1.5, 2 over [0, 2] -> fractions 0, 0.5, 0.75, 1
    xs = [1.0, 10.0, 31.6, 100.0]
    assert plots.label_positions(xs, xs, log=True) == [
        "top right", "top center", "top center", "top left"]
    assert plots.label_positions([5.0], [5.0], log=False, side="bottom") == ["bottom center"]
    # neighbours closer than a tenth of the range (in log10) are staggered: over [0, 2],
    # 10 and 11 sit at 0.5 and 0.52; the higher point's label on top, the lower's below
    assert plots.label_positions([1.0, 10.0, 11.0, 100.0], [1.0, 100.0], log=True,
                                 ys=[0.9, 0.80, 0.85, 0.9]) == [
        "top right", "bottom center", "top center", "top left"]
    # without ys, in the order given
    assert plots.label_positions([10.0, 11.0], [1.0, 100.0], log=True) == [
        "top center", "bottom center"]
    # a chain (each within 0.1 of the next: 0.5, 0.52, 0.54, 0.56 by 10^(2f)) is one
    # cluster: top, beside (right, left), bottom, by y from the highest
    chain = [10 ** (2 * f) for f in (0.5, 0.52, 0.54, 0.56)]
    assert plots.label_positions(chain, [1.0, 100.0], log=True, ys=[0.7, 0.9, 0.6, 0.8]) == [
        "middle left", "top center", "bottom center", "middle right"]
    # at the right end of the range the labels between turn inward (left); on a linear
    # axis the range is the x range itself: 98, 99, 100 within 0.1 of [0, 100]
    assert plots.label_positions([98.0, 99.0, 100.0], [0.0, 100.0], log=False,
                                 ys=[0.5, 0.6, 0.4]) == [
        "middle left", "top left", "bottom left"]
    # in a figure: two runs at 24x and 25x (seeds of one target) get top and bottom
    close = [{"label": "a", "dense": False, "acc": 0.93, "comp": 24.0},
             {"label": "b", "dense": False, "acc": 0.92, "comp": 25.0},
             {"label": "c", "dense": False, "acc": 0.80, "comp": 100.0}]
    (dots,) = [t for t in plots.pareto(close, "comp", "acc", "x", "y", "t", x_include=[1.0]).data
               if t.name == "CoMERA (TT)"]
    assert list(dots.textposition) == ["top center", "bottom center", "top left"]
    points = [{"label": f"run {x:g}", "dense": False, "acc": 0.9 + x / 1000, "comp": x}
              for x in xs]
    fig = plots.pareto(points, "comp", "acc", "compression", "accuracy", "Accuracy")
    (dots,) = [t for t in fig.data if t.name == "CoMERA (TT)"]
    assert dots.cliponaxis is False and list(dots.textposition)[0] == "top right"
    # percent ticks with the decimals a span needs (94.4-95.3 %: neighbours differ)
    assert [plots.percent_ticks(v) for v in ([0.5, 0.99], [0.944, 0.953], [0.95, 0.952])] \
        == [".0%", ".1%", ".2%"]
    lines = plots.lines([("a", [0, 1], [1.0, 2.0])], "A title", "y")
    assert lines.layout.title.automargin is True and lines.layout.title.yref == "container"
    assert (lines.layout.legend.yref, lines.layout.legend.y) == ("container", 0.0)


def test_rename_notes_tags_archive_and_restore(home: Path) -> None:
    """Issue 46 item 6: on Live run a run is renamed, given notes and tags (kept in the
    store), archived (gone from the Overview's list unless shown, nothing deleted) and
    restored; a bad name is refused with the engine's message."""
    st = store_at(home)
    rid = seed_run(st, "first")
    other = seed_run(st, "second")
    at = app("live")
    at.selectbox(key="live-run").set_value(rid).run()
    no_exception(at)
    at.text_input(key=f"about-name-{rid}").set_value("renamed").run()
    at.text_area(key=f"about-notes-{rid}").set_value("lr 3e-3 was better").run()
    at.text_input(key=f"about-tags-{rid}").set_value("lr, digits, lr").run()
    at.button(key="about-save").click().run()
    no_exception(at)
    run = st.get_run(rid)
    assert (run["name"], run["notes"], run["tags"]) == ("renamed", "lr 3e-3 was better",
                                                        ["lr", "digits"])
    at.text_input(key=f"about-name-{rid}").set_value("  ").run()
    at.button(key="about-save").click().run()
    assert any("name: must be a non-empty string" in e.value for e in at.error)
    assert st.get_run(rid)["name"] == "renamed"
    at.text_input(key=f"about-name-{rid}").set_value("second").run()  # another run's name
    at.button(key="about-save").click().run()
    assert any("name: another run is called 'second'; choose another, e.g. 'second #2'"
               in e.value for e in at.error)
    assert st.get_run(rid)["name"] == "renamed"
    at.button(key="about-archive").click().run()
    assert st.get_run(rid)["archived_at"] is not None
    home_page = app()
    table = home_page.dataframe[0].value
    assert list(table["run id"]) == [other]  # archived: not listed
    home_page.toggle(key="overview-archived").set_value(True).run()
    table = home_page.dataframe[0].value
    assert set(table["run id"]) == {rid, other}
    assert "lr, digits" in set(table["tags"])
    # Compare neither offers nor picks an archived run unless asked to
    cmp = app("compare")
    no_exception(cmp)
    offered = cmp.multiselect(key="cmp-runs").options  # "name · id · status"
    assert [o.split(" · ")[1] for o in offered] == [other]
    assert cmp.multiselect(key="cmp-runs").value == [other]
    assert list(cmp.dataframe[0].value["run"]) == [f"second ({other[-4:]})"]
    cmp.toggle(key="cmp-archived").set_value(True).run()
    offered = cmp.multiselect(key="cmp-runs").options
    assert {o.split(" · ")[1] for o in offered} == {rid, other}
    cmp.multiselect(key="cmp-runs").select(rid).run()
    no_exception(cmp)
    assert len(cmp.dataframe[0].value) == 2
    # every run archived: Compare says where they are; shown, they are picked again
    st.archive_run(other)
    cmp = app("compare")
    assert cmp.multiselect(key="cmp-runs").value == [] and "Every run is archived" in texts(cmp)
    cmp.toggle(key="cmp-archived").set_value(True).run()
    assert sorted(cmp.multiselect(key="cmp-runs").value) == sorted([rid, other])
    st.archive_run(other, archived=False)
    at = app("live")
    at.selectbox(key="live-run").set_value(rid).run()
    at.button(key="about-restore").click().run()
    assert st.get_run(rid)["archived_at"] is None and st.counts(rid)["metrics"] > 0


def test_a_renamed_run_is_shown_by_its_new_name_in_the_closed_picker(home: Path) -> None:
    """Saved under a new name, the run's picker (closed) is sent the new name as its
    choice: the browser kept showing the old one above a header with the new."""
    st = store_at(home)
    rid = seed_run(st, "first")
    at = app("live")
    no_exception(at)
    assert not at.selectbox(key="live-run").proto.set_value
    at.text_input(key=f"about-name-{rid}").set_value("renamed").run()
    at.button(key="about-save").click().run()
    no_exception(at)
    pick = at.selectbox(key="live-run")
    assert pick.value == rid
    assert pick.proto.set_value and pick.proto.raw_value == f"renamed · {rid}"


def test_names_a_user_typed_are_shown_as_typed_not_as_markdown(home: Path) -> None:
    """A run's name is drawn as typed in the Live page's header and the Overview's live
    card (it was Markdown there: ``[l](http://…)`` a link, ``**b**`` bold, ``$x$``
    maths, ``:material/home:`` an icon), and so is an uploaded file's name in the note
    saying it was not loaded."""
    import html

    from markdown_it import MarkdownIt

    from app.lib import fmt

    md = MarkdownIt("commonmark").enable("strikethrough")
    name = "<b>x</b> **b** $x$ :red[r] :material/home: `c` [l](http://e.x) www.a.b _i_ ~~s~~"

    def shown(source: str) -> str:
        """``source`` as Markdown draws it, one paragraph: its HTML, the invisible word
        joiners left out. Streamlit's own readings (``$…$``, ``:…:``, ``:colour[…]``,
        bare ``http://`` and ``www.`` links) apply to text where ``:`` is followed by a
        letter or a ``/``, or ``.`` follows ``www``: they must not be left."""
        assert not re.search(r":[A-Za-z/]|www\\?\.|(?<!\\)\$", source), source
        return md.renderInline(source).replace("\u2060", "")

    assert shown(fmt.literal(name)) == html.escape(name, quote=False)
    st = store_at(home)
    rid = seed_run(st, name, status="running", upto=100)
    at = app("live")
    no_exception(at)
    header = next(m.value for m in at.markdown if m.value.startswith("### "))
    assert shown(header[4:].split(" &nbsp; ")[0]) == html.escape(name, quote=False)
    at = app()
    card = next(m.value for m in at.markdown if rid in m.value)
    assert shown(card.split(" · ")[0].strip("*")) == html.escape(name, quote=False)
    at = app("new")
    at.session_state["upload_error"] = (f"{name}.toml", ["config: not UTF-8 text (byte 9)"])
    at.run()
    note = next(c.value for c in at.caption if "was not loaded" in c.value)
    assert shown(note.removeprefix(":material/info: ").split(" was not loaded")[0]) \
        == html.escape(f"{name}.toml", quote=False)


def test_live_page_plots_the_trainers_system_readings(home: Path) -> None:
    st = store_at(home)
    rid = seed_run(st, "sys", status="running", steps=100, upto=50)
    t = time.time()
    st.write_batch(rid, metrics=[m for s in (10, 20, 30) for m in (
        (s, "sys/cpu_percent", 95.0 + s, t), (s, "sys/ram_used_mb", 4096.0, t),
        (s, "sys/ram_total_mb", 16384.0, t), (s, "sys/rss_mb", 400.0, t))])
    at = app("live")
    no_exception(at)
    fig = live_charts(at)["ch-sys"]
    traces = {tr["name"]: tr for tr in fig["data"] if tr.get("name")}
    assert list(traces["system RAM used %"]["y"]) == [25.0] * 3
    assert list(traces["process CPU % (of one core)"]["y"]) == [105.0, 115.0, 125.0]


def test_every_chart_carries_the_white_template() -> None:
    """The charts' one look, set once as Plotly's default (not named in each figure, which
    had Plotly validate the template again per figure): a Pareto front's and an empty
    figure's JSON carry plotly_white's template, as Plotly itself builds it; the live
    charts' page carries it once (a live chart's spec is sent every second without it)."""
    import plotly.graph_objects as go
    import plotly.io as pio

    from app.lib import livechart, plots
    from app.lib.livechart import spec_of

    want = json.loads(go.Figure(layout={"template": pio.templates["plotly_white"]})
                      .to_json())["layout"]["template"]
    figures = [plots.lines([("loss", [1, 2, 3], [0.9, 0.5, 0.4])], "Loss", "loss",
                           stages=[(2, "late stage")], hline=(0.5, "target")),
               plots.pareto([{"comp": 10.0, "acc": 0.9, "label": "a"}], "comp", "acc",
                            "compression", "accuracy", "Accuracy"),
               plots.empty_figure("No data yet")]
    for fig in figures:
        assert json.loads(spec_of(fig))["layout"]["template"] == want
    line = next(ln for ln in livechart.page().splitlines() if ln.startswith("const TEMPLATE"))
    assert json.loads(line.removeprefix("const TEMPLATE = ").rstrip(";")) == want
    assert "template" not in json.loads(spec_of(plots.lines_spec(
        [("loss", [1, 2, 3], [0.9, 0.5, 0.4])], "Loss")))["layout"]


def _specs() -> list[tuple[str, dict]]:
    """The Live page's chart specs over the cases their code branches on."""
    from app.lib import plots

    x = list(range(0, 1000, 10))
    y = [1.0 / (1 + s) for s in x]
    wide = [10.0 ** (k / 20) for k in range(len(x))]  # four decades: a decades-only axis
    history = [{"step": s, "layer": name, "ranks": [8 - s // 400, 6]}
               for s in (0, 300, 600) for name in ("fc1", "fc2")]
    return [
        ("smoothed, dashed, stages, target", plots.lines_spec(
            [("task", x, y), ("total", x, [v + 0.1 for v in y])], "Loss", "loss",
            stages=[(400, "late stage"), (700, "late stage")], smooth=0.1,
            dashes=[None, "dash"], hline=(0.3, "target 3×"))),
        ("percent, gaps", plots.lines_spec(
            [("train", x, [0.5 + v / 3 for v in y[:-3]] + [None, math.nan, math.inf]),
             ("eval", x[::10], y[::10])], "Accuracy", "accuracy", percent=True)),
        ("log 1-2-5, from zero, markers", plots.lines_spec(
            [("rss", x[:5], [3.0, 4.0, 5.0, 6.0, 7.0])], "Memory", "MiB", log_y=True,
            from_zero=True, markers=True)),
        ("log decades, short run", plots.lines_spec(
            [("a", [1, 2, 3], wide[:3]), ("b", x, wide)], "Wide", log_y=True)),
        ("no points", plots.lines_spec([("a", [], [])], "Empty", empty="Nothing yet")),
        ("heatmap", plots.rank_heatmap_spec(history, stages=[(300, "late stage")], until=800)),
        ("heatmap, none", plots.rank_heatmap_spec([])),
        ("bars", plots.rank_bars_spec({"fc1": [3, 6], "fc2": [5], **{f"l{k}": [2, 2]
                                                                    for k in range(4)}})),
        ("bars, none", plots.rank_bars_spec({})),
    ]


def test_live_chart_specs_are_plotly_figures_as_plotly_writes_them() -> None:
    """Every spec the Live page draws (plain dicts, built every second without Plotly's
    validation) is valid Plotly that Plotly's validation leaves as it is: the JSON sent is
    the JSON a ``go.Figure`` of it writes (less the template, which the chart's page
    holds); non-finite values are sent as gaps (null), NumPy numbers as numbers."""
    import plotly.graph_objects as go

    from app.lib.livechart import spec_of

    for case, spec in _specs():
        sent = json.loads(spec_of(spec))
        plotly = json.loads(go.Figure(spec).to_json())  # raises on an invalid property
        plotly["layout"].pop("template")
        assert sent == plotly, case
    (_, gaps), = [c for c in _specs() if c[0] == "percent, gaps"]
    assert json.loads(spec_of(gaps))["data"][0]["y"][-3:] == [None, None, None]
    import numpy as np

    numpy_spec = {"data": [{"type": "scatter", "x": [np.int64(1), np.int64(2)],
                            "y": [np.float32(0.5), np.nan]}], "layout": {"height": 300}}
    assert json.loads(spec_of(numpy_spec))["data"][0] == {"type": "scatter", "x": [1, 2],
                                                          "y": [0.5, None]}


def test_live_chart_markers_are_plotlys_own_lines() -> None:
    """The target line and the stage markers a spec draws are the shapes and labels
    Plotly's ``add_hline`` / ``add_vline`` make with the same settings."""
    import plotly.graph_objects as go

    from app.lib import plots

    series = [("a", [0, 10, 20], [1.0, 2.0, 3.0])]
    ours = go.Figure(plots.lines_spec(series, "T", stages=[(5, "late stage"), (15, "x")],
                                      hline=(2.5, "target 4×")))
    theirs = go.Figure(plots.lines_spec(series, "T"))
    theirs.add_hline(y=2.5, line={"color": plots.TARGET_COLOR, "dash": "dash", "width": 2},
                     annotation_text="target 4×", annotation_position="bottom right",
                     annotation_font={"color": plots.TARGET_COLOR, "size": 11})
    for step in (5, 15):
        theirs.add_vline(x=step, line={"color": plots.STAGE_COLOR, "dash": "dot",
                                       "width": 1.5},
                         annotation_text="late stage", annotation_position="top left",
                         annotation_font={"size": 10, "color": "#64748B"})
    assert ours.layout.shapes == theirs.layout.shapes
    assert ours.layout.annotations == theirs.layout.annotations
    heat = go.Figure(plots.rank_heatmap_spec([{"step": 0, "layer": "fc", "ranks": [2]}],
                                             stages=[(5, "late stage")], until=9))
    assert heat.layout.shapes == theirs.layout.shapes[1:2]


def test_a_marked_x_is_labelled_at_its_line_on_log_and_linear_axes() -> None:
    """``plots.mark_x`` (Compare's "dense 1×"): Plotly draws a shape at its ``x`` on a log
    axis but places an annotation at ``log10`` of its ``x``; the label sits on its line on
    either axis (``add_vline`` put it at 10×)."""
    from app.lib import plots

    wide = [{"label": f"r{x:g}", "dense": False, "acc": 0.9, "comp": x} for x in (5.0, 80.0)]
    narrow = [{"label": f"r{x:g}", "dense": False, "acc": 0.9, "comp": x} for x in (1.2, 1.5)]
    for pts, log in ((wide, True), (narrow, False)):
        fig = plots.pareto(pts, "comp", "acc", "x", "y", "t", x_include=[1.0])
        assert (fig.layout.xaxis.type == "log") is log
        plots.mark_x(fig, 1.0, "dense 1×", plots.COLORS[1])
        (line,), (note,) = fig.layout.shapes, fig.layout.annotations[-1:]
        assert line.x0 == line.x1 == 1.0 and note.text == "dense 1×"
        assert note.x == (0.0 if log else 1.0)  # log10(1) on the log axis


def test_a_run_name_is_drawn_as_typed_not_as_markup() -> None:
    """A name typed with ``<b>`` reaches Plotly escaped (its labels read tags and
    entities as markup), in point labels, legends and bar labels alike."""
    from app.lib import plots

    name = "digits <b>bold</b> & co"
    shown = "digits &lt;b&gt;bold&lt;/b&gt; &amp; co"
    pts = [{"label": name, "dense": False, "acc": 0.9, "comp": 10.0},
           {"label": "other", "dense": False, "acc": 0.8, "comp": 40.0}]
    fig = plots.pareto(pts, "comp", "acc", "x", "y", "t")
    texts = [t for tr in fig.data for t in (tr.text or ()) if isinstance(t, str)]
    assert shown in texts and name not in texts
    spec = plots.lines_spec([(name, [0, 1, 2], [1.0, 2.0, 3.0])], "T")
    assert [d["name"] for d in spec["data"]] == [shown]
    assert list(plots.hbar([name], [1.0], "T", "x").data[0].y) == [shown]
