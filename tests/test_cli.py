"""`comera train` from a config: validation, --set, --print-config, bad input -> exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from comera_engine.cli import main
from comera_engine.config import (
    Config,
    config_from_dict,
    load_config,
    parse_value,
    to_toml,
    toml_value,
)
from comera_engine.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "experiments" / "configs").glob("*.toml"))

DIGITS = """
name = "digits-test"
[model]
name = "tt_mlp"
dense = true
[data]
name = "digits"
[train]
steps = 2
batch_size = 16
"""


def write(tmp_path: Path, text: str = DIGITS, name: str = "cfg.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_every_example_config_validates() -> None:
    assert len(CONFIGS) >= 8
    for path in CONFIGS:
        cfg = load_config(path)
        # a built-in model, or a registered one (the criteo peers' `custom` DLRM)
        assert cfg.model.name in ("transformer_cls", "transformer_mlm", "dlrm", "tt_mlp",
                                  "custom")
    models = {load_config(p).model.name for p in CONFIGS} - {"custom"}
    assert models == {"transformer_cls", "transformer_mlm", "dlrm", "tt_mlp"}
    presets = {(load_config(p).model.name, load_config(p).model.preset) for p in CONFIGS}
    for model in models:  # each model at paper size and at a CPU size
        assert (model, "paper") in presets
        assert any(m == model and p != "paper" for m, p in presets)


def test_set_overrides_and_print_config_round_trip(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg_path = write(tmp_path)
    rc = main(
        [
            "train",
            str(cfg_path),
            "--print-config",
            "--set",
            "train.batch_size=64",
            "--set",
            "comera.switch=never",
            "--set",
            "model.hidden=[32, 16]",
            "--set",
            "comera.lr_cores=3e-3",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    raw = tomllib.loads(text)
    assert raw["train"]["batch_size"] == 64
    assert raw["model"]["hidden"] == [32, 16]
    again = config_from_dict(raw)
    assert again.train.batch_size == 64 and again.comera.switch == "never"
    assert again.comera.lr_cores == pytest.approx(3e-3)
    assert not (tmp_path / "runs").exists()  # printing writes nothing


def test_to_toml_round_trips_every_example() -> None:
    for path in CONFIGS:
        cfg = load_config(path)
        back = config_from_dict(tomllib.loads(to_toml(cfg)))
        assert back == cfg, path.name


def test_to_toml_writes_text_as_typed_and_reads_back(tmp_path) -> None:
    """Non-ASCII text is written as typed (UTF-8), and what TOML must escape is escaped:
    tomllib reads every string back to the same characters."""
    cfg = load_config(write(tmp_path))
    cfg.name = "digits \u00b7 10\u00d7 seed 2 \u2014 caf\u00e9"
    text = to_toml(cfg)
    assert 'name = "digits \u00b7 10\u00d7 seed 2 \u2014 caf\u00e9"' in text
    assert config_from_dict(tomllib.loads(text)) == cfg
    tricky = 'a "quoted" \\ back\tslash\nnew\x7fdel\x00nul \u00e9'
    assert tomllib.loads(f"v = {toml_value(tricky)}")["v"] == tricky
    assert tomllib.loads(f"v = {toml_value({tricky: 1})}")["v"] == {tricky: 1}


def test_a_run_name_of_undecodable_bytes_is_one_line(tmp_path) -> None:
    """``--set name=`` with bytes that are not UTF-8 (Python's surrogate escapes): one
    line naming the field, exit 2, nothing written."""
    env = {**os.environ, "COMERA_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable.encode(), b"-m", b"comera_engine.cli", b"train",
                          str(write(tmp_path)).encode(), b"--set", b"name=caf\xe9",
                          b"--print-config"], capture_output=True, timeout=60, env=env,
                         cwd=ROOT)
    err = out.stderr.decode("utf-8", "replace").strip()
    assert out.returncode == 2 and err.startswith("comera: error: name: is not valid UTF-8"), err
    assert len(err.splitlines()) == 1 and not out.stdout


def test_parse_value_reads_toml_literals() -> None:
    assert parse_value("64") == 64
    assert parse_value("1e-3") == pytest.approx(1e-3)
    assert parse_value("true") is True
    assert parse_value('"x y"') == "x y"
    assert parse_value("[1, 2]") == [1, 2]
    assert parse_value("dlrm") == "dlrm"  # bare word -> string


@pytest.mark.parametrize(
    "override, field",
    [
        ("model.name=gpt5", "model.name"),
        ("model.rank=-3", "model.rank"),
        ("comera.target_compression=0.5", "comera.target_compression"),
        ("train.batch_size=0", "train.batch_size"),
        ("train.batch_sise=32", "train.batch_sise"),
        ("train.steps=ten", "train.steps"),
        ("comera.target_scope=everything", "comera.target_scope"),
        ("model.d_model=32", "model.d_model"),  # a transformer field on the TT MLP
        ("comera.switch=100", "comera.target_compression"),  # late stage without a target
    ],
)
def test_bad_values_name_the_field(tmp_path, override, field) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path), [override])
    assert str(info.value).startswith(field + ":")
    assert "\n" not in str(info.value)


def test_a_whole_number_written_as_a_float_is_refused_with_how_to_write_it(tmp_path) -> None:
    """``1e9`` where an integer is due is in range but a float: the refusal says how to
    write it; one beyond the range says that instead; a fraction, the range."""
    for value, said in (("1e9", "train.steps: must be an integer, got 1000000000.0: write "
                                "it as 1000000000, without a decimal point or exponent"),
                        ("1e12", "train.steps: 1000000000000 is too large (allowed: "
                                 "1..1,000,000,000)"),
                        ("2.5", "train.steps: must be an integer, got 2.5 (allowed: "
                                "1..1,000,000,000)")):
        with pytest.raises(ConfigError) as info:
            load_config(write(tmp_path), [f"train.steps={value}"])
        assert str(info.value) == said
    import torch

    import comera_engine as ce

    # a target beyond the dense size itself: the size it needs is below one parameter
    with pytest.raises(ConfigError, match=r"needs a tensorized size of 4\.2e-06 params"):
        ce.tensorize(torch.nn.Sequential(torch.nn.Linear(64, 64)),
                     ce.CoMERAConfig(target_compression=1e9))


def test_misspelt_key_suggests_the_right_one(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"did you mean train\.batch_size\?"):
        load_config(write(tmp_path), ["train.batch_sise=32"])
    with pytest.raises(ConfigError, match=r"did you mean comera\.gamma\?"):
        load_config(write(tmp_path), ["comera.gama=0.1"])


BAD_CASES = {
    "unknown model": ["--set", "model.name=transformer_xl"],
    "negative rank": ["--set", "model.rank=-1"],
    "target compression 0.5": ["--set", "comera.target_compression=0.5"],
    "missing data file": ["--set", "data.name=snli", "--set", "data.path=no/such/file.jsonl"],
    "batch size 0": ["--set", "train.batch_size=0"],
    "misspelt key": ["--set", "train.batch_sise=32"],
    "batch larger than data": ["--set", "train.batch_size=100000"],
    "model does not fit data": ["--set", "model.name=dlrm"],
    "unreachable target": ["--set", "model.dense=false", "--set", "comera.target_compression=1e6"],
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_config_one_line_exit_2_nothing_written(tmp_path, monkeypatch, capsys, case) -> None:
    monkeypatch.chdir(tmp_path)
    cfg_path = write(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    rc = main(["train", str(cfg_path), *BAD_CASES[case]])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("comera: error: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no runs/ folder


def test_bad_config_in_a_real_process(tmp_path) -> None:
    cfg_path = write(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "comera_engine.cli",
            "train",
            str(cfg_path),
            "--set",
            "train.batch_sise=8",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "comera: error: train.batch_sise: unknown key (did you mean train.batch_size?)"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.toml"]


def test_missing_config_file_and_bad_toml(tmp_path, capsys) -> None:
    assert main(["train", str(tmp_path / "nope.toml")]) == 2
    assert "config: file not found" in capsys.readouterr().err
    bad = write(tmp_path, "name = [unclosed", "bad.toml")
    assert main(["train", str(bad)]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train"])
    assert info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_train_writes_run_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg_path = write(tmp_path)
    rc = main(["train", str(cfg_path), "--no-progress", "--run-dir", "out"])
    assert rc == 0
    run = tmp_path / "out"
    assert (run / "metrics.jsonl").is_file()
    assert (run / "checkpoints" / "step_000002.safetensors").is_file()
    saved = load_config(run / "config.toml")
    assert isinstance(saved, Config) and saved.train.steps == 2


def test_a_new_run_into_a_used_run_dir_is_refused_and_the_old_run_kept(
        tmp_path, monkeypatch, capsys) -> None:
    """``--run-dir`` naming a folder that holds a run, without ``--resume``, used to
    append a second run's metrics to the first's and write its checkpoints over them:
    refused in one line (exit 2) naming the flag and the fix; nothing in the folder or
    the store changes."""
    from comera_engine.store import RunStore

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COMERA_HOME", str(tmp_path / "home"))
    cfg_path = write(tmp_path)
    assert main(["train", str(cfg_path), "--no-progress", "--run-dir", "out"]) == 0
    run = tmp_path / "out"
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["train", str(cfg_path), "--no-progress", "--run-dir", "out"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--run-dir" in err[0] and "--resume" in err[0], err
    after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after == before
    assert len(RunStore(tmp_path / "home" / "comera.db").list_runs()) == 1


def test_a_store_run_with_checkpoints_is_not_started_from_scratch(
        tmp_path, monkeypatch, capsys) -> None:
    """``comera train <store>/<id>/config.toml --run-id <id>`` without ``--resume`` on a
    run that has checkpoints used to train it again from step 0 in its folder, over its
    metrics and checkpoints: refused in one line naming ``--resume``; nothing changes."""
    from comera_engine.store import RunStore

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COMERA_HOME", str(tmp_path / "home"))
    assert main(["train", str(write(tmp_path)), "--no-progress"]) == 0
    st = RunStore(tmp_path / "home" / "comera.db")
    (run,) = st.list_runs()
    folder = st.run_dir(run["id"])
    before = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["train", str(folder / "config.toml"), "--run-id", run["id"],
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--run-id" in err[0] and "--resume" in err[0], err
    after = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert after == before and st.get_run(run["id"])["status"] == "finished"


def test_run_id_of_another_folder_or_an_ended_run_is_refused(
        tmp_path, monkeypatch, capsys) -> None:
    """``comera train OTHER.toml --run-id RID`` (no ``--resume``) of a finished run
    trained a new run into OTHER's folder and replaced RID's metrics in the store with
    its own: refused in one line naming ``--run-id`` (also with ``--resume`` from another
    folder, and from RID's own folder once RID has ended); the store keeps RID's rows
    and no run file lands beside OTHER.toml."""
    from comera_engine.store import RunStore

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COMERA_HOME", str(tmp_path / "home"))
    assert main(["train", str(write(tmp_path)), "--no-progress",
                 "--set", "train.ckpt_every=0"]) == 0
    st = RunStore(tmp_path / "home" / "comera.db")
    (run,) = st.list_runs()
    rid, folder = run["id"], st.run_dir(run["id"])
    for p in (folder / "checkpoints").glob("*"):  # the from-scratch check does not apply
        p.unlink()
    rows = st.metrics_since(rid, -1, ["loss/task"])
    other = tmp_path / "other"
    other.mkdir()
    cfg = write(other, DIGITS.replace("steps = 2", "steps = 1"), "exp.toml")
    capsys.readouterr()
    for argv in ([str(cfg), "--run-id", rid], [str(cfg), "--run-id", rid, "--resume"],
                 [str(folder / "config.toml"), "--run-id", rid]):
        assert main(["train", *argv, "--no-progress"]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("comera: error: --run-id:"), err
        assert f"comera resume {rid}" in err[0]
    assert sorted(p.name for p in other.iterdir()) == ["exp.toml"]
    assert st.metrics_since(rid, -1, ["loss/task"]) == rows
    assert st.get_run(rid)["status"] == "finished" and len(st.list_runs()) == 1


def test_a_folder_that_is_no_run_folder_is_refused_and_left_as_it_is(
        tmp_path, monkeypatch, capsys) -> None:
    """``train proj/config.toml --resume`` (no ``--run-dir``) made the user's folder a
    run folder and replaced their config.toml with the resolved config; ``--run-dir
    DIR`` did the same to a user's config.toml in DIR; ``--run-dir`` naming a file, or a
    folder that cannot be made, ended in a traceback. Each is one line naming its flag,
    exit 2, with no file changed and no store made."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COMERA_HOME", str(tmp_path / "home"))
    proj = tmp_path / "proj"
    mine = DIGITS + "# my precious comment\n"
    notes = tmp_path / "notes"
    proj.mkdir()
    notes.mkdir()
    write(proj, mine, "config.toml")
    write(notes, "# my notes\nname = \"mine\"\n", "config.toml")
    afile = write(tmp_path, "x", "afile")
    cases = [(["train", str(proj / "config.toml"), "--resume"], "--resume",
              "is not a run folder"),
             (["train", str(proj / "config.toml"), "--run-dir", str(notes)], "--run-dir",
              "holds a config.toml that no run wrote"),
             (["train", str(proj / "config.toml"), "--run-dir", str(afile)], "--run-dir",
              "is a file, not a folder"),
             (["train", str(proj / "config.toml"), "--run-dir", str(afile / "sub")],
              "--run-dir", "cannot make the run folder")]
    for argv, flag, words in cases:
        assert main([*argv, "--no-progress"]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"comera: error: {flag}: "), err
        assert words in err[0], err
    assert [p.name for p in proj.iterdir()] == ["config.toml"]
    assert (proj / "config.toml").read_text() == mine
    assert [p.name for p in notes.iterdir()] == ["config.toml"]
    assert (notes / "config.toml").read_text() == "# my notes\nname = \"mine\"\n"
    assert afile.read_text() == "x" and not (tmp_path / "home").exists()


def test_cli_resume_continues_from_the_newest_checkpoint(tmp_path, monkeypatch) -> None:
    from comera_engine.metrics import read_jsonl

    monkeypatch.chdir(tmp_path)
    cfg_path = write(tmp_path)
    args = ["train", str(cfg_path), "--no-progress", "--run-dir", "out",
            "--set", "train.steps=6", "--set", "train.ckpt_every=2"]  # fmt: skip
    assert main(args) == 0
    run = tmp_path / "out"
    first = [r["values"]["loss/task"] for r in read_jsonl(run / "metrics.jsonl")
             if r["type"] == "metrics"]  # fmt: skip
    # simulate a crash after step 4: the step-6 checkpoint never got written
    for suffix in (".json", ".safetensors"):
        (run / "checkpoints" / f"step_000006{suffix}").unlink()
    assert main([*args, "--resume"]) == 0
    records = read_jsonl(run / "metrics.jsonl")
    steps = [r["step"] for r in records if r["type"] == "metrics"]
    assert steps == [1, 2, 3, 4, 5, 6]  # steps 5-6 of the first attempt were rewound
    again = [r["values"]["loss/task"] for r in records if r["type"] == "metrics"]
    assert again == first
    assert any(r["type"] == "event" and "resumed from step_000004" in r["text"] for r in records)


def test_text_run_keeps_its_tokenizer_across_resume(tmp_path, monkeypatch) -> None:
    """WordPiece training is not deterministic: a resumed text run must reload the
    vocabulary it was trained with, and export needs it beside the run."""
    import json

    from comera_engine.data.tokenizer import WordPieceTokenizer
    from comera_engine.metrics import read_jsonl

    monkeypatch.chdir(tmp_path)
    cfg = ROOT / "experiments" / "configs" / "code_mlm_tiny.toml"
    args = ["train", str(cfg), "--no-progress", "--run-dir", "out",
            "--set", "train.steps=4", "--set", "train.ckpt_every=2",
            "--set", "data.max_files=8", "--set", "train.eval_every=100",
            "--set", "model.tt_layers=[\"attention\"]"]  # fmt: skip
    assert main(args) == 0
    run = tmp_path / "out"
    tok = run / "tokenizer.json"
    assert tok.is_file()
    spec = json.loads((run / "data_spec.json").read_text())
    assert spec["vocab_size"] == WordPieceTokenizer.load(tok).vocab_size
    assert json.loads((run / "dataset.json").read_text())["name"] == "code_mlm"
    first = [r["values"]["loss/task"] for r in read_jsonl(run / "metrics.jsonl")
             if r["type"] == "metrics"]  # fmt: skip
    before = tok.read_bytes()
    for suffix in (".json", ".safetensors"):
        (run / "checkpoints" / f"step_000004{suffix}").unlink()
    assert main([*args, "--resume"]) == 0
    assert tok.read_bytes() == before
    again = [r["values"]["loss/task"] for r in read_jsonl(run / "metrics.jsonl")
             if r["type"] == "metrics"]  # fmt: skip
    assert again == first  # same ids, same batches, same losses


LIGHT_COMMANDS = [["--help"], ["runs"], ["runs", "--json"], ["runs", "--limit", "x"],
                  ["logs", "no-such-run"], ["stop", "no-such-run"], ["train", "--help"],
                  ["export", "--help"], ["launch", "--help"], ["bogus"]]


@pytest.mark.parametrize("argv", LIGHT_COMMANDS, ids=" ".join)
def test_light_commands_never_import_torch(argv, tmp_path) -> None:
    """Help, listing, logs, stop and argument errors answer without loading torch (the
    time they take is in experiments/bench_cli.py)."""
    code = ("import sys\nfrom comera_engine.cli import main\n"
            "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "heavy = [m for m in ('torch', 'numpy', 'safetensors') if m in sys.modules]\n"
            "print('HEAVY', ','.join(heavy), file=sys.stderr)\n")
    env = {**os.environ, "COMERA_HOME": str(tmp_path / "home")}
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         timeout=60, env=env, cwd=tmp_path)
    heavy = [ln for ln in out.stderr.splitlines() if ln.startswith("HEAVY")]
    assert heavy == ["HEAVY "], out.stderr[-2000:]


