"""Your own model and your own data (issue 31) on the worked example of
``experiments/own``: scikit-learn's breast-cancer table written as CSV files, the
example's own network by entry point. ``comera train`` / ``launch`` / a 2×2 ``sweep``
finish; the export loads back to the run's model and runs in onnxruntime; every bad input
is refused in one line (exit 2) with nothing created in the run store. Beside the example:
a regression on a CSV with categorical and text columns, and data.factory with
task.factory."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from comera_engine.cli import main
from comera_engine.config import config_from_dict
from comera_engine.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "own"))
from make_data import LABEL, write_csvs  # noqa: E402

sys.path.remove(str(ROOT / "experiments" / "own"))
SHORT = {"steps": 40, "batch_size": 32, "eval_every": 20, "ckpt_every": 0, "device": "cpu"}


@pytest.fixture(scope="module")
def csvs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_csvs(tmp_path_factory.mktemp("own-data"))


def toml(path: Path, train: Path, evals: Path | None, task: str = '"classify"',
         model: str = 'factory = "experiments.own.model:tabular_net"', data: str = "",
         steps: int = SHORT["steps"]) -> Path:
    """The example's config (experiments/own/breast_cancer.toml) at a test's size."""
    eval_line = f'eval = "{evals}"' if evals else ""
    text = f"""name = "own-test"
task = {task}

[model]
{model}
kwargs = {{ hidden = [32, 32], dropout = 0.0 }}

[model.tensorize]
exclude = ["head"]
layout = "ttm"

[data]
name = "files"
train = "{train}"
{eval_line}
label = "{LABEL}"
{data}

[comera]
target_compression = 3
lr_cores = 3e-3
lr_dense = 3e-3

