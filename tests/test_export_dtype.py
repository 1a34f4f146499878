"""``comera export --dtype bf16|int8``: a short run of the shipped digits config (60x,
where the header and the input statistics weigh most against the weights) exported in
float32 and in int8; the int8 file is at most 30 % of the float32 file and its accuracy
on the raw eval split (read from scikit-learn, not from the run) is within 0.5 points of
the float32 export's, through ``comera_engine.load`` and through onnxruntime. The stored
numbers are checked against an independent int8 rounding of the float32 export's
tensors, unpacked by the documented layout; a file of the previous format still loads;
bad input is one line and exit 2 with nothing written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import comera_engine
from comera_engine.export import export_run, read_metadata
from comera_engine.layers import tt_layers

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped digits TT MLP config (60x: 3,930 weights, so the file's header and
    input statistics count against 4 KB of int8 weights), 150 steps."""
    from comera_engine.cli import main

    run = tmp_path_factory.mktemp("int8") / "run"
    argv = ["train", str(ROOT / "experiments" / "configs" / "digits_tt_mlp.toml"),
            "--no-store", "--no-progress", "--run-dir", str(run)]
    for item in ("train.steps=150", "comera.switch=40", "train.eval_every=0",
                 "train.ckpt_every=0"):
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
    assert i8.header_bytes < 1024 and i8.input_bytes == 2 * 64 * 2  # float16 mean and std
    ref = _acc_torch(f32.path, x, y)
    assert ref > 0.8  # a real classifier
    assert abs(_acc_torch(i8.path, x, y) - ref) <= 0.005
    o32 = export_run(digits_run, format="onnx", out=tmp_path / "f32.onnx")
    o8 = export_run(digits_run, format="onnx", out=tmp_path / "i8.onnx", dtype="int8")
    assert abs(_acc_onnx(o8.path, x, y) - _acc_onnx(o32.path, x, y)) <= 0.005
    assert o8.tensor_bytes < 0.5 * o32.tensor_bytes  # int8 initializers, not float ones
    # what each export expects to hold is what it holds: the same int8 weights either way
    assert o8.expected_bytes == i8.expected_bytes == i8.tensor_bytes
    assert o32.expected_bytes == f32.expected_bytes
    assert o8.metadata["onnx"]["max_rel_diff_vs_float32"] <= 0.05
    # the card states what is stored and how many bytes
    card = i8.card.read_text()
    assert "int8" in card and f"{i8.tensor_bytes:,}" in card
    assert read_metadata(i8.path)["storage"]["dtype"] == "int8"


def _segments(model: torch.nn.Module) -> list[tuple[str, list[tuple[int, ...]]]]:
    """What a compressed export concatenates into ``params``, by the documented layout:
    each floating parameter, a TT layer's cores as one ``<layer>.tt.cores`` (the list of
    core shapes), in the order of their names."""
    owners = [name for name, _ in tt_layers(model)]
    seg: dict[str, list[tuple[int, ...]]] = {}
    for name, p in model.named_parameters():
        owner = next((o for o in owners if name.startswith(f"{o}.tt.")), None)
        if owner is None:
            seg[name] = [tuple(p.shape)]
        elif ".tt.cores." in name:  # gates are not stored (absorbed)
            seg.setdefault(f"{owner}.tt.cores", []).append(tuple(p.shape))
    return sorted(seg.items())


def _per_name(path: Path, segments: list) -> dict[str, torch.Tensor]:
    """A compressed export's tensors by name: ``params`` cut by ``segments`` and, for
    int8, ``<name>.scale`` from ``scales`` (one per core, per row, per vector)."""
    from safetensors.torch import load_file

    raw = load_file(str(path))
    out, pos, spos = {}, 0, 0
    for name, shapes in segments:
        cores = name.endswith(".tt.cores")
        n = sum(math.prod(s) for s in shapes)
        out[name] = raw["params"][pos: pos + n]
        if not cores:
            out[name] = out[name].reshape(shapes[0])
        pos += n
        if "scales" in raw:
            rows = cores or len(shapes[0]) >= 2
            k = len(shapes) if cores else (shapes[0][0] if rows else 1)
            out[name + ".scale"] = raw["scales"][spos: spos + k].reshape((k,) if rows else ())
            spos += k
    assert pos == raw["params"].numel() and spos == raw.get("scales", torch.zeros(0)).numel()
    return out


def test_int8_values_match_an_independent_rounding(digits_run: Path, tmp_path: Path) -> None:
    """Every stored int8 value is round(w / s) with s = max|w| / 127 per core, per row or
    per vector, computed here from the float32 export's weights (both files cut by the
    documented layout)."""
    f32 = export_run(digits_run, format="compressed", out=tmp_path / "f32.safetensors")
    i8 = export_run(digits_run, format="compressed", out=tmp_path / "i8.safetensors",
                    dtype="int8")
    m32 = comera_engine.load(f32.path)
    segments = _segments(m32.network)
    a, b = _per_name(f32.path, segments), _per_name(i8.path, segments)
    assert set(b) == set(a) | {n + ".scale" for n in a}
    for name, shapes in segments:
        cores = name.endswith(".tt.cores")
        w = a[name]
        q, s = b[name], b[name + ".scale"]
        assert q.dtype == torch.int8
        if cores:  # one scale each
            parts = torch.split(w, [math.prod(sh) for sh in shapes])
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
    m8 = comera_engine.load(i8.path)
    for (n, p32), (_, p8) in zip(m32.state_dict().items(), m8.state_dict().items()):
        if p32.is_floating_point() and p32.numel():
            assert (p32 - p8).abs().max() <= p32.abs().max() / 127 * 0.5 + 1e-7, n


def test_a_file_of_the_previous_format_still_loads(digits_run: Path, tmp_path: Path) -> None:
    """An int8 export as format 2 wrote it (every tensor and its scale under its own name,
    the input statistics as JSON numbers) loads, and computes what the format 3 file
    does."""
    from safetensors.torch import save_file

    i8 = export_run(digits_run, format="compressed", out=tmp_path / "i8.safetensors",
                    dtype="int8")
    new = comera_engine.load(i8.path)
    doc = read_metadata(i8.path)  # the card's and the tensors' parts put back
    old = {k: doc[k] for k in ("format", "storage", "model", "tt_layers", "input_pipeline")}
    old["format_version"] = 2
    path = tmp_path / "v2.safetensors"
    tensors = _per_name(i8.path, _segments(new.network))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path),
              metadata={"comera": json.dumps(old)})
    x = torch.from_numpy(_raw_eval()[0])
    with torch.no_grad():
        assert torch.equal(comera_engine.load(path)(x), new(x))


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
    # a run that wrote these weights itself: its sidecar holds their checksum (else the
    # export takes the newest checkpoint that reads back whole, an older one)
    from comera_engine.store.layout import file_sha256

    sidecar = ckpt.with_suffix(".json")
    meta = json.loads(sidecar.read_text())
    meta["sha256"] = file_sha256(ckpt)
    sidecar.write_text(json.dumps(meta))
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
