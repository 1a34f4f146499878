"""The reproduction pipeline, smoke-tested: ``experiments/reproduce.py --quick`` on digits
runs every method as sweeps of ordinary runs in the store, the JSON agrees with the runs'
own metrics files, the compressions are near the targets, and
``experiments/reproduce_report.py`` turns it into a results page with a figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from comera_engine.metrics import read_jsonl
from comera_engine.store import RunStore

ROOT = Path(__file__).resolve().parents[1]


def last_eval(folder: Path, name: str) -> float:
    values = [r["values"][name] for r in read_jsonl(folder / "metrics.jsonl")
              if r["type"] == "metrics" and name in r["values"]]
    return values[-1]


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, RunStore, Path]:
    pytest.importorskip("tltorch", reason="tensorly-torch is not installed (the peers extra)")
    tmp = tmp_path_factory.mktemp("reproduce")
    env = {**os.environ, "COMERA_HOME": str(tmp / "home")}
    out = subprocess.run(
        [sys.executable, "experiments/reproduce.py", "--quick", "--tasks", "digits",
         "--max-parallel", "2", "--out", str(tmp / "out")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp / "out" / "digits_quick.json").read_text())
    return result, RunStore(tmp / "home"), tmp


def test_every_method_ran_at_every_target_through_the_store(quick) -> None:
    result, st, _ = quick
    methods = result["methods"]
    assert set(methods) == {"dense", "comera", "fixed", "tt_svd", "tt_svd_ft", "tltorch",
                            "prune", "int8", "prune_int8", "comera_int8"}
    assert result["targets"] == [10.0, 30.0] and result["seeds"] == 1
    assert [g["target"] for g in methods["dense"]["groups"]] == [None]
    assert [g["target"] for g in methods["int8"]["groups"]] == [None]
    for name, res in methods.items():
        for g in res["groups"]:
            assert g["finished"] == g["cells"] == 1, (name, g)
        for cell in res["cells"]:  # the score is the run's own last evaluation
            run = st.get_run(cell["run"])
            assert run["status"] == "finished" and run["sweep_id"] in res["sweeps"]
            assert cell["score"] == pytest.approx(
                last_eval(st.run_dir(cell["run"]), "eval/acc"))
    # dense, comera, fixed, tltorch; TT-SVD, its fine-tune, pruning and int8 per seed;
    # int8 of the pruned model and of CoMERA's per seed and target (--quick: CoMERA's
    # other schedules left out)
    assert len(st.list_sweeps()) == 4 + 4 + 2 + 2
    for name in ("comera", "fixed", "tt_svd", "tt_svd_ft", "tltorch", "prune"):
        for g in methods[name]["groups"]:
            assert g["compression"] == pytest.approx(g["target"], rel=0.10), (name, g)


def test_tt_svd_starts_from_the_dense_run_of_its_seed(quick) -> None:
    result, st, _ = quick
    dense = result["methods"]["dense"]["cells"][0]
    for cell in result["methods"]["tt_svd"]["cells"]:
        cfg = st.get_run(cell["run"])["config"]
        assert cfg["model"]["init_from"] == str(st.run_dir(dense["run"]))
        assert cfg["train"]["steps"] == 0 and cell["step"] == 0
    for cell in result["methods"]["tt_svd_ft"]["cells"]:
        assert st.get_run(cell["run"])["config"]["train"]["steps"] == 75  # 300 × 0.25


def test_the_report_tabulates_the_json_and_draws_the_front(quick) -> None:
    pytest.importorskip("matplotlib")
    result, _, tmp = quick
    page = tmp / "RESULTS.md"
    out = subprocess.run([sys.executable, "experiments/reproduce_report.py", "--quick",
                          "--results", str(tmp / "out"), "--out", str(page)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    text = page.read_text()
    assert (tmp / "figures" / "reproduce_digits_quick.png").stat().st_size > 5000
    comera = {g["target"]: g for g in result["methods"]["comera"]["groups"]}
    row = next(line for line in text.splitlines() if line.startswith("| 10× |"))
    # one seed: the mean alone, no "± 0.0" (one seed says nothing of the spread)
    assert f"| {comera[10.0]['score'] * 100:.1f}<br>" in row and "±" not in row
    cost = [line for line in text.splitlines() if line.startswith("| 10× |")][1]
    assert f"{comera[10.0]['params'] / 1e3:,.1f}k params" in cost
    assert f"{comera[10.0]['step_time_s'] * 1e3:.1f} ms/step" in cost
    # a cell's step time is its run's median step, and the page says so
    assert all(m.get("step_time") == "median" for m in result["methods"].values())
    assert "ms/step: each run's median step;" in text and "last logged step" not in text
    dense = result["methods"]["dense"]["groups"][0]["score"]
    gap = (dense - comera[10.0]["score"]) * 100
    claim = next(line for line in text.splitlines()
                 if "of dense at 10× on digits" in line)
    assert f"gap {gap:.1f} points" in claim
    assert ("| yes |" in claim) == (-1.0 <= gap <= 1.0)


def _result(dense: float, comera: float) -> dict:
    groups = {"dense": [{"target": None, "score": dense, "compression": 1.0}],
              "comera": [{"target": 10.0, "score": comera, "compression": 10.1}]}
    return {"targets": [10.0], "methods": {m: {"groups": g, "higher_is_better": True}
                                           for m, g in groups.items()}}


def test_the_cost_table_says_which_step_times_are_one_sample() -> None:
    """Results written before the sweep report kept a run's median step time hold its
    last logged step's; the page names those methods instead of calling them medians."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import reproduce_report

    res = _result(0.976, 0.950)
    for g in res["methods"].values():
        g["groups"][0].update(params=1000.0, step_time_s=0.002, peak_mem_mb=100.0)
    old = reproduce_report.cost_table(res)[0]
    assert "last logged step, one sample, not its median" in old
    res["methods"]["dense"]["step_time"] = "median"
    mixed = reproduce_report.cost_table(res)[0]
    assert "each run's median step; for CoMERA (paced) its last logged step" in mixed
    res["methods"]["comera"]["step_time"] = "median"
    assert "each run's median step;" in reproduce_report.cost_table(res)[0]
    assert "last logged" not in reproduce_report.cost_table(res)[0]