@pytest.mark.parametrize("argv, field", [
    (["runs", "--limit", "-1"], "--limit"),
    (["runs", "--limit", "0"], "--limit"),
    (["runs", "--status", "bogus"], "--status"),
])
def test_bad_runs_flags_are_refused(argv, field, tmp_path) -> None:
    env = {**os.environ, "COMERA_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "comera_engine.cli", *argv], capture_output=True,
                         text=True, timeout=60, env=env, cwd=ROOT)
    assert out.returncode == 2 and field in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_a_set_table_merges_into_the_files_table(tmp_path) -> None:
    """``--set 'train={steps=5}'`` replaced the file's whole [train] table (its
    batch_size fell back to the default without a word): it sets the keys it names."""
    cfg = load_config(write(tmp_path, DIGITS + "ckpt_every = 300\n"), ["train={steps=5}"])
    assert (cfg.train.steps, cfg.train.batch_size, cfg.train.ckpt_every) == (5, 16, 300)


def test_an_empty_run_reference_and_a_run_without_a_log_are_named(tmp_path, capsys) -> None:
    """An empty run reference matched every run as a prefix (``logs ''`` picked the one
    run of a store): refused in one line. ``logs`` of a foreground run, which has no
    ``train.log``, printed nothing: it says why. Message wording: "a list of integers",
    "an onnx export", and the model that fits a dataset's task."""
    from types import SimpleNamespace

    from comera_engine.models import build_model
    from comera_engine.store import RunStore

    st = RunStore(tmp_path / "home")
    rid = st.create_run("only", {}, "finished")
    st.close()
    store = ["--store", str(tmp_path / "home")]
    for argv in (["logs", ""], ["stop", " "], ["resume", ""]):
        assert main([*argv, *store]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "run reference is empty" in err[0], err
    assert main(["logs", rid, *store]) == 0
    assert "has no log file" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"must be a list of integers, got"):
        load_config(write(tmp_path), ['model.hidden=["a"]'])
    with pytest.raises(ConfigError, match=r"^--out: an onnx export is a \.onnx file"):
        from comera_engine.export.core import resolve_out

        resolve_out(tmp_path / "m.bin", "onnx")
    cfg = load_config(write(tmp_path, DIGITS.replace('name = "tt_mlp"\n', "")))
    with pytest.raises(ConfigError, match='set model.name to "tt_mlp"'):
        build_model(cfg.model, SimpleNamespace(task="classification", name="digits"))


