"""Sweeps end to end on the digits TT-MLP: a grid × seeds queued as ordinary runs, at most
``max_parallel`` at once, a killed cell crashing alone, stop/resume of the whole sweep,
the report (mean ± std per grid point, Pareto front) and the ``sweep``/``sweeps``
commands."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from comera_engine.errors import ConfigError
from comera_engine.launch import housekeeping
from comera_engine.launch.liveness import pid_alive
from comera_engine.launch.sweep import (
    cell_label,
    cell_overrides,
    create_sweep,
    expand_cells,
    pareto_front,
    parse_grid,
    resume_sweep,
    stop_sweep,
    sweep_report,
)
from comera_engine.metrics import read_jsonl
from comera_engine.store import FINAL_STATUSES, RunStore
from tests.test_launch import CONFIG, ROOT, wait_for

SHORT = ["train.steps=40", "train.eval_every=20", "train.ckpt_every=0"]
TIMEOUT = 240.0


def wait_sweep(st: RunStore, sid: str, timeout: float = TIMEOUT) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        housekeeping(st)  # what `comera sweeps` and the dashboard do when they poll
        sweep = st.get_sweep(sid)
        return sweep if sweep and sweep["status"] not in ("queued", "running") else None

    return wait_for(done, timeout, f"sweep {sid} to end", every=0.1)


def max_overlap(runs: list[dict[str, Any]]) -> int:
    """The most runs that were running at the same moment (from their start/end times)."""
    edges = sorted([(r["started_at"], 1) for r in runs] + [(r["ended_at"], -1) for r in runs])
    best = cur = 0
    for _, d in edges:
        cur += d
        best = max(best, cur)
    return best


# ------------------------------------------------------------------------------ grids


def test_parse_grid_reads_toml_values_and_keeps_brackets_whole():
    grid = parse_grid(["comera.target_compression=5,10,30.5", 'model.tt_layers=["hidden"],'
                       '["hidden", "output"]', "model.dense=true,false"])
    assert grid == {"comera.target_compression": [5, 10, 30.5],
                    "model.tt_layers": [["hidden"], ["hidden", "output"]],
                    "model.dense": [True, False]}


@pytest.mark.parametrize("item, problem", [
    ("target_compression=5", "section.key"), ("comera.target_compression", "section.key"),
    ("comera.target_compression=", "empty"), ("comera.target_compression=5,,10", "empty"),
    # two alike cells were reported as two samples (95.3% ± 0.0)
    ("comera.target_compression=5,5", "5 is given twice"),
    ("comera.target_compression=5,10,5.0", "5.0 is given twice"),
    ("model.hidden=[64,64],[64, 64]", "is given twice"),
])
def test_parse_grid_refuses_bad_items_in_one_line(item, problem):
    with pytest.raises(ConfigError, match=f"^--grid: .*{problem}"):
        parse_grid([item])


def test_a_key_given_twice_is_refused():
    with pytest.raises(ConfigError, match="given twice"):
        parse_grid(["train.steps=1", "train.steps=2"])


def test_cells_are_every_grid_point_times_every_seed():
    cells = expand_cells({"a.x": [1, 2], "b.y": ["u", "v", "w"]}, seeds=2, base_seed=7)
    assert len(cells) == 12
    assert cells[0] == {"overrides": {"a.x": 1, "b.y": "u"}, "seed": 7}
    assert cells[1] == {"overrides": {"a.x": 1, "b.y": "u"}, "seed": 8}
    assert {tuple(c["overrides"].values()) for c in cells} == {
        (x, y) for x in (1, 2) for y in "uvw"}
    assert cell_overrides(cells[3]) == ["a.x=1", 'b.y="v"', "train.seed=8"]
    assert cell_label({"overrides": {"comera.target_compression": 10.0}, "seed": 1}) == \
        "10× seed 1"


def test_pareto_front_keeps_the_points_nothing_beats():
    pts = [{"c": 5, "a": 0.95}, {"c": 10, "a": 0.96}, {"c": 30, "a": 0.90},
           {"c": 20, "a": 0.89}, {"c": 100, "a": 0.5}, {"c": 7, "a": None}]
    assert pareto_front(pts, "c", "a") == [1, 2, 4]  # 5x is beaten by 10x, 20x by 30x
    losses = [{"c": 5, "l": 1.0}, {"c": 10, "l": 2.0}, {"c": 10, "l": 1.5}]
    assert pareto_front(losses, "c", "l", higher_y=False) == [0, 2]


# ------------------------------------------------------------------------------ refusals


def test_a_bad_cell_refuses_the_whole_sweep_and_writes_nothing(tmp_path):
    st = RunStore(tmp_path / "store")
    with pytest.raises(ConfigError, match=r"comera.target_compression.*\(cell 0.5× seed 0\)"):
        create_sweep(CONFIG, {"comera.target_compression": [10, 0.5]}, seeds=1,
                     overrides=SHORT, store=st)
    assert st.list_sweeps() == [] and st.list_runs() == []
    assert [p.name for p in st.root.iterdir() if p.is_dir()] == []


@pytest.mark.parametrize("kwargs, field", [
    ({"seeds": 0}, "--seeds"), ({"max_parallel": 0}, "--max-parallel"),
    ({"backend": "slurm"}, "--backend"), ({"grid": {}}, "--grid"),
    ({"grid": {"train.seed": [1, 2]}, "seeds": 2}, "--seeds"),
])
def test_bad_sweep_settings_name_the_flag(tmp_path, kwargs, field):
    args = {"grid": {"comera.target_compression": [10]}, "seeds": 1, **kwargs}
    grid = args.pop("grid")
    with pytest.raises(ConfigError, match=f"^{field}: "):
        create_sweep(CONFIG, grid, overrides=SHORT, store=tmp_path / "s", **args)
    assert not (tmp_path / "s" / "comera.db").exists() or not RunStore(tmp_path / "s").list_runs()


# ------------------------------------------------------------------------------ end to end


def test_four_cells_two_at_a_time_end_finished_with_a_report(tmp_path):
    st = RunStore(tmp_path / "store")
    sid = create_sweep(CONFIG, {"comera.target_compression": [5, 20]}, seeds=2,
                       overrides=SHORT, store=st, max_parallel=2)
    sweep = wait_sweep(st, sid)
    assert sweep["status"] == "finished" and sweep["counts"] == {"finished": 4}
    cells = st.sweep_runs(sid)
    assert max_overlap(cells) <= 2
    assert sorted((c["cell"]["overrides"]["comera.target_compression"], c["cell"]["seed"])
                  for c in cells) == [(5, 0), (5, 1), (20, 0), (20, 1)]
    for c in cells:  # ordinary runs: their own folder, config and checkpoint
        cfg = c["config"]
        assert cfg["train"]["seed"] == c["cell"]["seed"]
        assert cfg["comera"]["target_compression"] == c["cell"]["overrides"][
            "comera.target_compression"]
        assert (st.run_dir(c["id"]) / "checkpoints").is_dir()
    rep = sweep_report(st, sid)
    assert rep["metric"] == "eval/acc" and len(rep["cells"]) == 4
    by_target = {g["target"]: g for g in rep["groups"]}
    for target, g in by_target.items():
        runs_ = [c for c in rep["cells"] if c["target"] == target]
        accs = [c["score"] for c in runs_]
        assert g["finished"] == 2 and g["score"] == pytest.approx(sum(accs) / 2)
        # each cell's score is its last eval/acc in its own metrics.jsonl
        for c in runs_:
            jsonl = read_jsonl(st.run_dir(c["run"]) / "metrics.jsonl")
            evals = [r["values"]["eval/acc"] for r in jsonl
                     if r["type"] == "metrics" and "eval/acc" in r["values"]]
            assert c["score"] == pytest.approx(evals[-1])
            # its step time is the run's median step, not its last one
            times = [r["values"]["perf/step_time_s"] for r in jsonl
                     if r["type"] == "metrics" and "perf/step_time_s" in r["values"]]
            assert len(times) > 10
            assert c["step_time_s"] == pytest.approx(statistics.median(times), rel=1e-9)
        assert g["compression"] == pytest.approx(target, rel=0.1)
    assert any(g["pareto"] for g in rep["groups"])
    assert by_target[20]["pareto"]  # nothing is smaller


def test_a_killed_cell_crashes_alone_and_the_sweep_goes_on_then_resumes(tmp_path):
    st = RunStore(tmp_path / "store")
    sid = create_sweep(CONFIG, {"train.steps": [40, 800]}, seeds=2,
                       overrides=["train.eval_every=0", "train.ckpt_every=100"], store=st,
                       max_parallel=2)
    long_cells = [r["id"] for r in st.sweep_runs(sid) if r["cell"]["overrides"][
        "train.steps"] == 800]

    def victim() -> dict[str, Any] | None:
        for rid in long_cells:
            r = st.get_run(rid)
            if r["status"] == "running" and r["pid"] and (r["last_step"] or 0) > 150:
                return r
        return None

    run = wait_for(victim, TIMEOUT, "a long cell to pass a checkpoint", every=0.1)
    os.kill(run["pid"], signal.SIGKILL)
    sweep = wait_sweep(st, sid)
    statuses = {r["id"]: r["status"] for r in st.sweep_runs(sid)}
    assert statuses[run["id"]] == "crashed"
    assert sorted(statuses.values()) == ["crashed", "finished", "finished", "finished"]
    assert sweep["status"] == "failed"
    assert resume_sweep(sid, st) == ([run["id"]], {})
    sweep = wait_sweep(st, sid)
    assert sweep["status"] == "finished"
    again = st.get_run(run["id"])
    assert again["last_step"] == 800 and again["attempt"] >= 2


def test_stop_sweep_stops_waiting_and_running_cells_and_resume_finishes_them(tmp_path):
    st = RunStore(tmp_path / "store")
    sid = create_sweep(CONFIG, {"comera.target_compression": [5, 10, 20]}, seeds=1,
                       overrides=["train.steps=100000", "train.eval_every=0",
                                  "train.ckpt_every=50"], store=st, max_parallel=1)
    first = st.sweep_runs(sid)[0]["id"]
    wait_for(lambda: (st.get_run(first)["last_step"] or 0) > 60, TIMEOUT, "the first cell",
             every=0.1)
    counts = stop_sweep(sid, st, timeout=30)
    assert counts == {"stopped": 3}
    cells = st.sweep_runs(sid)
    assert all(not pid_alive(r["pid"]) for r in cells)
    assert [r["started_at"] is not None for r in cells] == [True, False, False]
    assert st.get_sweep(sid)["status"] == "stopped"
    for r in cells:  # make the resumed cells short
        cfg = st.run_dir(r["id"]) / "config.toml"
        cfg.write_text(cfg.read_text().replace("steps = 100000", "steps = 80"))
    assert sorted(resume_sweep(sid, st).queued) == sorted(r["id"] for r in cells)
    sweep = wait_sweep(st, sid)
    assert sweep["counts"] == {"finished": 3}


# ------------------------------------------------------------------------------ commands


def cli(*args: str, home: Path, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "comera_engine.cli", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "COMERA_HOME": str(home)})


def test_sweep_commands(tmp_path):
    home = tmp_path / "home"
    bad = cli("sweep", str(CONFIG), "--grid", "comera.target_compression=10,0.5", home=home)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "cell 0.5× seed 0" in bad.stderr and not (home / "comera.db").exists()
    out = cli("sweep", str(CONFIG), "--grid", "comera.target_compression=5,10", "--seeds", "1",
              "--max-parallel", "2", *[a for s in SHORT for a in ("--set", s)], "--wait",
              "--json", home=home)
    assert out.returncode == 0, out.stderr[-2000:]
    rep = json.loads(out.stdout)
    assert rep["sweep"]["status"] == "finished" and len(rep["groups"]) == 2
    sid = rep["sweep"]["id"]
    listed = json.loads(cli("sweeps", "--json", home=home).stdout)
    assert [s["id"] for s in listed] == [sid] and listed[0]["counts"] == {"finished": 2}
    text = cli("sweeps", sid[len("sweep-"):], home=home).stdout
    assert "GRID POINT" in text and "5×" in text and "10×" in text
    # accuracy in percent; one seed per grid point: no spread after the header
    assert "%" in text and "± " not in text.split("(MEAN ± STD)")[1]
    runs_ = json.loads(cli("runs", "--json", home=home).stdout)
    assert {r["sweep_id"] for r in runs_} == {sid}  # cells are ordinary runs
    stopped = cli("stop", sid, home=home)
    assert stopped.returncode == 0 and "2 finished" in stopped.stdout
    assert all(r["status"] in FINAL_STATUSES for r in runs_)