@pytest.mark.parametrize("dense, comera, verdict", [
    (0.976, 0.958, "| **no** |"),  # 1.8 points below dense
    (0.960, 0.955, "| yes |"),  # within the point
    (0.331, 0.388, "not a fair check"),  # the dense model did not train
])
def test_the_claims_table_judges_the_gap_to_dense(dense, comera, verdict) -> None:
    sys.path.insert(0, str(ROOT / "experiments"))
    import reproduce_report

    rows = reproduce_report.claims({"digits": _result(dense, comera)})
    row = next(r for r in rows if "of dense at 10× on digits" in r)
    assert f"gap {(dense - comera) * 100:.1f} points" in row and verdict in row


def test_a_peer_wins_only_by_more_than_the_seed_spread() -> None:
    sys.path.insert(0, str(ROOT / "experiments"))
    import reproduce_report

    def verdict(fixed: float, std: float) -> str:
        res = _result(0.976, 0.950)
        res["targets"] = [10.0]
        res["methods"]["comera"]["groups"][0]["score_std"] = std
        res["methods"]["fixed"] = {"groups": [{"target": 10.0, "score": fixed,
                                               "score_std": std, "compression": 10.0}]}
        return next(r for r in reproduce_report.claims({"digits": res})
                    if "as good as fixed-rank" in r)

    assert verdict(0.955, 0.01).endswith("| yes |")  # 0.5 points, std 1 point: a tie
    assert "digits 10× by fixed-rank TT (2.0)" in verdict(0.970, 0.01)


