"""Sweeps in the dashboard (Streamlit AppTest): the Sweeps page (status, Pareto front,
mean ± std per grid point, stop/resume), launching a sweep from New experiment once per
submission, and loading a sweep's cells on Compare."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

from comera_engine.store import RunStore  # noqa: E402
from tests.app_checks import (  # noqa: E402
    HOME,
    ROOT,
    TIMEOUT,
    blank_when_missing,
    no_exception,
)


def app(page: str, **query: str) -> AppTest:
    at = AppTest.from_file(HOME, default_timeout=TIMEOUT).run()
    at.switch_page(page)
    for k, v in query.items():
        at.query_params[k] = v
    return at.run()


def texts(at: AppTest) -> str:
    parts = [m.value for m in at.markdown] + [c.value for c in at.caption]
    parts += [e.value for e in at.error] + [i.value for i in at.info]
    return "\n".join(str(p) for p in parts)


ACCS = {(5.0, 0): 0.95, (5.0, 1): 0.93, (20.0, 0): 0.91, (20.0, 1): 0.85}
COMPS = {(5.0, 0): 5.1, (5.0, 1): 4.9, (20.0, 0): 20.4, (20.0, 1): 19.8}


def seed_sweep(st: RunStore, unfinished: bool = False) -> tuple[str, list[str]]:
    """A 2 targets × 2 seeds sweep written through the store API, as its trainers would
    have left it (``unfinished``: the last cell still queued)."""
    sid = st.create_sweep("digits", {"name": "digits"}, {"comera.target_compression": [5, 20]},
                          2, max_parallel=2)
    ids = []
    for (target, seed), acc in ACCS.items():
        cfg = {"name": "digits", "model": {"name": "tt_mlp"},
               "comera": {"target_compression": target, "target_scope": "tensorized"},
               "train": {"steps": 100, "seed": seed}}
        rid = st.create_run(f"digits · {target:g}× seed {seed}", cfg, "running", sweep_id=sid,
                            cell={"overrides": {"comera.target_compression": target},
                                  "seed": seed})
        last = unfinished and (target, seed) == (20.0, 1)
        if last:
            st.update_run(rid, status="queued")
            st.run_dir(rid).mkdir(parents=True)  # what a resume starts from
            (st.run_dir(rid) / "config.toml").write_text(
                (ROOT / "experiments" / "configs" / "digits_tt_mlp.toml").read_text())
        else:
            t = time.time()
            st.write_batch(rid, metrics=[(100, "eval/acc", acc, t),
                                         (100, "compression/tensorized", COMPS[target, seed], t),
                                         (100, "params/effective", 1000.0 / target, t)])
            st.set_status(rid, "finished")
        ids.append(rid)
    return sid, ids


def test_sweeps_page_without_sweeps_says_how_to_make_one(home: Path) -> None:
    at = app("views/sweeps.py")
    no_exception(at)
    assert "No sweeps yet" in texts(at) and "comera sweep" in texts(at)


def test_sweeps_page_shows_the_front_and_the_mean_per_target(home: Path) -> None:
    st = RunStore(home / "comera.db")
    sid, ids = seed_sweep(st)
    at = app("views/sweeps.py", sweep=sid)
    no_exception(at)
    assert at.selectbox(key="sw-pick").value == sid
    tiles = {m.label: m.value for m in at.metric}  # short values: one line in a narrow tile
    assert (tiles["Status"], tiles["Cells ended"]) == ("finished", "4 / 4")
    assert len(at.get("plotly_chart")) == 2
    # parallel coordinates (issue 46 item 6): the swept key, the seed, the compression
    # and the score (percent), a line per cell
    (par,) = json.loads(at.get("plotly_chart")[1].proto.spec)["data"]
    assert par["type"] == "parcoords"
    dims = {d["label"]: d["values"] for d in par["dimensions"]}
    (seed,) = [d for d in par["dimensions"] if d["label"] == "seed"]
    assert seed["tickvals"] == [0, 1]  # whole seeds, no 0.5
    assert list(dims) == ["comera.target_compression", "seed", "compression (×)",
                          "eval/acc (%)"]
    assert sorted(dims["eval/acc (%)"]) == pytest.approx(sorted(100 * a for a in ACCS.values()))
    # one seed finished, or one value of a key: no flat axis for it
    from app.lib.plots import sweep_parcoords

    one_seed = [{"grid": {"lr": 0.1, "target": t}, "seed": 0, "score": 0.9, "compression": t,
                 "status": "finished"} for t in (5.0, 20.0)]
    (par,) = sweep_parcoords({"metric": "eval/acc", "cells": one_seed}, "t").data
    assert [d.label for d in par.dimensions] == ["target", "compression (×)", "eval/acc (%)"]
    # a running cell (its score so far) is left out; an accuracy axis stays within 100 %
    running = {"grid": {"lr": 0.1, "target": 50.0}, "seed": 0, "score": 0.99,
               "compression": 30.0, "status": "running"}
    (par,) = sweep_parcoords({"metric": "eval/acc", "cells": [*one_seed, running]}, "t").data
    assert sorted(par.dimensions[-1]["values"]) == [90.0, 90.0]
    lone = [{**one_seed[0], "score": 0.995}]
    (par,) = sweep_parcoords({"metric": "eval/acc", "cells": lone}, "t").data
    assert 0.0 <= par.dimensions[-1]["range"][0] < 99.5 < par.dimensions[-1]["range"][1] <= 100
    groups, cells = at.dataframe[0].value, at.dataframe[1].value
    assert len(groups) == 2 and len(cells) == 4
    for target in (5.0, 20.0):
        row = groups[groups["target"] == target].iloc[0]
        accs = [a for (t, _), a in ACCS.items() if t == target]
        mean, std = statistics.fmean(accs), statistics.stdev(accs)  # in percent
        assert row["eval/acc (mean ± std over seeds)"] == f"{mean * 100:.1f}% ± {std * 100:.1f}"
        assert row["finished"] == "2/2" and bool(row["Pareto"])  # neither beats the other
    assert set(cells["status"]) == {"finished"}
    assert at.button(key="sw-stop").disabled and at.button(key="sw-resume").disabled


def test_one_seed_has_no_spread_and_a_pending_cell_is_blank(home: Path) -> None:
    """Issue 46 item 3: a grid point with one finished seed shows its mean and no "± std
    0.0000"; a cell not run yet shows blank figures, never "None"; accuracy is in percent
    (as the Live tile states it)."""
    st = RunStore(home / "comera.db")
    sid, ids = seed_sweep(st, unfinished=True)
    at = app("views/sweeps.py", sweep=sid)
    no_exception(at)
    groups, cells = at.dataframe[0].value, at.dataframe[1].value
    one = groups[groups["target"] == 20.0].iloc[0]
    assert one["eval/acc (mean ± std over seeds)"] == "91.0%" and one["compression"] == "20.4×"
    assert one["finished"] == "1/2"
    pending = cells[cells["status"] == "queued"].iloc[0]
    assert (pending["eval/acc"], pending["compression"]) == ("", "")
    done = cells[cells["status"] == "finished"]
    assert set(done["eval/acc"]) == {"95.0%", "93.0%", "91.0%"}
    assert "None" not in groups.to_string() + cells.to_string()
    blank_when_missing(at)
    # error bars where seeds give a spread (5x: two), none at 20x (one), not a bar of 0
    marks = grid_points(at)
    assert marks["name"] == "grid point (mean ± std)"
    front = json.loads(at.get("plotly_chart")[0].proto.spec)["layout"]
    assert front["yaxis"]["title"]["text"] == "Eval accuracy"  # in words, in percent
    assert front["yaxis"]["tickformat"].endswith("%") and "%{y:.1%}" in marks["hovertemplate"]
    assert marks["error_y"]["array"] == [pytest.approx(statistics.stdev(
        [ACCS[5.0, 0], ACCS[5.0, 1]])), None]
    # with one finished seed everywhere: no spread in the header, the legend or the bars
    st.set_status(ids[1], "stopped")
    at = app("views/sweeps.py", sweep=sid)
    no_exception(at)
    assert "eval/acc" in at.dataframe[0].value.columns
    assert not any("±" in str(c) for c in at.dataframe[0].value.columns)
    marks = grid_points(at)
    assert marks["name"] == "grid point" and marks["error_y"] == {"visible": False}


def test_a_dense_baseline_cell_leaves_the_sweeps_scope_to_its_tt_cells(home: Path) -> None:
    """A sweep over ``model.dense``: the dense cell states its 1× in the whole model's
    scope (it has no TT layers), the TT cells theirs on the TT layers. 1× holds in any
    scope, so the sweep's scope (the grid points' column, the front's axis) is the TT
    cells' alone (it read "TT layers / whole model"); a mix is said only where the TT
    cells' own scopes differ, and a sweep of dense baselines alone is the whole model's."""
    from app.lib.runs import sweep_scope
    from comera_engine.launch.sweep import sweep_report

    st = RunStore(home / "comera.db")

    def sweep(scopes: dict[bool, str]) -> str:
        """A finished sweep of one cell per ``model.dense`` value in ``scopes`` (each
        cell's target scope), as its trainers would have left it."""
        sid = st.create_sweep("dense vs tt", {"name": "dense vs tt"},
                              {"model.dense": list(scopes)}, 1)
        for dense, scope in scopes.items():
            cfg = {"name": "dense vs tt", "model": {"name": "tt_mlp", "dense": dense},
                   "comera": {"target_compression": 10.0, "target_scope": scope},
                   "train": {"steps": 100, "seed": 0}}
            rid = st.create_run(f"dense={dense}", cfg, "running", sweep_id=sid,
                                cell={"overrides": {"model.dense": dense}, "seed": 0})
            t = time.time()
            st.write_batch(rid, metrics=[
                (100, "eval/acc", 0.95 if dense else 0.92, t),
                (100, "compression/tensorized", 1.0 if dense else 10.2, t),
                (100, "compression/model", 1.0 if dense else 4.1, t)])
            st.set_status(rid, "finished")
        return sid

    sid = sweep({True: "tensorized", False: "tensorized"})
    at = app("views/sweeps.py", sweep=sid)
    no_exception(at)
    groups, cells = at.dataframe[0].value, at.dataframe[1].value
    # each cell in its own scope; the sweep in its TT cells'
    assert sorted(zip(cells["scope"], cells["compression"])) == [
        ("TT layers", "10.2×"), ("whole model", "1.0×")]
    assert set(groups["scope"]) == {"TT layers"}
    assert sorted(c["baseline"] for c in sweep_report(st, sid)["cells"]) == [False, True]
    front = json.loads(at.get("plotly_chart")[0].proto.spec)["layout"]
    assert front["xaxis"]["title"]["text"].startswith("compression reached (TT layers; ")
    # TT cells asked on the whole model: their scope, not the TT layers'
    mixed = sweep({True: "tensorized", False: "model"})
    assert sweep_scope(sweep_report(st, mixed)["cells"]) == "whole model"
    alone = sweep({True: "tensorized"})
    assert sweep_scope(sweep_report(st, alone)["cells"]) == "whole model"
    # TT cells that differ among themselves: a mix, said so
    both = sweep({False: "model"})
    st.create_run("tt", {"name": "tt", "model": {"name": "tt_mlp"},
                         "comera": {"target_scope": "tensorized"}}, "finished",
                  sweep_id=both, cell={"overrides": {"model.dense": False}, "seed": 1})
    assert sweep_scope(sweep_report(st, both)["cells"]) == "TT layers / whole model"


def grid_points(at: AppTest) -> dict:
    """The Sweeps page's grid-point trace (mean per grid point) in its front chart."""
    (marks,) = [t for t in json.loads(at.get("plotly_chart")[0].proto.spec)["data"]
                if str(t.get("name")).startswith("grid point")]
    return marks


def test_the_sweep_picker_says_each_sweeps_status_as_the_store_has_it(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The picker names each sweep with its status as the store has it now: it is drawn
    by the part of the page redrawn every 2 s while any sweep is live (the chosen one or
    another), so a sweep that started, ended or was resumed meanwhile reads so without a
    reload (it kept the status of the page's first drawing)."""
    import streamlit

    real = streamlit.fragment
    drawn: list[tuple[float | None, bool]] = []  # per pass: its refresh, the picker drawn

    def fragment(func, *, run_every=None):  # what each fragment of the page draws
        def body() -> None:
            before = "sw-pick" in streamlit.session_state
            func()
            drawn.append((run_every, not before and "sw-pick" in streamlit.session_state))
        return real(body, run_every=run_every)

    monkeypatch.setattr(streamlit, "fragment", fragment)
    st = RunStore(home / "comera.db")
    sid, ids = seed_sweep(st, unfinished=True)  # its last cell waits: running
    at = app("views/sweeps.py", sweep=sid)
    no_exception(at)
    assert (2.0, True) in drawn  # the picker, in the part redrawn every 2 s

    def label(at: AppTest, sweep: str) -> str:
        pick = at.selectbox(key="sw-pick")
        return pick.options[[o.endswith(sweep) for o in pick.options].index(True)]

    assert label(at, sid) == f"digits · running · {sid}"
    # another sweep starts while the first one ends: still redrawn, each status current
    other = st.create_sweep("other", {"name": "other"}, {"comera.target_compression": [5]}, 1)
    cell = st.create_run("other · 5× seed 0", {"name": "other"}, "queued", sweep_id=other,
                         cell={"overrides": {"comera.target_compression": 5}, "seed": 0})
    st.set_status(ids[-1], "finished")
    drawn.clear()
    at.run()
    no_exception(at)
    assert at.selectbox(key="sw-pick").value == sid
    assert label(at, sid) == f"digits · finished · {sid}"
    assert label(at, other) == f"other · queued · {other}"
    assert drawn[-1][0] == 2.0  # the chosen sweep is over, the other one is live
    assert "Refreshing every 2 s" in texts(at)
    # nothing live: no refresh
    st.set_status(cell, "stopped", only_from=("queued",))
    drawn.clear()
    at.run()
    assert label(at, other) == f"other · stopped · {other}"
    assert drawn[-1][0] is None and "Refreshing" not in texts(at)


def test_the_closed_picker_shows_its_sweeps_status_as_it_changes(home: Path) -> None:
    """The picker, closed, shows its chosen sweep with the status it has now: once the
    sweep ended, the browser is sent the new label as the choice (it kept showing
    "running" beside a list that said "finished"); while nothing changes it is sent
    nothing, so a picker being typed in is left alone."""
    st = RunStore(home / "comera.db")
    sid, ids = seed_sweep(st, unfinished=True)
    at = app("views/sweeps.py", sweep=sid)
    no_exception(at)
    at.run()  # a redraw with nothing changed: the choice is not sent again
    assert not at.selectbox(key="sw-pick").proto.set_value
    st.set_status(ids[-1], "finished")
    at.run()
    no_exception(at)
    pick = at.selectbox(key="sw-pick")
    assert pick.value == sid
    assert pick.proto.set_value and pick.proto.raw_value == f"digits · finished · {sid}"


def test_stop_and_resume_buttons_act_on_the_whole_sweep(home: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("comera_engine.launch.runs.dispatch", lambda *a, **k: [])  # start nothing
    st = RunStore(home / "comera.db")
    sid, ids = seed_sweep(st, unfinished=True)
    at = app("views/sweeps.py", sweep=sid)
    no_exception(at)
    assert not at.button(key="sw-stop").disabled
    at.button(key="sw-stop").click().run()
    no_exception(at)
    assert st.get_run(ids[-1])["status"] == "stopped"  # the waiting cell never starts
    assert st.get_sweep(sid)["status"] == "stopped"
    assert not at.button(key="sw-resume").disabled
    # a cell that failed before its first checkpoint would fail again: left as it is
    st.update_run(ids[0], status="failed", error="ValueError: lr")
    st.run_dir(ids[0]).mkdir(parents=True)
    (st.run_dir(ids[0]) / "config.toml").write_text(
        (ROOT / "experiments" / "configs" / "digits_tt_mlp.toml").read_text())
    at.button(key="sw-resume").click().run()
    no_exception(at)
    assert (f"1 cell(s) queued again. Cell {ids[0]} is left as it is: the run failed before "
            "its first checkpoint") in texts(at)
    assert st.get_run(ids[-1])["status"] == "queued"
    assert [st.get_run(i)["status"] for i in ids[:3]] == ["failed", "finished", "finished"]


def test_new_experiment_launches_a_sweep_once(home: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("comera_engine.launch.runs.dispatch", lambda *a, **k: [])  # start nothing
    at = app("views/new_experiment.py")
    no_exception(at)
    at.text_input(key="sw-targets").set_value("5, 10x, 5").run()
    at.text_input(key="sw-seeds").set_value("2").run()
    at.text_input(key="sw-parallel").set_value("2").run()
    assert "4 runs: 5×, 10× × 2 seed(s)." in texts(at)
    at.button(key="sw-launch").click().run()
    no_exception(at)
    st = RunStore(home / "comera.db")
    sweeps = st.list_sweeps()
    assert len(sweeps) == 1 and sweeps[0]["cells"] == 4 and sweeps[0]["max_parallel"] == 2
    cells = st.sweep_runs(sweeps[0]["id"])
    assert sorted((c["config"]["comera"]["target_compression"], c["config"]["train"]["seed"])
                  for c in cells) == [(5, 0), (5, 1), (10, 0), (10, 1)]
    # named after the config, not after the form's own target (a run's automatic name)
    assert sorted(c["name"] for c in cells) == [
        f"digits-tt-mlp · {t}× seed {s}" for t in (10, 5) for s in (0, 1)]
    assert at.selectbox(key="sw-pick").value == sweeps[0]["id"]  # on the Sweeps page
    at.switch_page("views/new_experiment.py").run()
    at.button(key="sw-launch").click().run()  # the same submission: no second sweep
    assert len(st.list_sweeps()) == 1


def test_a_large_sweep_launches_only_once_its_count_is_ticked(home: Path) -> None:
    """26 cells (a typo away from a few): Launch sweep stays disabled until "Launch all
    26 runs" is ticked; a sweep of a few needs no tick."""
    at = app("views/new_experiment.py")
    at.text_input(key="sw-targets").set_value(", ".join(str(t) for t in range(2, 28))).run()
    at.text_input(key="sw-seeds").set_value("1").run()
    no_exception(at)
    assert "26 runs:" in texts(at) and at.button(key="sw-launch").disabled
    at.checkbox(key="sw-confirm").check().run()
    assert not at.button(key="sw-launch").disabled
    at.text_input(key="sw-targets").set_value("5, 10").run()
    assert not any(c.key == "sw-confirm" for c in at.checkbox)
    assert not at.button(key="sw-launch").disabled


def test_new_experiment_refuses_bad_sweep_targets(home: Path) -> None:
    at = app("views/new_experiment.py")
    at.text_input(key="sw-targets").set_value("5, ten").run()
    assert any("targets: 'ten' is not a number" in e.value for e in at.error)
    assert at.button(key="sw-launch").disabled
    at.text_input(key="sw-targets").set_value("0.5").run()
    assert any("above 1×" in e.value for e in at.error)


def test_a_sweep_with_an_unreachable_target_is_refused_whole(home: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.setattr("comera_engine.launch.runs.dispatch", lambda *a, **k: [])
    at = app("views/new_experiment.py")
    at.text_input(key="sw-targets").set_value("5, 100000").run()
    assert at.button(key="sw-launch").disabled  # refused before the click (issue 46 item 5)
    no_exception(at)
    assert any("comera.target_compression" in e.value and "cell 100000× seed 0" in e.value
               for e in at.error), [e.value for e in at.error]
    st = RunStore(home / "comera.db")
    assert st.list_sweeps() == [] and st.list_runs() == []


def test_compare_loads_a_sweeps_cells(home: Path) -> None:
    st = RunStore(home / "comera.db")
    sid, ids = seed_sweep(st)
    st.create_run("other", {"name": "other"}, "finished")
    at = app("views/compare.py")
    no_exception(at)
    at.selectbox(key="cmp-sweep").set_value(sid).run()
    no_exception(at)
    assert sorted(at.multiselect(key="cmp-runs").value) == sorted(ids)


def test_sweep_fields_are_checked_as_typed_before_the_click(home: Path) -> None:
    """Issue 46 item 5: a sweep target beyond the floor and seeds that are not a whole
    number are refused beside the sweep's fields, with the engine's message (the one a
    click would give, cell named), and Launch sweep is disabled; fixed, it is enabled."""
    at = app("views/new_experiment.py")
    at.text_input(key="sw-targets").set_value("5, 500").run()
    no_exception(at)
    errors = [e.value for e in at.error]
    assert any(e.startswith("comera.target_compression: 500x is beyond the smallest TT "
                            "model") and e.endswith("(cell 500× seed 0)") for e in errors), errors
    assert at.button(key="sw-launch").disabled
    at.text_input(key="sw-targets").set_value("5, 10").run()
    at.text_input(key="sw-seeds").set_value("2.5").run()
    # each field named by its label, not by the CLI flag that gives it
    assert "Seeds per target: must be a whole number >= 1, got 2.5" in [
        e.value for e in at.error]
    assert at.button(key="sw-launch").disabled
    at.text_input(key="sw-seeds").set_value("1000").run()
    assert any(e.startswith("Targets × Other keys × Seeds per target: 2000 cells; a sweep "
                            "has at most") for e in [e.value for e in at.error])
    at.text_input(key="sw-seeds").set_value("1").run()
    at.text_input(key="sw-parallel").set_value("two").run()
    assert "Cells at once: must be a whole number >= 1, got 'two'" in [
        e.value for e in at.error]
    at.text_area(key="sw-grid").set_value("comera.lr_cores 1e-3").run()
    assert any(e.startswith("Other keys: expected section.key=v1,v2,...")
               for e in [e.value for e in at.error])
    at.text_area(key="sw-grid").set_value("").run()
    at.text_input(key="sw-parallel").set_value("2").run()
    assert not at.error and not at.button(key="sw-launch").disabled


def test_a_sweep_over_any_grid_key_from_the_form(home: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 46 item 6: the form sweeps any `--grid` key (read and checked by the engine
    in every cell), with or without targets."""
    monkeypatch.setattr("comera_engine.launch.runs.dispatch", lambda *a, **k: [])
    at = app("views/new_experiment.py")
    at.text_input(key="sw-targets").set_value("").run()
    at.text_area(key="sw-grid").set_value("comera.lr_cores=1e-3,3e-3\ntrain.batch_size=two").run()
    assert any(e.value.startswith("train.batch_size: must be an integer, got 'two'")
               and "(cell" in e.value
               for e in at.error), [e.value for e in at.error]
    assert at.button(key="sw-launch").disabled
    at.text_area(key="sw-grid").set_value("comera.lr_cores=1e-3,3e-3").run()
    at.text_input(key="sw-seeds").set_value("1").run()
    assert "2 runs: comera.lr_cores 0.001, 0.003 × 1 seed(s)." in texts(at)
    at.button(key="sw-launch").click().run()
    no_exception(at)
    st = RunStore(home / "comera.db")
    (sweep,) = st.list_sweeps()
    cells = st.sweep_runs(sweep["id"])
    assert sorted(c["config"]["comera"]["lr_cores"] for c in cells) == [1e-3, 3e-3]
    # the form's own target and ranks stay (only a target sweep picks ranks per cell)
    assert {c["config"]["comera"]["target_compression"] for c in cells} == {60.0}


def test_overview_groups_runs_by_sweep(home: Path) -> None:
    st = RunStore(home / "comera.db")
    solo = st.create_run("solo", {"name": "solo"}, "finished")
    sid, ids = seed_sweep(st)
    at = app("views/overview.py")
    no_exception(at)
    at.toggle(key="overview-group").set_value(True).run()
    table = at.dataframe[0].value
    assert list(table["run id"])[-1] == solo and set(list(table["run id"])[:4]) == set(ids)
    assert list(table["sweep"]) == ["digits"] * 4 + [""]
    # the solo run logged nothing: its accuracy, compression and size cells are blank
    solo_row = table[table["run id"] == solo].iloc[0]
    assert solo_row[["eval acc", "compression", "params"]].isna().all()
    assert blank_when_missing(at) >= 3