[train]
steps = {steps}
batch_size = 32
eval_every = 20
ckpt_every = 0
device = "cpu"
"""
    path.write_text(text, encoding="utf-8")
    return path


def store_files(home: Path) -> list[Path]:
    return sorted(home.rglob("*")) if home.exists() else []


# ---------------------------------------------------------------------- config keys


def test_user_model_keys_are_checked_in_one_line() -> None:
    base = {"data": {"name": "files"}}
    cfg = config_from_dict({**base, "model": {"factory": "pkg.mod:fn",
                                              "tensorize": {"rank": 6}}})
    assert cfg.model.name == "custom" and cfg.model.rank == 6  # the fixed rank is the model's
    for model, field in [({"factory": "no colon"}, "model.factory"),
                         ({"factory": "a:b", "tensorize": {"rnak": 3}}, "model.tensorize.rnak"),
                         ({"factory": "a:b", "tensorize": {"rank": 0}}, "model.tensorize.rank"),
                         ({"factory": "a:b", "linear_layout": "tt"}, "model.linear_layout"),
                         ({"name": "tt_mlp", "kwargs": {"a": 1}}, "model.kwargs"),
                         ({"name": "custom"}, "model.factory")]:
        with pytest.raises(ConfigError) as err:
            config_from_dict({**base, "model": model})
        assert err.value.field == field and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="^task: unknown value 'regres' \\(did you mean "):
        config_from_dict({**base, "model": {"factory": "a:b"}, "task": "regres"})
    with pytest.raises(ConfigError, match="^task.factory: missing"):
        config_from_dict({**base, "model": {"factory": "a:b"}, "task": {"kwargs": {}}})


# ---------------------------------------------------------------------- train, export, load


def test_train_export_load_and_onnx_give_the_runs_outputs(tmp_path, csvs, monkeypatch,
                                                          capsys) -> None:
    monkeypatch.chdir(ROOT)  # the example's module is found from the folder a run starts in
    cfg = toml(tmp_path / "own.toml", *csvs, steps=60)
    assert main(["train", str(cfg), "--no-progress", "--run-dir", str(tmp_path / "run")]) == 0
    run = tmp_path / "run"
    # every file the run read, by its SHA-256 (hashlib over the bytes, here)
    files = json.loads((run / "dataset.json").read_text())["files"]
    assert [f["sha256"] for f in files] == [hashlib.sha256(p.read_bytes()).hexdigest()
                                            for p in csvs]
    final = [json.loads(line)["values"] for line in (run / "metrics.jsonl").open()
             if '"eval/auc"' in line][-1]
    assert final["eval/acc"] > 0.9 and final["eval/auc"] > 0.95  # it learnt the table
    assert abs(final["compression/tensorized"] / 3 - 1) <= 0.05  # at the target

    from comera_engine import load
    from comera_engine.export import export_run, load_run_model

    trained, _ = load_run_model(run)
    res = export_run(run, out=tmp_path / "exp" / "model.safetensors")
    card = res.card.read_text()
    assert "experiments.own.model:tabular_net" in card and '"hidden": [32, 32]' in card
    loaded = load(res.path)
    import numpy as np

    rows = np.loadtxt(csvs[1], delimiter=",", skiprows=1, usecols=range(30))
    mean, std = (torch.tensor(v) for v in json.loads(
        (run / "dataset.json").read_text())["extra"]["standardise"].values())
    x = ((torch.tensor(rows) - mean) / std).float()
    with torch.no_grad():
        assert torch.equal(loaded.network(x), trained(x))
        # the export takes the raw rows and prepares them itself (issue 46 item 2)
        torch.testing.assert_close(loaded(torch.tensor(rows).float()), trained(x),
                                   rtol=1e-4, atol=1e-4)
    onnx = export_run(run, format="onnx", out=tmp_path / "exp" / "model.onnx")
    assert onnx.onnx_max_abs_diff is not None and onnx.onnx_max_abs_diff < 1e-4

    # the factory is imported from the path: elsewhere, one line says which module
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != ROOT])
    for name in [m for m in sys.modules if m.startswith("experiments")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ConfigError, match="module 'experiments.own.model' is not importable; "
                                          "put the folder that holds it on PYTHONPATH"):
        load(res.path)


# ---------------------------------------------------------------------- bad input


BAD_MODULE = '''
import torch
NOT_CALLABLE = 3
def raises(**kw): raise RuntimeError("no weights for you")
def not_module(**kw): return torch.zeros(3)
def bad_task(): return 3
'''


@pytest.mark.parametrize("case, field, words", [
    ("no_module", "model.factory", "module 'nowhere_xyz' is not importable"),
    ("not_callable", "model.factory", "not callable"),
    ("raises", "model.factory", "raised RuntimeError: no weights for you"),
    ("not_module", "model.factory", "returned a Tensor, not an nn.Module"),
    ("missing_file", "data.train", "file not found"),
    ("unreadable", "data.train", "cannot read"),
    ("no_column", "data.features", "(its columns: mean_radius, mean_texture"),
    ("one_class", "data.label", "has one class"),
    ("numbers_as_text", "data.text", "holds numbers, not text"),
    # a continuous column as a classifier's label: each value a class, eval's unseen
    ("continuous_label", "data.label", 'continuous numbers, a regression\'s target: set task '
                                       '= "regress"'),
    ("task_factory", "task.factory", "returned int"),
])
def test_bad_input_is_one_line_exit_2_and_creates_nothing(tmp_path, csvs, monkeypatch, capsys,
                                                          case, field, words) -> None:
    (tmp_path / "own_bad_mod.py").write_text(BAD_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(ROOT)
    home = tmp_path / "home"
    monkeypatch.setenv("COMERA_HOME", str(home))
    train, evals = csvs
    kw: dict = {}
    if case in ("no_module", "not_callable", "raises", "not_module"):
        kw["model"] = 'factory = "' + {"no_module": "nowhere_xyz:f",
                                       "not_callable": "own_bad_mod:NOT_CALLABLE",
                                       "raises": "own_bad_mod:raises",
                                       "not_module": "own_bad_mod:not_module"}[case] + '"'
    elif case == "missing_file":
        train = tmp_path / "nope.csv"
    elif case == "unreadable":
        train = tmp_path / "garbage.parquet"
        train.write_bytes(b"\x00not parquet at all" * 10)
    elif case == "no_column":
        kw["data"] = 'features = ["mean_radius", "tumour_colour"]'
    elif case == "one_class":
        lines = train.read_text().splitlines()
        train = tmp_path / "one.csv"
        train.write_text("\n".join([lines[0]] + [ln for ln in lines[1:]
                                                 if ln.endswith(",benign")]) + "\n")
        evals = None
    elif case == "numbers_as_text":
        kw["data"] = 'text = "mean_radius"'
    elif case == "continuous_label":
        def measured(src: Path, name: str, shift: float) -> Path:  # the label a measurement
            lines = src.read_text().splitlines()
            col = lines[0].split(",").index(LABEL)
            rows = [ln.split(",") for ln in lines[1:]]
            for i, row in enumerate(rows):
                row[col] = f"{shift + 0.013 * i:.3f}"
            (tmp_path / name).write_text("\n".join([lines[0], *map(",".join, rows)]) + "\n")
            return tmp_path / name
        train, evals = measured(train, "m_train.csv", 0.5), measured(evals, "m_eval.csv", 900.0)
    elif case == "task_factory":
        kw["task"] = '{ factory = "own_bad_mod:bad_task" }'
    cfg = toml(tmp_path / "bad.toml", train, evals, **kw)
    rc = main(["train", str(cfg), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"comera: error: {field}: ") and words in err[0], err[0]
    assert store_files(home) == []  # no store, no run folder
    if case in ("raises", "no_column"):  # comera launch refuses it before queueing, alike
        assert main(["launch", str(cfg)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"comera: error: {field}: "), err
        assert store_files(home) == []


# ---------------------------------------------------------------------- launch, sweep


def test_launch_and_a_2x2_sweep_of_the_example_finish(tmp_path, csvs, monkeypatch,
                                                      capsys) -> None:
    """``comera launch`` and a 2x2 ``comera sweep --wait`` through the CLI's own main (in
    this process: the trainers are the only interpreters started), 4 steps each."""
    from comera_engine.store import RunStore

    home = tmp_path / "home"
    monkeypatch.setenv("COMERA_HOME", str(home))
    monkeypatch.chdir(ROOT)  # the runs start here, where experiments.own.model imports
    cfg = toml(tmp_path / "own.toml", *csvs, steps=4)
    assert main(["launch", str(cfg), "--json"]) == 0
    rid = json.loads(capsys.readouterr().out)["run_id"]
    assert main(["sweep", str(cfg), "--grid", "comera.target_compression=2,3", "--seeds", "2",
                 "--max-parallel", "4", "--wait", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["sweep"]["status"] == "finished" and len(rep["groups"]) == 2
    store = RunStore(home / "comera.db")
    t0 = time.time()
    while store.get_run(rid)["status"] in ("queued", "running") and time.time() - t0 < 120:
        time.sleep(0.5)
    assert store.get_run(rid)["status"] == "finished"
    cells = store.sweep_runs(rep["sweep"]["id"])
    assert len(cells) == 4 and all(r["status"] == "finished" for r in cells)


# ---------------------------------------------------------------------- other paths


EXTRA_MODULE = '''
import torch
import torch.nn.functional as F
from torch import nn


class Mixed(nn.Module):
    """x [B, F], categorical [B, C], input_ids [B, T] -> one number per row."""

    def __init__(self, in_features, cardinalities, vocab_size):
        super().__init__()
        self.cat = nn.ModuleList(nn.Embedding(c, 4) for c in cardinalities)
        self.words = nn.Embedding(vocab_size, 16)
        self.body = nn.Linear(in_features + 4 * len(cardinalities) + 16, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x, categorical, input_ids):
        parts = [x, *(e(categorical[:, i]) for i, e in enumerate(self.cat)),
                 self.words(input_ids).mean(1)]
        return self.out(torch.relu(self.body(torch.cat(parts, 1))))


def mixed(in_features, cardinalities, vocab_size):
    return Mixed(in_features, cardinalities, vocab_size)


def small_net(in_features, out=3):
    return nn.Sequential(nn.Linear(in_features, 16), nn.ReLU(), nn.Linear(16, out))


def datasets(n=96):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    rows = [{"x": x[i], "labels": y[i]} for i in range(n)]
    return rows[: n * 3 // 4], rows[n * 3 // 4:]


def loss_and_metrics(name="err"):
    def metrics(outputs, labels):
        return {name: float((outputs.view(len(labels), -1).argmax(1) != labels).float().mean())}
    return (lambda outputs, labels: F.cross_entropy(outputs, labels.long())), metrics
'''


TRAIN_20_STEPS = """[train]
steps = 20
batch_size = {batch_size}
eval_every = 10
ckpt_every = 0
device = "cpu"
"""


def _train_finals(config: str, run: str) -> dict:
    """``comera train`` of ``config`` (in the working folder) into ``run``, without the
    store; the last value of each eval metric it logged."""
    assert main(["train", config, "--no-progress", "--no-store", "--run-dir", run]) == 0
    rows = [r["values"] for r in map(json.loads, (Path(run) / "metrics.jsonl").open())
            if r["type"] == "metrics"]
    return {k: v for r in rows for k, v in r.items() if k.startswith("eval/")}


def test_regression_categorical_text_data_factory_and_task_factory(tmp_path, monkeypatch
                                                                    ) -> None:
    """A regression on a CSV with numeric, categorical and text columns (RMSE and R², no
    accuracy; the files' SHA-256 and columns in dataset.json), and a data.factory with a
    task.factory whose metrics function names its metric."""
    import random

    (tmp_path / "own_extra_mod.py").write_text(EXTRA_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    rng = random.Random(0)
    words = {"red": "warm bright", "green": "calm leafy", "blue": "cool deep"}
    lines = ["x1,x2,colour,note,y"]
    for _ in range(160):
        x1, x2, colour = rng.gauss(0, 1), rng.gauss(0, 1), rng.choice(list(words))
        y = 2 * x1 - x2 + {"red": 1.0, "green": 0.0, "blue": -1.0}[colour]
        lines.append(f"{x1:.4f},{x2:.4f},{colour},{words[colour]} sample text,{y:.4f}")
    (tmp_path / "table.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "regress.toml").write_text('''name = "own-regress"
task = "regress"
[model]
factory = "own_extra_mod:mixed"
[data]
name = "files"
train = "table.csv"
features = ["x1", "x2"]
categorical = ["colour"]
text = "note"
label = "y"
seq_len = 8
vocab_size = 64
min_frequency = 1
''' + TRAIN_20_STEPS.format(batch_size=32), encoding="utf-8")
    final = _train_finals("regress.toml", "reg")
    assert {"eval/rmse", "eval/r2", "eval/loss"} <= set(final) and "eval/acc" not in final
    assert final["eval/rmse"] == pytest.approx(final["eval/loss"] ** 0.5, rel=0.05)
    ident = json.loads((tmp_path / "reg" / "dataset.json").read_text())
    assert ident["files"][0]["sha256"] == hashlib.sha256(
        (tmp_path / "table.csv").read_bytes()).hexdigest()
    assert (ident["params"]["categorical"], ident["params"]["text"]) == (["colour"], "note")

    (tmp_path / "factory.toml").write_text('''name = "own-factory"
task = { factory = "own_extra_mod:loss_and_metrics", kwargs = { name = "miss" } }
[model]
factory = "own_extra_mod:small_net"
[data]
factory = "own_extra_mod:datasets"
kwargs = { n = 128 }
''' + TRAIN_20_STEPS.format(batch_size=16), encoding="utf-8")
    final = _train_finals("factory.toml", "fac")
    assert 0.0 <= final["eval/miss"] <= 1.0 and "eval/acc" not in final
    ident = json.loads((tmp_path / "fac" / "dataset.json").read_text())
    assert ident["params"]["factory"] == "own_extra_mod:datasets"
    assert ident["num_examples"] == {"train": 96, "eval": 32}