def test_slow_tasks_run_a_smaller_grid_at_cpu_size_unless_told() -> None:
    """At CPU size the slow tasks keep to their own targets and leave out their slowest
    peer (the hour budget); --quick, --targets and --methods win over them."""
    import argparse

    sys.path.insert(0, str(ROOT / "experiments"))
    import reproduce

    def grid(task: str, **kw: object) -> tuple[list[str], list[float]]:
        args = argparse.Namespace(**{"scale": "cpu", "quick": False, "methods": None,
                                     "targets": None, **kw})
        return reproduce.task_grid(reproduce.TASKS[task], args, list(reproduce.TARGETS))

    every = [m for m in reproduce.METHODS if m not in reproduce.EMBEDDING_PEERS]
    skip = ("tltorch", *reproduce.SHRINK, *reproduce.SCHEDULES)
    # the embedding task: TT and the embedding peers only, at its own targets, --quick too
    emb = ["comera", "fixed", *reproduce.EMBEDDING_PEERS]
    assert grid("criteo") == (emb, [100.0, 300.0, 1000.0])
    assert grid("criteo", quick=True)[0] == emb
    assert grid("snli_small") == ([m for m in every if m not in skip], [10.0, 30.0])
    assert grid("adult")[0] == [m for m in every
                                if m not in (*reproduce.SHRINK, *reproduce.SCHEDULES)]
    assert grid("snli_tiny")[0] == [m for m in every]  # the schedules and the peers run here
    assert grid("digits") == (every, list(reproduce.TARGETS))
    quick = [m for m in every if m not in reproduce.SCHEDULES]
    assert grid("snli_small", quick=True) == (quick, list(reproduce.TARGETS))
    assert "sched_comera" in grid("digits", quick=True, methods=["sched_comera"])[0]
    assert grid("snli_small", targets=[5.0])[1] == list(reproduce.TARGETS)  # main() passes them
    assert grid("snli_small", methods=["dense"])[0] == ["dense"]
    assert grid("snli_small", scale="paper")[1] == list(reproduce.TARGETS)


def test_the_page_names_the_machine_each_task_and_each_added_method_ran_on(tmp_path) -> None:
    """Results files from two machines: the header lists both with their tasks (not the
    first file's machine for all), each section names its own, and methods added to a
    file later on another machine are named with theirs."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import reproduce_report

    src = ROOT / "experiments" / "results" / "reproduce"
    folder = tmp_path / "results"
    folder.mkdir()
    for name, cpu in (("adult", "CPU A"), ("snli_heldout", "CPU B")):
        data = json.loads((src / f"{name}.json").read_text())
        data["machine"] = {**data["machine"], "cpu_model": cpu}
        data["added"] = [{"methods": ["dense"], "machine": {**data["machine"],
                                                           "cpu_model": "CPU C"},
                          "wall_s": 1.0}] if name == "adult" else []
        (folder / f"{name}.json").write_text(json.dumps(data))
    page = reproduce_report.build(folder, tmp_path / "RESULTS.md")
    header = next(line for line in page.splitlines() if line.startswith("Machines"))
    assert "CPU A, 2 cores" in header and "(adult)" in header
    assert "CPU B, 2 cores" in header and "(snli_heldout)" in header
    sections = [line for line in page.splitlines() if "min for the whole task on" in line]
    assert len(sections) == 2
    adult = next(line for line in sections if "dlrm_adult" in line)
    assert "on CPU A" in adult and "dense on CPU C" in adult and "added later" in adult
    assert "on CPU B" in next(line for line in sections if line is not adult)
    assert "added later" not in next(line for line in sections if line is not adult)


def test_methods_run_again_replace_theirs_and_say_where_they_ran() -> None:
    sys.path.insert(0, str(ROOT / "experiments"))
    import reproduce

    old = {"wall_s": 100.0, "machine": {"cpu_model": "A"},
           "methods": {"dense": {"groups": [1]}, "comera": {"groups": [2]}}}
    new = {"wall_s": 10.0, "machine": {"cpu_model": "B"},
           "methods": {"comera": {"groups": [3]}, "fixed": {"groups": [4]}}}
    out = reproduce.add_methods(old, new, ["comera", "tltorch"])
    assert out["methods"] == {"dense": {"groups": [1]}, "comera": {"groups": [3]}}
    assert out["wall_s"] == 110.0 and out["machine"] == {"cpu_model": "A"}
    assert out["added"] == [{"methods": ["comera"], "machine": {"cpu_model": "B"},
                             "wall_s": 10.0}]
    assert "added" not in old and old["methods"]["comera"] == {"groups": [2]}


def test_the_embedding_task_runs_end_to_end_at_a_tiny_scale(tmp_path: Path) -> None:
    """``--tasks criteo`` at the quick scale (tables / 1000): fixed-rank TT and the hashing
    trick as sweeps in the store, the JSON's AUC and log-loss those of the runs, each
    cell's weights within the target's budget, the data's Bayes AUC recorded, and the
    report's budget table naming a winner."""
    env = {**os.environ, "COMERA_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT),
           "COMERA_NATIVE": "0"}
    out = subprocess.run(
        [sys.executable, "experiments/reproduce.py", "--quick", "--tasks", "criteo",
         "--methods", "fixed", "hash", "--targets", "10", "--no-probe", "--max-parallel", "2",
         "--out", str(tmp_path / "out")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "criteo_quick.json").read_text())
    st = RunStore(tmp_path / "home")
    assert set(result["methods"]) == {"fixed", "hash"}
    assert result["data"]["extra"]["bayes_auc_eval"] > 0.6
    for res in result["methods"].values():
        (g,) = res["groups"]
        assert g["target"] == 10.0 and g["finished"] == 1
        (cell,) = res["cells"]
        folder = st.run_dir(cell["run"])
        assert cell["score"] == pytest.approx(last_eval(folder, "eval/auc"))
        assert cell["log_loss"] == pytest.approx(last_eval(folder, "eval/loss"))
    # the hashing trick's model as peer_dlrm builds it (its stored parameters); fixed
    # ranks at 10x of the same tables: no more bytes (within the rank rounding)
    from comera_engine.data.criteo_synth import criteo_cardinalities
    from comera_engine.models.dlrm import peer_dlrm

    model = peer_dlrm(criteo_cardinalities(1000.0), peer="hash", target=10.0)
    hashed = sum(p.numel() * p.element_size() for p in model.parameters())
    assert result["methods"]["hash"]["groups"][0]["bytes"] == hashed
    assert result["methods"]["fixed"]["groups"][0]["bytes"] <= 1.1 * hashed
    # the studio's one compression figure (runs list, Sweeps, Compare) for both: the
    # tables' dense bytes over their stored bytes, not a dense model's 1x
    from comera_engine.metrics import run_compression

    for name, res in result["methods"].items():
        run = st.get_run(res["cells"][0]["run"])
        shown = run_compression(run["config"], st.latest_metrics(run["id"])).value
        assert shown == pytest.approx(10.0, rel=0.05), name
        assert res["groups"][0]["compression"] == pytest.approx(shown)
    sys.path.insert(0, str(ROOT / "experiments"))
    import reproduce_report

    text = "\n".join(reproduce_report.embedding_section(result, tmp_path, "criteo", ""))
    assert "Bayes AUC" in text and "| ≤ " in text


