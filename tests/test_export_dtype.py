"""``comera export --dtype bf16|int8``: a short digits run exported in float32 and in
int8; the int8 file is at most 30 % of the float32 file and its accuracy on the raw
eval split (read from scikit-learn, not from the run) is within 0.5 points of the
float32 export's, through ``comera_engine.load`` and through onnxruntime. The stored
numbers are checked against an independent int8 rounding of the float32 export's
tensors; bad input is one line and exit 2 with nothing written."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import comera_engine
from comera_engine.export import export_run, read_metadata

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A digits TT MLP at 2x (TT cores dominate the file, as in a model worth
    quantizing: at 60x the JSON header is most of the file), 150 steps."""
    from comera_engine.cli import main

    run = tmp_path_factory.mktemp("int8") / "run"
    argv = ["train", str(ROOT / "experiments" / "configs" / "digits_tt_mlp.toml"),
            "--no-store", "--no-progress", "--run-dir", str(run)]
    for item in ("comera.target_compression=2", "train.steps=150", "comera.switch=40",
                 "train.eval_every=0", "train.ckpt_every=0"):
        argv += ["--set", item]
    assert main(argv) == 0
    return run


def _raw_eval() -> tuple[np.ndarray, np.ndarray]:
    from comera_engine.data.digits import read_digits, stratified_split

    pixels, labels = read_digits()
    _, test = stratified_split(labels, 0.2, 0)  # the config: split_fraction 0.8, seed 0
    return pixels[test].astype(np.float32), labels[test]


def _acc_torch(path: Path, x: np.ndarray, y: np.ndarray) -> float:
    model = comera_engine.load(path)
    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


def _acc_onnx(path: Path, x: np.ndarray, y: np.ndarray) -> float:
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return float((sess.run(None, {name: x})[0].argmax(1) == y).mean())


def test_int8_export_is_small_and_as_accurate(digits_run: Path, tmp_path: Path) -> None:
    x, y = _raw_eval()
    f32 = export_run(digits_run, format="compressed", out=tmp_path / "f32.safetensors")
    i8 = export_run(digits_run, format="compressed", out=tmp_path / "i8.safetensors",
                    dtype="int8")
    assert i8.file_bytes <= 0.30 * f32.file_bytes, (i8.file_bytes, f32.file_bytes)
    ref = _acc_torch(f32.path, x, y)
    assert ref > 0.8  # a real classifier
    assert abs(_acc_torch(i8.path, x, y) - ref) <= 0.005
    o32 = export_run(digits_run, format="onnx", out=tmp_path / "f32.onnx")
    o8 = export_run(digits_run, format="onnx", out=tmp_path / "i8.onnx", dtype="int8")
    assert abs(_acc_onnx(o8.path, x, y) - _acc_onnx(o32.path, x, y)) <= 0.005
    assert o8.file_bytes < 0.5 * o32.file_bytes  # int8 initializers, not float ones
    assert o8.metadata["onnx"]["max_rel_diff_vs_float32"] <= 0.05
    # the card states what is stored and how many bytes
    card = i8.card.read_text()
    assert "int8" in card and f"{i8.tensor_bytes:,}" in card
    assert read_metadata(i8.path)["storage"]["dtype"] == "int8"


