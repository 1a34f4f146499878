"""``comera app --models MODULE --data NAME=PATH,...`` (issue 31 item 3): what is
registered is checked before the dashboard starts (one line naming the flag, exit 2,
nothing created), reaches Streamlit as script arguments, and the New experiment page
offers it: the user model's own preview, a label column and a task from the file, and a
config that carries the factory and the server-resolved paths. The browser side is in
tests/test_browser.py (test_a_user_model_registered_by_comera_app)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from comera_engine.cli import main
from comera_engine.studio import build_registry, parse_data_spec, read_registry, registry_args

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "own"))
from make_data import write_csvs  # noqa: E402

sys.path.remove(str(ROOT / "experiments" / "own"))
MODEL = "experiments.own.model"


@pytest.fixture(scope="module")
def csvs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_csvs(tmp_path_factory.mktemp("studio-data"))


@pytest.mark.parametrize("flags, words", [
    (["--models", "nowhere_xyz"], "--models: module 'nowhere_xyz' is not importable"),
    (["--models", "not a module"], "--models: give a module as package.module"),
    (["--data", "cancer"], "--data: give NAME=PATH"),
    (["--data", "cancer=nope.csv"], f"--data: cancer (train): file not found: {ROOT}/nope.csv"),
    (["--data", "cancer={train},label=tumour"], "--data: cancer (label): column 'tumour' is "
                                                "not in train.csv (its columns: mean_radius"),
    (["--data", "cancer={train},colour=red"], "--data: cancer: 'colour=red' is not one of"),
    (["--data", "cancer={train},task=cluster"], "--data: cancer: task must be classify or "
                                                "regress"),
    (["--data", "a={train}", "--data", "a={train}"], "--data: 'a' is registered twice"),
])
def test_bad_flags_are_one_line_exit_2_and_start_nothing(flags, words, csvs, tmp_path,
                                                         monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    home = tmp_path / "home"
    monkeypatch.setenv("COMERA_HOME", str(home))
    monkeypatch.setattr("os.execvpe", lambda *a: pytest.fail("the dashboard was started"))
    argv = ["app", "--port", "1", *(f.format(train=csvs[0]) for f in flags)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("comera: error: ") and words in err[0], err
    assert not home.exists()


def test_the_registry_reaches_the_dashboard_as_script_arguments(csvs, tmp_path,
                                                                 monkeypatch) -> None:
    from app import launcher

    # a module found only from the folder `comera app` was started in: that folder goes
    # on the dashboard's PYTHONPATH (its runs inherit it)
    (tmp_path / "my_nets.py").write_text(
        "from torch import nn\nCOMERA_MODELS = {'wide': 'make'}\n"
        "def make(in_features, num_classes):\n    '''A one-layer net.\n\n    More.'''\n"
        "    return nn.Linear(in_features, num_classes)\n", encoding="utf-8")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "my_nets", raising=False)
    import shutil

    train = Path(shutil.copy(csvs[0], tmp_path / "mine.csv"))
    evals = csvs[1]
    reg = build_registry(["my_nets"], [f"cancer={train.name},eval={evals}"], cwd=tmp_path)
    assert reg["models"] == {"wide": {"factory": "my_nets:make", "module": "my_nets",
                                      "summary": "A one-layer net."}}
    assert reg["paths"] == [str(tmp_path.resolve())]
    cancer = reg["data"]["cancer"]
    assert cancer["train"] == str(train.resolve()) and cancer["eval"] == str(evals.resolve())
    assert cancer["label"] is None and cancer["task"] == "classify"  # picked on the form
    assert cancer["columns"][-1] == "diagnosis" and cancer["rows"] > 400

    args = registry_args(reg)
    cmd = launcher.streamlit_command(port=8502, script_args=args)
    assert cmd[-3:] == ["--", *args]
    assert read_registry(["Home.py", *args]) == reg
    assert read_registry(["Home.py"]) == {"models": {}, "data": {}, "paths": []}
    env = launcher.app_env(tmp_path / "home", reg["paths"])
    assert env["PYTHONPATH"].split(":")[-1] == str(tmp_path.resolve())


def test_parse_data_spec() -> None:
    assert parse_data_spec("t=a.csv,label=y,task=regress,eval=b.csv") == (
        "t", {"train": "a.csv", "label": "y", "task": "regress", "eval": "b.csv"})
    for bad in ("=a.csv", "t=", "t=a.csv,label=", "t=a.csv,label=y,label=z", "../x=a.csv"):
        with pytest.raises(Exception, match="^--data: "):
            parse_data_spec(bad)


def test_user_model_on_the_form(csvs, monkeypatch, tmp_path) -> None:
    """The form's config for a registered model validates; the New experiment page offers
    it first, previews its TT layers, and a regression on a text label is refused."""
    from app.lib.form import FormValues, form_to_config
    from app.lib.presets import user_presets
    from comera_engine.launch import resolve_config

    monkeypatch.chdir(ROOT)
    train, evals = csvs
    reg = build_registry([MODEL], [f"cancer={train},eval={evals},label=diagnosis"])
    (preset,) = user_presets(reg).values()
    raw, _ = form_to_config(preset.config(), FormValues(
        data=preset.raw["data"], rank=6, linear_layout="ttm", task="classify", steps=40,
        run_name="mine"))
    assert "preset" not in raw["model"] and raw["model"]["tensorize"] == {"layout": "ttm"}
    cfg = resolve_config(raw)
    assert (cfg.model.factory, cfg.model.rank, cfg.task) == (f"{MODEL}:tabular_net", 6,
                                                            "classify")
    assert (cfg.data["train"], cfg.data["label"]) == (str(train), "diagnosis")

    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("COMERA_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sys, "argv", ["Home.py", *registry_args(reg)])
    at = AppTest.from_file(str(ROOT / "app" / "Home.py"), default_timeout=120).run()
    at.switch_page("views/new_experiment.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="preset").value == "user:tabular_net"  # yours, first
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Compression (TT layers)"].endswith("×"), metrics
    assert [s.label for s in at.selectbox][:3] == ["Model preset", "Dataset", "Label column"]
    assert not [r for r in at.radio if r.label == "Model size"]  # the factory's own size
    at.radio(key="user:tabular_net:task:cancer").set_value("regress").run()
    errors = " ".join(e.value for e in at.error)
    assert "data.label: column 'diagnosis' is not numeric" in errors, errors
    assert at.button(key="launch").disabled