def test_the_embedding_probe_measures_what_the_tables_hold() -> None:
    """A probe's peak training memory covers the dense tables and their two Adam moments
    (3 × 4 bytes a float), and its table bytes are the model's stored parameters."""
    sets = ["data.scale=100", 'model.kwargs={peer="dense"}', "train.batch_size=64"]
    spec = {"config": str(ROOT / "experiments" / "configs" / "dlrm_criteo_peers.toml"),
            "sets": sets}
    # in its own process, as reproduce.py runs it (memory this one freed would be reused)
    out = subprocess.run([sys.executable, "experiments/reproduce.py", "--probe-cell",
                          json.dumps(spec)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT),
                                           "COMERA_NATIVE": "0"})
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    from comera_engine.data.criteo_synth import criteo_cardinalities

    tables = sum(n for n in criteo_cardinalities(100.0) if n >= 200) * 16 * 4
    assert row["table_bytes"] >= tables
    assert row["peak_train_mb"] * 2**20 >= 3 * tables * 0.95
    assert row["step_s"] > 0


def test_the_readme_quotes_the_reproduction_on_the_datasets() -> None:
    """README's "Datasets" figures are the committed reproduction's (computed by
    reproduce_report.readme_datasets from the JSON, not written by hand): rerunning a task
    and not the README fails here."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import reproduce_report

    said = reproduce_report.readme_datasets()
    assert said.count("dense") == len(reproduce_report.README_TASKS)  # every task found
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert " ".join(said.split()) in readme, f"README should say: {said}"


def test_the_datasets_sentence_states_the_smallest_target_and_the_steps(tmp_path) -> None:
    sys.path.insert(0, str(ROOT / "experiments"))
    import reproduce_report

    res = _result(0.791, 0.778)
    res["methods"]["comera"]["metric"] = "eval/auc"
    res["methods"]["comera"]["groups"].insert(0, {"target": 5.0, "score": 0.78,
                                                  "score_std": 0.002, "compression": 5.12})
    res["overrides"] = ["train.steps=400"]
    (tmp_path / "reviews.json").write_text(json.dumps(res))
    said = reproduce_report.readme_datasets(tmp_path)
    assert "`reviews` AUC 0.780 ± 0.002 at 5.1× (asked 5×) vs 0.791 dense (400 steps)" in said
    assert "movielens" not in said  # a task without results is left out