def test_int8_values_match_an_independent_rounding(digits_run: Path, tmp_path: Path) -> None:
    """Every stored int8 tensor is round(w / s) with s = max|w| / 127 per core (packed
    cores: split by the ranks the metadata gives), per row or per vector, computed here
    from the float32 export's tensors."""
    from safetensors.torch import load_file

    f32 = export_run(digits_run, format="compressed", out=tmp_path / "f32.safetensors")
    i8 = export_run(digits_run, format="compressed", out=tmp_path / "i8.safetensors",
                    dtype="int8")
    a, b = load_file(str(f32.path)), load_file(str(i8.path))
    layers = {r["name"]: r for r in read_metadata(f32.path)["tt_layers"]}
    for name, w in a.items():
        q, s = b[name], b[name + ".scale"]
        assert q.dtype == torch.int8
        owner = name[: -len(".tt.cores")] if name.endswith(".tt.cores") else None
        if owner is not None:  # TTM linear cores: (r, n_k, m_k, r')
            info = layers[owner]
            r = [1, *info["ranks"], 1]
            sizes = [r[k] * n * m * r[k + 1]
                     for k, (n, m) in enumerate(zip(*info["factors"]))]
            parts = torch.split(w, sizes)
            want_s = torch.stack([p.abs().max() / 127 for p in parts])
            want_q = torch.cat([torch.round(p / sc) for p, sc in zip(parts, want_s)])
        elif w.dim() >= 2:
            want_s = w.abs().amax(1) / 127
            want_q = torch.round(w / want_s[:, None])
        else:
            want_s = w.abs().max() / 127
            want_q = torch.round(w / want_s)
        assert torch.allclose(s, want_s, rtol=1e-6), name
        assert (q.float() - want_q).abs().max() <= 1, name  # a tie may round either way
    # loading gives q * s back: within half a step of each float32 weight
    m32, m8 = comera_engine.load(f32.path), comera_engine.load(i8.path)
    for (n, p32), (_, p8) in zip(m32.state_dict().items(), m8.state_dict().items()):
        if p32.is_floating_point() and p32.numel():
            assert (p32 - p8).abs().max() <= p32.abs().max() / 127 * 0.5 + 1e-7, n


def test_bf16_export_loads_within_tolerance(digits_run: Path, tmp_path: Path) -> None:
    x, _ = _raw_eval()
    f32 = export_run(digits_run, format="compressed", out=tmp_path / "f32.safetensors")
    bf = export_run(digits_run, format="compressed", out=tmp_path / "bf.safetensors",
                    dtype="bf16")
    assert bf.tensor_bytes == f32.tensor_bytes // 2  # every tensor is a parameter here
    with torch.no_grad():
        ref = comera_engine.load(f32.path)(torch.from_numpy(x))
        got = comera_engine.load(bf.path)(torch.from_numpy(x))
    assert float((got - ref).abs().max()) <= 0.02 * max(1.0, float(ref.abs().max()))


def _cli(*argv: str) -> int:
    from comera_engine.cli import main

    return main(["export", *argv])


def test_bad_dtype_is_one_line_and_writes_nothing(digits_run: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x" / "m.safetensors"
    assert _cli(str(digits_run), "--out", str(out), "--dtype", "int3") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dtype" in err[0] and "int8" in err[0]
    assert not out.exists() and not out.parent.exists()


def test_int8_of_unquantizable_weights_is_refused(digits_run: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A run whose weights hold an infinite value has no int8 scale: one line, exit 2,
    nothing written (a float32 export of the same run still works)."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(digits_run, bad)
    ckpt = sorted((bad / "checkpoints").glob("*.safetensors"))[-1]
    tensors = load_file(str(ckpt))
    key = next(k for k in tensors if k.endswith("out.weight"))
    tensors[key][0, 0] = math.inf
    save_file(tensors, str(ckpt))
    out = tmp_path / "o" / "m.safetensors"
    assert _cli(str(bad), "--out", str(out), "--dtype", "int8") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "out.weight" in err[0] and "--dtype" in err[0]
    assert not out.exists()


def test_comera_int8_run_is_its_int8_export(digits_run: Path, tmp_path: Path) -> None:
    """The reproduction's "CoMERA + int8" cell (``model.quantize = "int8"`` of a TT run,
    no training) computes with the weights the int8 export stores: its eval accuracy
    is the loaded export's on the same split, and its bytes are the export's tensors."""
    pytest.importorskip("torchao")
    import json

    from comera_engine.cli import main

    run = tmp_path / "int8run"
    argv = ["train", str(ROOT / "experiments" / "configs" / "digits_tt_mlp.toml"),
            "--no-store", "--no-progress", "--run-dir", str(run)]
    for item in ("comera.target_compression=2", 'model.quantize="int8"',
                 f'model.init_from="{digits_run}"', "train.steps=0"):
        argv += ["--set", item]
    assert main(argv) == 0
    values = [json.loads(line)["values"] for line in (run / "metrics.jsonl").open()
              if '"eval/acc"' in line][-1]
    i8 = export_run(digits_run, format="compressed", out=tmp_path / "i8.safetensors",
                    dtype="int8")
    x, y = _raw_eval()
    assert values["eval/acc"] == pytest.approx(_acc_torch(i8.path, x, y), abs=1e-9)
    assert values["bytes/effective"] == i8.tensor_bytes