@pytest.mark.parametrize("name, problem", [
    ("x" * 5000, "at most"), ("two\nlines", "control characters"),
    ("\x1b[31mred\x1b[0m", "control characters"),
])
def test_run_names_are_bounded_plain_text(name, problem, tmp_path) -> None:
    text = DIGITS.replace('name = "digits-test"', f"name = {json.dumps(name)}")
    assert text != DIGITS
    with pytest.raises(ConfigError, match=f"^name: .*{problem}"):
        load_config(write(tmp_path, text))


def test_a_config_that_is_not_utf8_names_the_file(tmp_path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(DIGITS.replace("digits-test", "caf\u00e9").encode("latin-1"))
    with pytest.raises(ConfigError, match=r"^config: latin1\.toml is not UTF-8 text"):
        load_config(path)


@pytest.mark.parametrize("home", ["file", "/proc/comera-home"])
def test_an_unusable_home_is_one_line(home, tmp_path, capsys, monkeypatch) -> None:
    """COMERA_HOME that is a plain file, or a folder that cannot be made: launch and a
    foreground train with --store refuse in one line, exit 2, no traceback."""
    if home == "file":
        home = str(tmp_path / "plain")
        Path(home).write_text("not a folder")
    cfg = write(tmp_path, DIGITS)
    monkeypatch.setenv("COMERA_HOME", home)
    for argv in (["launch", str(cfg)], ["train", str(cfg), "--store", f"{home}/comera.db",
                                        "--run-id", "x", "--run-dir", str(tmp_path / "r")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert "writable folder" in err or "no run store" in err, err


REFUSED_LAUNCHES = {
    "missing file": [],
    "target inf": ["--set", "comera.target_compression=inf"],
    "unknown dataset": ["--set", 'data.name="nope"'],
    "unknown data key": ["--set", "data.seqlen=5"],
}


@pytest.mark.parametrize("problem", sorted(REFUSED_LAUNCHES))
def test_a_refused_launch_creates_no_store(problem, tmp_path, capsys) -> None:
    """launch validates the config, and the [data] table against the dataset registry,
    before the run store is opened: a refused launch leaves no database behind."""
    cfg = str(tmp_path / "missing.toml") if problem == "missing file" else str(
        write(tmp_path, DIGITS))
    extra = REFUSED_LAUNCHES[problem]
    db = tmp_path / "home" / "comera.db"
    assert main(["launch", cfg, *extra, "--store", str(db)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert not db.exists() and not db.parent.exists()


_NO_GPU = not __import__("torch").cuda.is_available()
DIGITS_CONFIG = ROOT / "experiments" / "configs" / "digits_tt_mlp.toml"


@pytest.mark.parametrize("override,field", [
    ("comera.target_compression=1e9", "comera.target_compression"),
    ("comera.target_compression=inf", "comera.target_compression"),
    ("train.batch_size=1e9", "train.batch_size"),
    ("train.batch_size=1180591620717411303424", "train.batch_size"),  # 2^70
    ("data.split_fraction=2", "data.split_fraction"),
    ("data.split_fraction=0", "data.split_fraction"),
    ("data.name=\"nope\"", "data.name"),
    ("data.bogus=1", "data.bogus"),
    pytest.param("train.device=\"cuda\"", "train.device",
                 marks=pytest.mark.skipif(not _NO_GPU, reason="a GPU is present")),
    ("model.hidden=[10000000, 10000000]", "model"),  # tens of TiB by the estimate
])
def test_launch_refuses_what_cannot_run_before_a_run_exists(
        override: str, field: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Issue 21's launch cases: each is one line naming the field, exit 2, and no store
    (nor run folder) is created: the same checks `comera train` and the New experiment
    form run (preview.check_runnable)."""
    store = tmp_path / "home" / "comera.db"
    code = main(["launch", str(DIGITS_CONFIG), "--set", override, "--store", str(store)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"comera: error: {field}"), err
    assert not (tmp_path / "home").exists()


def test_train_refuses_a_run_that_does_not_fit_before_writing(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "run"
    code = main(["train", str(DIGITS_CONFIG), "--set", "model.hidden=[10000000, 10000000]",
                 "--run-dir", str(run_dir), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("comera: error: model: the run needs about")
    assert "GiB is free on the CPU" in err[-1] and not run_dir.exists()


def test_runs_outside_the_store_started_in_the_same_second_get_their_own_folders() -> None:
    """Two ``--no-store`` runs launched together once shared ``runs/<second>-<name>``,
    and the second was refused as "in use"."""
    import argparse

    from comera_engine.train.session import _run_dir

    args = argparse.Namespace(run_dir=None, run_id=None, resume=False, config="x.toml")
    folders = {_run_dir(args, "snli tiny") for _ in range(20)}
    assert len(folders) == 20
    assert all(f.parent == Path("runs") and f.name.endswith("-snli-tiny") for f in folders)


def test_runs_shows_one_compression_and_a_verdict_only_when_finished(tmp_path, capsys) -> None:
    """``comera runs``: COMPRESSION is the run's figure in its target's scope, named; TARGET
    is a verdict for a finished run and progress for one still training or stopped."""
    from comera_engine.store import RunStore

    st = RunStore(tmp_path / "comera.db")
    config = {"name": "d", "model": {"name": "tt_mlp"}, "data": {"name": "digits"},
              "comera": {"target_compression": 60.0, "target_scope": "tensorized"},
              "train": {"steps": 20000}}
    rows = {}
    for name, status in (("live", "running"), ("halted", "stopped"), ("done", "finished")):
        rid = st.create_run(name, config, "running")
        st.write_batch(rid, metrics=[(551, "compression/tensorized", 28.04, 0.0),
                                     (551, "compression/model", 11.5, 0.0)])
        if status != "running":
            st.set_status(rid, status)
        else:
            st.heartbeat(rid)
        rows[name] = rid
    assert main(["runs", "--store", str(st.path)]) == 0
    out = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()[1:]}
    for name in rows:
        assert "28.0x TT layers" in out[name] and "11.5x" not in out[name]
    assert "60x, now 28.0x" in out["live"] and "miss" not in out["live"]
    assert "60x, at 28.0x (stopped)" in out["halted"] and "miss" not in out["halted"]
    assert "60x→28.0x miss 53%" in out["done"]


def test_a_run_is_planned_once_and_its_plan_kept(tmp_path, monkeypatch, count_calls) -> None:
    """`comera train` plans the run once (no replanning in the preview or the trainer, no
    throwaway model) and keeps the plan beside the run: the initial ranks config.toml
    starts from, the target plan and the data spec it was made from."""
    import comera_engine.runplan as runplan

    planned = count_calls(runplan, "plan_initial_ranks")
    monkeypatch.chdir(tmp_path)
    cfg = ROOT / "experiments" / "configs" / "digits_tt_mlp.toml"
    assert main(["train", str(cfg), "--no-progress", "--no-store", "--run-dir", "out",
                 "--set", "train.steps=2", "--set", "train.eval_every=100"]) == 0
    assert len(planned) == 1
    run = tmp_path / "out"
    plan = json.loads((run / "plan.json").read_text())
    config = tomllib.loads((run / "config.toml").read_text())
    assert plan["initial_ranks"]["rank"] == config["model"]["rank"]
    assert plan["target"]["compression"] == config["comera"]["target_compression"]
    assert plan["data_spec"]["task"] == "classification"


def test_comera_runs_lists_a_dense_baseline_as_the_whole_dense_model() -> None:
    """A dense baseline has no TT layers to state a figure of: ``comera runs`` (and
    Sweeps, the studio: ``run_compression``) list it as the whole model at 1×, whatever
    its config's target scope; a TT run stays in its own scope; a dense model with
    compressed embedding tables (a peer) shows its tables' ratio."""
    from comera_engine.launch.cli import _fmt_compression

    tensorized = {"comera": {"target_scope": "tensorized"}}
    dense = {"config": {"model": {"name": "tt_mlp", "dense": True}, **tensorized}}
    assert _fmt_compression(dense, {"compression/tensorized": (9, 1.0)}) == "1.0x whole model"
    assert _fmt_compression(dense, {}) == "1.0x whole model"  # before it logs a size
    tt = {"config": {"model": {"name": "tt_mlp"}, **tensorized}}
    assert _fmt_compression(tt, {"compression/tensorized": (9, 60.6)}) == "60.6x TT layers"
    peer = {"config": {"model": {"name": "custom", "dense": True,
                                 "kwargs": {"peer": "hash"}}, **tensorized}}
    assert _fmt_compression(peer, {"compression/tensorized": (9, 9.8)}) == "9.8x TT layers"
