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
    assert read_registry(["Home.py"]) == {"models": {}, "data": {}, "configs": {},
                                          "paths": []}
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
    # yours first: the config beside the module, then the model with its defaults
    assert at.selectbox(key="preset").options[:2] == [
        "own-breast-cancer · your config breast_cancer.toml",
        "tabular_net · your model, its function's defaults"]
    at.selectbox(key="preset").set_value("user:tabular_net").run()
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Compression (TT layers)"].endswith("×"), metrics
    assert [s.label for s in at.selectbox][:3] == ["Start from", "Dataset", "Label column"]
    assert not [r for r in at.radio if r.label == "Model size"]  # the factory's own size
    at.radio(key="user:tabular_net:task:cancer").set_value("regress").run()
    errors = " ".join(e.value for e in at.error)
    assert "data.label: column 'diagnosis' is not numeric" in errors, errors
    assert at.button(key="launch").disabled


def _fake_launch(calls: list[dict]):
    def launch(config, overrides=(), store=None, name=None, gpus=None, nproc=1,
               max_concurrent=None) -> str:
        calls.append(dict(config))
        return store.create_run(config["name"], config, "queued")
    return launch


def _same_files(cfg, base: Path) -> dict:
    """A resolved config's tables, its data files as absolute paths (from ``base``)."""
    from comera_engine.studio import data_paths

    out = cfg.to_dict()
    out["data"] = {**out["data"], **data_paths(out["data"], base)}
    return out


def test_the_form_launches_what_the_toml_trains(tmp_path, monkeypatch, one_thread) -> None:
    """Issue 46 item 1: `comera app --models experiments.own.model --data cancer=...`
    offers the example's own config (experiments/own/breast_cancer.toml, beside the
    module) first; launched from the form untouched, the run's config is the TOML's
    (learning rates, layout, kwargs, steps, batch, schedule: everything but the name),
    and the form shows those settings with the config's values."""
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    from comera_engine.config import config_from_dict, load_config, parse_value

    repo = tmp_path / "repo"  # the folder `comera app` starts in: the TOML's paths resolve here
    write_csvs(repo / "experiments" / "own" / "data")
    monkeypatch.chdir(repo)
    reg = build_registry([MODEL], ["cancer=experiments/own/data/train.csv"])
    assert list(reg["configs"]) == ["own-breast-cancer"]
    assert reg["configs"]["own-breast-cancer"]["source"].endswith("breast_cancer.toml")
    calls: list[dict] = []
    monkeypatch.setattr("comera_engine.launch.launch", _fake_launch(calls))
    monkeypatch.setenv("COMERA_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sys, "argv", ["Home.py", *registry_args(reg)])
    at = AppTest.from_file(str(ROOT / "app" / "Home.py"), default_timeout=120).run()
    at.switch_page("views/new_experiment.py").run()
    assert not at.exception, [e.value for e in at.exception]
    key = "cfg:own-breast-cancer"
    assert at.selectbox(key="preset").value == key  # your config, first
    shown = {w.key.removeprefix(key + ":"): w.value for w in at.text_input}
    assert shown["comera.lr_cores"] == "0.003" and shown["comera.lr_dense"] == "0.003"
    assert shown["train.lr"] == "0.001" and shown["comera.lr_gates"] == ""
    assert parse_value(shown["kwargs"]) == {"hidden": [64, 64], "dropout": 0.1}
    assert at.radio(key=f"{key}:layout").value == "ttm"
    assert at.selectbox(key=f"{key}:schedule").value == "paced"
    assert at.text_input(key=f"{key}:steps").value == "300"
    assert at.text_input(key=f"{key}:batch").value == "32"
    assert "the config's data · train.csv + eval.csv, label diagnosis" in \
        at.selectbox(key=f"{key}:data").options[0]
    # no error but the sweep's (its default targets 30x and 100x are past this model's
    # floor, which it says before any click)
    assert not [e.value for e in at.error if "(cell " not in e.value]
    assert not at.button(key="launch").disabled
    at.button(key="launch").click().run()
    assert not at.exception, [e.value for e in at.exception]
    (launched,) = calls
    toml = load_config(ROOT / "experiments" / "own" / "breast_cancer.toml", base_dir=repo)
    form = config_from_dict({**launched, "name": toml.name})
    assert _same_files(form, repo) == _same_files(toml, repo)
    # and it trains as the TOML does: 98.2 % from `comera train` (the engine's defaults,
    # which the form used to launch, gave 90.3 %)
    from comera_engine.train.loop import train

    form.base_dir = str(repo)
    result = train(form, tmp_path / "run", progress=False)
    assert result.metrics["eval/acc"] >= 0.96, result.metrics["eval/acc"]
