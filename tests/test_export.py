"""Export / import: compressed, dense and ONNX round trips for every model family, file
sizes against ``size_report``, exports of a trained run's checkpoint (API, store, CLI),
and a set of bad, corrupt and hostile files that must be refused without running
anything in them."""

from __future__ import annotations

import argparse
import json
import math
import pickle
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import comera_engine
from comera_engine import size_report, tensorize
from comera_engine.config import ModelConfig
from comera_engine.errors import ConfigError
from comera_engine.export import (
    BadExportFile,
    add_subparsers,
    export_model,
    export_run,
    load,
    read_metadata,
)
from comera_engine.layers import TTEmbedding, TTLinear, tt_layers
from comera_engine.models import build_model

SPECS = {
    "tt_mlp": dict(name="digits", task="classification", num_classes=10, vocab_size=None,
                   seq_len=None, meta={"input_dim": 64}),
    "dlrm": dict(name="movielens", task="ctr", num_classes=2, vocab_size=None, seq_len=None,
                 meta={"num_dense": 13, "bucket_sizes": [500, 40, 300, 7]}),
    "transformer_cls": dict(name="nli", task="nli", num_classes=3, vocab_size=300, seq_len=16,
                            meta={"pad_id": 0}),
    "transformer_mlm": dict(name="mlm", task="mlm", num_classes=None, vocab_size=300,
                            seq_len=16, meta={"pad_id": 0}),
}


def _as_trained(model: nn.Module, seed: int = 0) -> nn.Module:
    """Make a fresh model look trained: random gates with about a third of every bond
    pruned at random positions (so truncation must slice, not just cut a tail), and
    non-trivial LayerNorm / bias values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in tt_layers(model):
            for gate in layer.tt.gates:
                gate.copy_(torch.rand(gate.shape, generator=g) + 0.5)
                dead = torch.randperm(gate.numel(), generator=g)[: gate.numel() // 3]
                gate[dead] = 0.0
            layer.tt.refresh_()
        for name, p in model.named_parameters():
            if ".tt." not in name and p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def family_model(family: str, preset: str = "tiny", spec: dict | None = None) -> nn.Module:
    torch.manual_seed(0)
    spec = spec or SPECS[family]
    return _as_trained(build_model(ModelConfig(name=family, preset=preset),
                                   SimpleNamespace(**spec)))


def family_metadata(family: str, preset: str = "tiny", spec: dict | None = None) -> dict:
    spec = spec or SPECS[family]
    return {"config": {"name": f"{family}-test", "model": {"name": family, "preset": preset},
                       "data": {"name": spec["name"]}},
            "data_spec": spec, "metrics": {"eval/acc": 0.8125, "eval/loss": 0.5},
            "dataset": {"name": spec["name"], "fingerprint": "f" * 64}}


def family_inputs(family: str, batch: int = 3, seq: int | None = None) -> tuple:
    g = torch.Generator().manual_seed(1)
    spec = SPECS[family]
    if family.startswith("transformer"):
        L = seq or spec["seq_len"]
        ids = torch.randint(1, spec["vocab_size"], (batch, L), generator=g)
        mask = torch.ones_like(ids)
        mask[0, L - 4:] = 0
        ids[0, L - 4:] = 0  # padding tokens (the TTM row of pad_id reads as zero)
        types = torch.zeros_like(ids)
        types[:, L // 2:] = 1
        return ids, types, mask
    if family == "dlrm":
        sizes = spec["meta"]["bucket_sizes"]
        sparse = torch.stack([torch.randint(0, s, (batch,), generator=g) for s in sizes], 1)
        return torch.randn(batch, 13, generator=g), sparse
    return (torch.randn(batch, 64, generator=g),)


def safetensors_payload(path: Path) -> int:
    """Bytes of tensor data in a safetensors file (file size minus its header)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - n


@torch.no_grad()
def max_diff(a: nn.Module, b: nn.Module, inputs: tuple) -> float:
    """Largest output difference, relative to the output scale (at least 1): float32
    rounding differs where the live layer absorbs its gates elsewhere than the export."""
    ya = a(*inputs)
    return float((ya - b(*inputs)).abs().max() / ya.abs().max().clamp_min(1.0))


# ------------------------------------------------------------------ every family, every format


@pytest.mark.parametrize("family", list(SPECS))
def test_round_trip_every_format(family: str, tmp_path: Path) -> None:
    model = family_model(family)
    meta = family_metadata(family)
    inputs = family_inputs(family)
    report = size_report(model)
    ranks_before = {n: list(m.effective_ranks()) for n, m in tt_layers(model)}
    alloc_before = {n: list(m.tt.ranks) for n, m in tt_layers(model)}
    assert any(alloc_before[n][1:-1] != r for n, r in ranks_before.items())  # really pruned

    # compressed: only the effective cores + dense params; size == size_report exactly
    res = export_model(model, tmp_path / "m.safetensors", "compressed", meta)
    assert res.path.is_file() and res.card.is_file()
    assert safetensors_payload(res.path) == report["model"]["effective_bytes"]
    assert res.tensor_bytes == res.expected_bytes == report["model"]["effective_bytes"]
    names = set(load_file(res.path))
    assert not any(n.endswith((".tt.gate", ".tt.alive")) for n in names)
    loaded = comera_engine.load(res.path)
    assert type(loaded) is type(model) and not loaded.training
    assert max_diff(model, loaded, inputs) <= 1e-6
    assert {n: m.tt.ranks[1:-1] for n, m in tt_layers(loaded)} == ranks_before
    rep2 = size_report(loaded)
    assert rep2["model"]["effective_params"] == report["model"]["effective_params"]
    assert rep2["model"]["allocated_params"] == report["model"]["effective_params"]
    # the exported model is untouched by the export
    assert {n: list(m.tt.ranks) for n, m in tt_layers(model)} == alloc_before
    doc = read_metadata(res.path)
    assert doc["format"] == "comera-compressed"
    assert doc["library"]["version"] == comera_engine.__version__
    assert doc["metrics"]["eval/acc"] == 0.8125 and doc["dataset"]["fingerprint"] == "f" * 64
    assert {r["name"]: r["ranks"] for r in doc["tt_layers"]} == ranks_before
    card = res.card.read_text()
    for text in ("dense model", "compressed model", "Ranks per TT layer", "| eval/acc | 81.2% |",
                 "comera_engine.load", next(iter(ranks_before))):
        assert text in card
    # which method trained it: the config has no [comera] table, so the defaults'
    assert "**Trained by**: CoMERA, schedule paced" in card

    # dense: plain nn.Linear / nn.Embedding with the reconstructed weights
    res_d = export_model(model, tmp_path / "m.dense.safetensors", "dense", meta)
    assert safetensors_payload(res_d.path) == report["model"]["dense_bytes"]
    dense = load(res_d.path)
    assert not tt_layers(dense)
    for name in ranks_before:
        assert type(dense.get_submodule(name)) in (nn.Linear, nn.Embedding)
    assert max_diff(model, dense, inputs) <= 1e-5
    baseline = build_model(ModelConfig(name=family, preset="tiny"),
                           SimpleNamespace(**SPECS[family]), dense=True)
    baseline.load_state_dict(load_file(res_d.path), strict=True)  # a standard state dict
    assert max_diff(model, baseline.eval(), inputs) <= 1e-5

    # onnx: TT layers as contractions over the cores, checked with onnxruntime here
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    res_o = export_model(model, tmp_path / "m.onnx", "onnx", meta)
    proto = onnx.load(str(res_o.path))
    tt_dense = {n: (m.in_features * m.out_features if isinstance(m, TTLinear)
                    else m.num_embeddings * m.embedding_dim) for n, m in tt_layers(model)}
    plain = {n: p.numel() for n, p in model.named_parameters() if ".tt." not in n}
    for init in proto.graph.initializer:
        numel = math.prod(init.dims)
        owner = next((n for n in tt_dense if init.name.startswith(n + ".")), None)
        if owner is not None:
            assert numel < tt_dense[owner], f"{init.name} is as big as a dense weight"
        elif init.name not in plain:
            assert numel < min(tt_dense.values()), f"unexpected large initializer {init.name}"
    ops = {node.op_type for node in proto.graph.node}
    assert "MatMul" in ops
    init_bytes = sum(math.prod(i.dims) * 4 for i in proto.graph.initializer)
    assert init_bytes <= report["model"]["effective_bytes"]
    sess = ort.InferenceSession(str(res_o.path), providers=["CPUExecutionProvider"])
    feed_names = [i.name for i in sess.get_inputs()]
    variants = [inputs, family_inputs(family, batch=5)]
    if family.startswith("transformer"):
        variants.append(family_inputs(family, batch=2, seq=9))  # dynamic sequence length
    for args in variants:
        got = sess.run(None, {n: a.numpy() for n, a in zip(feed_names, args)})[0]
        with torch.no_grad():
            want = model(*args)
        assert got.shape == tuple(want.shape)
        assert float((torch.from_numpy(got) - want).abs().max()) <= 1e-5
    assert res_o.onnx_max_abs_diff is not None and res_o.onnx_max_abs_diff <= 1e-5
    assert read_metadata(res_o.path)["format"] == "comera-onnx"
    assert "onnxruntime" in res_o.card.read_text()
    with pytest.raises(BadExportFile, match="onnxruntime"):
        load(res_o.path)


class _OwnNet(nn.Module):
    """A network of one's own class (not an nn.Sequential, no run config)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(500, 32)
        self.mid = nn.Linear(64, 128)
        self.head = nn.Linear(128, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.table(ids).flatten(1))))


def test_a_network_of_ones_own_class_exports_to_onnx_from_example_inputs(tmp_path) -> None:
    """A model trained in one's own loop has no run config to rebuild it from: its ONNX
    export is the traced graph (the class is not needed to run it), checked against
    PyTorch by onnxruntime at the traced batch and another; without example inputs, or
    to a format ``load`` must rebuild, it is refused naming what to give."""
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = tensorize(_OwnNet(), comera_engine.CoMERAConfig(target_compression=4),
                      exclude=["head"])
    ids = torch.randint(0, 500, (6, 2))
    res = export_model(model, tmp_path / "own.onnx", "onnx", example_inputs=(ids,))
    sess = ort.InferenceSession(str(res.path), providers=["CPUExecutionProvider"])
    for batch in (ids, torch.randint(0, 500, (3, 2))):
        got = torch.from_numpy(sess.run(None, {"input": batch.numpy()})[0])
        with torch.no_grad():
            torch.testing.assert_close(got, model(batch), rtol=1e-5, atol=1e-5)
    assert "- **Model**: `_OwnNet` (your own class, traced" in res.card.read_text()
    with pytest.raises(ConfigError, match=r"^example_inputs: an ONNX export of a _OwnNet"):
        export_model(model, tmp_path / "again.onnx", "onnx")
    with pytest.raises(ConfigError, match=r"^metadata\.config: needed to rebuild a _OwnNet"):
        export_model(model, tmp_path / "own.safetensors", "compressed")
    assert not (tmp_path / "again.onnx").exists() and not (tmp_path / "own.safetensors").exists()


def test_paper_size_file_matches_size_report_within_1_percent(tmp_path: Path) -> None:
    """The paper's transformer after rank pruning (~3 MB): the whole file, header
    included, is within 1% of size_report's effective bytes."""
    spec = dict(name="mnli", task="nli", num_classes=3, vocab_size=30522, seq_len=128,
                meta={"pad_id": 0})
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="transformer_cls", preset="paper"),
                        SimpleNamespace(**spec)).eval()
    with torch.no_grad():
        for _, layer in tt_layers(model):
            for gate in layer.tt.gates:
                gate[: int(0.9 * gate.numel())] = 0.0  # 90% of every bond pruned
    report = size_report(model)
    res = export_model(model, tmp_path, "compressed",
                       family_metadata("transformer_cls", "paper", spec))
    assert res.path == tmp_path / "model.safetensors"
    eff = report["model"]["effective_bytes"]
    assert 2_000_000 < eff < 5_000_000
    assert safetensors_payload(res.path) == eff
    assert abs(res.file_bytes - eff) <= 0.01 * eff
    ids = torch.randint(1, 30522, (2, 12))
    loaded = load(res.path)
    assert max_diff(model, loaded, (ids,)) <= 1e-6


# ------------------------------------------------------------------ models built with tensorize


def test_tensorized_sequential_round_trips(tmp_path: Path) -> None:
    """Generic module trees (nn.Sequential + tensorize), including a layer pruned to the
    zero map (rank 0 counts 0 parameters)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.LayerNorm(96), nn.Dropout(0.1),
                        nn.Linear(96, 32), nn.Tanh(), nn.Linear(32, 10))
    tensorize(mlp, rank=6)
    _as_trained(mlp)
    with torch.no_grad():
        mlp[4].tt.gates[2].zero_()  # a whole bond below tau: the layer is the zero map
    assert mlp[4].num_params() == mlp[4].bias.numel()
    emb = nn.Sequential(nn.Embedding(1000, 48, padding_idx=3), nn.Linear(48, 40))
    tensorize(emb, rank=5)
    _as_trained(emb, seed=1)
    x = torch.randn(5, 64)
    ids = torch.randint(0, 1000, (4, 9))
    ids[0, :3] = 3
    for model, inputs in ((mlp, (x,)), (emb, (ids,))):
        report = size_report(model)
        res = export_model(model, tmp_path / "a.safetensors", "compressed")
        assert safetensors_payload(res.path) == report["model"]["effective_bytes"]
        loaded = load(res.path)
        assert max_diff(model, loaded, inputs) <= 1e-6
        assert size_report(loaded)["model"]["effective_params"] == (
            report["model"]["effective_params"])
        dense = load(export_model(model, tmp_path / "a.dense.safetensors", "dense").path)
        assert not tt_layers(dense) and max_diff(model, dense, inputs) <= 1e-5
        pytest.importorskip("onnxruntime")
        res_o = export_model(model, tmp_path / "a.onnx", "onnx")
        assert res_o.onnx_max_abs_diff is not None and res_o.onnx_max_abs_diff <= 1e-5
    assert isinstance(load(tmp_path / "a.safetensors")[0], TTEmbedding)


def test_names_on_the_model_card_read_as_typed(tmp_path: Path) -> None:
    """A run's and a config's name are the user's text: the card (Markdown, shown by the
    studio's Export page and any viewer) shows them as typed, never as a link, bold,
    maths or code that ends early; checked by rendering it with markdown-it."""
    from markdown_it import MarkdownIt

    title = "<b>x</b> **bold** $x$ :red[red] [link](http://evil.example) # \\ ~z~"
    run_name = "a `tick` and ``two`` `"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 4))
    tensorize(model, rank=3)
    res = export_model(model, tmp_path / "m.safetensors", "compressed",
                       {"name": title, "run": {"id": "r1", "name": run_name, "step": 7}})
    tokens = MarkdownIt("commonmark").parse(res.card.read_text())
    heading = next(tokens[i + 1] for i, t in enumerate(tokens) if t.type == "heading_open")
    assert [c.type for c in heading.children] == ["text"]  # no link, emphasis or html
    assert heading.content and "".join(c.content for c in heading.children) == (
        "Model card: " + title)
    spans = [c.content for t in tokens if t.type == "inline" and "**Run**" in t.content
             for c in t.children if c.type == "code_inline"]
    assert spans == ["r1", run_name, "7"]
    # the dense export's card says first that its file is dense, at its bytes ratio
    dense = export_model(model, tmp_path / "m.dense.safetensors", "dense").card.read_text()
    assert "**This file is dense**" in dense and "**This file is dense**" not in (
        res.card.read_text())
    assert dense.index("**This file is dense**") < dense.index("**Compression:")


def test_bad_export_arguments_are_one_line_errors(tmp_path: Path) -> None:
    model = family_model("tt_mlp")
    meta = family_metadata("tt_mlp")
    with pytest.raises(ConfigError, match="^format: unknown format 'zip'"):
        export_model(model, tmp_path / "m.safetensors", "zip", meta)
    with pytest.raises(ConfigError, match=r"^--out: an onnx export is a \.onnx file"):
        export_model(model, tmp_path / "m.safetensors", "onnx", meta)
    with pytest.raises(ConfigError, match="^metadata.config: needed to rebuild a TTMLP"):
        export_model(model, tmp_path / "m.safetensors", "compressed", {})
    with pytest.raises(ConfigError, match="^metadata.data_spec: missing"):
        export_model(model, tmp_path / "m.safetensors", "compressed",
                     {"config": meta["config"]})
    wrong = family_metadata("tt_mlp")
    wrong["config"]["model"]["hidden"] = [128, 128]  # not this model: refused, nothing written
    with pytest.raises(ConfigError, match="^metadata.config: does not describe this model"):
        export_model(model, tmp_path / "m.safetensors", "compressed", wrong)
    with pytest.raises(ConfigError, match="^1: Softplus cannot be rebuilt without pickle"):
        export_model(nn.Sequential(nn.Linear(4, 4), nn.Softplus()), tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_failed_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors.torch

    def broken(tensors: dict, filename: str, metadata: dict | None = None) -> None:
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        export_model(family_model("tt_mlp"), tmp_path / "m.safetensors", "compressed",
                     family_metadata("tt_mlp"))
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ a real run's checkpoint


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A few training steps of the TT MLP on digits, in a run store's run folder."""
    from comera_engine.config import config_from_dict
    from comera_engine.data import build_dataset
    from comera_engine.store import RunStore
    from comera_engine.train.loop import train

    root = tmp_path_factory.mktemp("store")
    store = RunStore(root / "comera.db")
    raw = {"name": "digits-export", "model": {"name": "tt_mlp", "preset": "tiny"},
           "data": {"name": "digits"},
           "comera": {"gamma": 1.0, "lr_gates": 0.5, "target_compression": 4},
           "train": {"steps": 4, "batch_size": 32, "eval_every": 0, "ckpt_every": 2,
                     "eval_batches": 2, "device": "cpu", "cuda_graph": False}}
    cfg = config_from_dict(raw)
    rid = store.create_run(cfg.name, cfg.to_dict(), status="running")
    run_dir = store.run_dir(rid)
    run_dir.mkdir(parents=True)
    bundle = build_dataset({"name": "digits", "seed": 0})
    result = train(cfg, run_dir, None, bundle=bundle, progress=False)
    assert result.status == "finished"
    return SimpleNamespace(store=store, rid=rid, run_dir=run_dir, cfg=cfg, bundle=bundle,
                           result=result)


def _trained_model(run: SimpleNamespace, step: int) -> nn.Module:
    """The trained model restored the trainer's way (as ``--resume`` does)."""
    from comera_engine.train import checkpoint as ckpt

    meta, tensors = ckpt.load_checkpoint(run.run_dir / "checkpoints" / f"step_{step:06d}.json")
    model = build_model(run.cfg.model, run.bundle)
    ckpt.resize_to_shapes(model, meta["shapes"])
    model.load_state_dict(ckpt.model_state(tensors))
    return model.eval()


def test_export_run_checkpoints_every_format(trained_run: SimpleNamespace,
                                             tmp_path: Path) -> None:
    run = trained_run
    trained = _trained_model(run, 4)
    x = torch.stack([run.bundle.eval[i]["x"] for i in range(8)])
    sidecar = json.loads((run.run_dir / "checkpoints" / "step_000004.json").read_text())

    res = export_run(run.run_dir, format="compressed", out=tmp_path / "c.safetensors")
    assert res.file_bytes > 0 and res.tensor_bytes == size_report(trained)["model"][
        "effective_bytes"]
    loaded = load(res.path)  # takes raw pixels (tests/test_export_raw.py); .network: x
    assert max_diff(trained, loaded.network, (x,)) <= 1e-6
    doc = read_metadata(res.path)
    assert {r["name"]: r["ranks"] for r in doc["tt_layers"]} == sidecar["ranks"]
    assert doc["metrics"]["eval/acc"] == pytest.approx(run.result.metrics["eval/acc"])
    assert doc["dataset"]["fingerprint"] == run.bundle.identity["fingerprint"]
    assert doc["run"]["step"] == 4 and doc["config"]["name"] == "digits-export"
    assert doc["model"]["data_spec"]["meta"]["input_dim"] == 64
    assert "eval/acc" in res.card.read_text()

    dense = load(export_run(run.run_dir, format="dense", out=tmp_path / "d.safetensors").path)
    assert not tt_layers(dense) and max_diff(trained, dense.network, (x,)) <= 1e-5

    older = export_run(run.run_dir, checkpoint=2, format="compressed", out=tmp_path)
    assert read_metadata(older.path)["run"]["step"] == 2
    # the target's verdict belongs to the run's last step; an earlier checkpoint's card
    # says where the model stood then
    (final_line,) = [ln for ln in res.card.read_text().splitlines() if ln.startswith("**Target")]
    (early_line,) = [ln for ln in older.card.read_text().splitlines()
                     if ln.startswith("**Target")]
    assert "reached" in final_line and "in this checkpoint" not in final_line
    assert "in this checkpoint, at step 2 of the run's 4" in early_line
    assert "reached" not in early_line and "missed" not in early_line
    assert max_diff(_trained_model(run, 2), load(older.path).network, (x,)) <= 1e-6

    pytest.importorskip("onnxruntime")
    res_o = export_run(run.run_dir, format="onnx", out=tmp_path / "m.onnx")
    assert res_o.onnx_max_abs_diff is not None and res_o.onnx_max_abs_diff <= 1e-5


def test_export_by_run_id_logs_artifacts_and_cli(trained_run: SimpleNamespace,
                                                 tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    run = trained_run
    res = export_run(run.rid, format="compressed", out=tmp_path / "a.safetensors",
                     store=run.store.path)
    kinds = {a["kind"]: a["path"] for a in run.store.artifacts(run.rid)}
    assert Path(kinds["export_compressed"]).resolve() == res.path.resolve()
    assert Path(kinds["model_card"]).resolve() == res.card.resolve()
    assert read_metadata(res.path)["run"]["id"] == run.rid
    default = export_run(run.rid, format="dense", store=run.store)  # as the dashboard calls it
    assert default.path == run.run_dir / "exports" / "step_000004" / "model.dense.safetensors"
    assert default.card.name == "model.dense.safetensors.md" and default.card.is_file()

    parser = argparse.ArgumentParser(prog="comera")
    add_subparsers(parser.add_subparsers(dest="command"))
    out = tmp_path / "cli.safetensors"
    args = parser.parse_args(["export", str(run.run_dir), "--format", "compressed",
                              "--out", str(out), "--json"])
    assert args.func(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["path"] == str(out) and out.is_file() and Path(printed["card"]).is_file()
    for argv, message in (
        (["--checkpoint", "999"], "--checkpoint: no checkpoint at step 999"),
        (["--out", str(tmp_path / "x.bin")], "--out: a compressed export is a .safetensors"),
    ):
        base = ["export", str(run.run_dir), "--format", "compressed", "--out", str(out)]
        args = parser.parse_args(base + argv)
        assert args.func(args) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    args = parser.parse_args(["export", "no-such-run", "--store", str(run.store.path),
                              "--out", str(out)])
    assert args.func(args) == 2
    assert "run:" in capsys.readouterr().err


# ------------------------------------------------------------------ hostile files


def test_an_out_that_cannot_be_written_is_one_line_exit_2(
        trained_run: SimpleNamespace, tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--out`` under a file, in a folder that cannot be written (/proc), or on a disk
    that fills during the write gave a 38-line traceback or a raw errno (exit 1), and a
    full disk named the current folder and COMERA_HOME: now one line naming ``--out``,
    the folder and the fix, exit 2, no file left."""
    import safetensors.torch

    parser = argparse.ArgumentParser(prog="comera")
    add_subparsers(parser.add_subparsers(dest="command"))
    afile = tmp_path / "afile"
    afile.write_text("x")

    def export(out: Path | str, *extra: str) -> str:
        args = parser.parse_args(["export", str(trained_run.run_dir), "--out", str(out),
                                  *extra])
        assert args.func(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("comera: error: --out: "), err
        return err

    assert f"{afile} is a file, not a folder" in export(afile / "a.safetensors")
    assert f"{afile} is a file" in export(afile / "x" / "model", "--format", "dense")
    if Path("/proc/self").exists():
        assert "cannot write /proc/a.onnx" in export("/proc/a.onnx", "--format", "onnx")

    def full(tensors: dict, filename: str, metadata: dict | None = None) -> None:
        from safetensors import SafetensorError

        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "full" / "a.safetensors"
    out.parent.mkdir()
    err = export(out)
    assert "disk full: free" in err and f"MB in {out.parent};" in err
    assert "choose another --out" in err and "COMERA_HOME" not in err
    assert list(out.parent.iterdir()) == [] and afile.read_text() == "x"


def test_export_skips_a_damaged_newest_checkpoint_and_names_the_run_not_a_flag(
        trained_run: SimpleNamespace, tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default export takes the newest checkpoint that reads back whole (it refused
    a truncated newest one, as a resume does not) and says which it skipped. A folder
    that is no run, an empty reference, a run without checkpoints and a file that is no
    checkpoint are each named as what they are, not as a flag the user did not give."""
    import shutil

    parser = argparse.ArgumentParser(prog="comera")
    add_subparsers(parser.add_subparsers(dest="command"))
    run = tmp_path / "run"
    shutil.copytree(trained_run.run_dir, run)
    newest = run / "checkpoints" / "step_000004.safetensors"
    newest.write_bytes(newest.read_bytes()[:200])
    args = parser.parse_args(["export", str(run), "--out", str(tmp_path / "a.safetensors"),
                              "--json"])
    assert args.func(args) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["path"] == str(tmp_path / "a.safetensors")
    assert "export: skipped damaged step_000004" in out.err and "exporting step_000002" in out.err
    assert read_metadata(tmp_path / "a.safetensors")["run"]["step"] == 2

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COMERA_HOME", str(tmp_path / "no-home"))
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    cases = [(".", "run: . is not a run folder"), ("", "run: the run reference is empty"),
             ("nope", "run: no run 'nope' (no run folder there, and no run store at"),
             ("empty", "run: empty has no checkpoint yet"),
             (str(run), "--checkpoint: ")]
    for ref, message in cases:
        extra = ["--checkpoint", str(tmp_path / "a.safetensors.md")] if ref == str(run) else []
        args = parser.parse_args(["export", ref, "--out", str(tmp_path / "b.safetensors"),
                                  *extra])
        assert args.func(args) == 2, ref
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert "is not a checkpoint" in err
    assert not (tmp_path / "b.safetensors").exists() and not (tmp_path / "no-home").exists()


def _raw_safetensors(path: Path, header: dict, data: bytes) -> Path:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8: 8 + n]), raw[8 + n:]


def _with_doc(header: dict, edit) -> dict:  # noqa: ANN001
    header = json.loads(json.dumps(header))
    doc = json.loads(header["__metadata__"]["comera"])
    edit(doc)
    header["__metadata__"]["comera"] = json.dumps(doc)
    return header


class _Armed:
    """Unpickling this creates ``marker`` (the stand-in for arbitrary code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (str(self.marker), "w"))


@pytest.fixture(scope="module")
def good_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("good")
    return export_model(family_model("tt_mlp"), d / "good.safetensors", "compressed",
                        family_metadata("tt_mlp")).path


def _with_tensors(header: dict, data: bytes, extra: dict[str, torch.Tensor]
                  ) -> tuple[dict, bytes]:
    """``header`` and ``data`` with ``extra`` float tensors appended."""
    header = json.loads(json.dumps(header))
    for name, t in extra.items():
        raw = t.numpy().tobytes()
        header[name] = {"dtype": {torch.float32: "F32", torch.float16: "F16",
                                  torch.int64: "I64"}[t.dtype],
                        "shape": list(t.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    return header, data


def _hostile_cases(good: Path, d: Path) -> list[tuple[Path, str | None]]:
    header, data = _split(good)
    n = header["params"]["shape"][0]  # every weight, packed (comera_engine/export/packed.py)
    cases = []

    def add(name: str, hdr: dict, payload: bytes, match: str | None) -> None:
        cases.append((_raw_safetensors(d / name, hdr, payload), match))

    # metadata (ranks) that disagree with the stored cores
    def bump_rank(doc: dict) -> None:
        doc["tt_layers"][0]["ranks"][1] -= 1
    add("ranks.safetensors", _with_doc(header, bump_rank), data,
        r"tensor 'params' has shape .* says")
    # the packed weights declared in another shape (same byte count)
    hdr = json.loads(json.dumps(header))
    hdr["params"]["shape"] = [1, n]
    add("shape.safetensors", hdr, data, rf"tensor 'params' has shape \[1, {n}\]")
    # ranks beyond the maximal TT rank, unknown family / builder / module type, bad version
    add("cap.safetensors", _with_doc(header, lambda d_: d_["tt_layers"][0]["ranks"].__setitem__(
        0, 10**6)), data, "exceeds the maximal TT rank")
    add("family.safetensors", _with_doc(header, lambda d_: d_["model"].__setitem__(
        "family", "os.system")), data, "unknown model family 'os.system'")
    add("builder.safetensors", _with_doc(header, lambda d_: d_["model"].__setitem__(
        "builder", "pickle")), data, "builder: must be 'family' or 'tree'")
    add("tree.safetensors", _with_doc(header, lambda d_: d_.__setitem__("model", {
        "builder": "tree", "tree": {"type": "subprocess.Popen", "args": ["touch", "x"]}})),
        data, "unknown module type 'subprocess.Popen'")
    add("version.safetensors", _with_doc(header, lambda d_: d_.__setitem__(
        "format_version", 99)), data, "format_version: 99 is not supported")
    # a config declaring a huge model: refused by the config's bounds, before any shape
    # is computed or anything allocated
    add("huge.safetensors", _with_doc(header, lambda d_: d_["model"]["model_config"].__setitem__(
        "hidden", [2**30, 2**30])), data, r"model\.hidden: \d{10,} is too large")
    add("long.safetensors", _with_doc(header, lambda d_: d_["model"]["model_config"].__setitem__(
        "hidden", [8] * 5000)), data, "exceeds the limit 4096")
    hdr = json.loads(json.dumps(header))
    hdr["__metadata__"]["comera"] = "[" * 100_000 + "]" * 100_000
    add("deep.safetensors", hdr, data, "'comera' is not valid JSON")
    add("rank.safetensors", _with_doc(header, lambda d_: d_["model"]["model_config"].__setitem__(
        "rank", 10**9)), data, None)  # a huge allocated rank is harmless: loads at file ranks
    # a header whose length field starts like a pickle (80 02..80 05) is still safetensors
    text = json.dumps(header).encode()
    size = next(t for t in (0x280, 0x380, 0x480, 0x580) if t >= len(text))
    like = d / "pickle_length.safetensors"
    like.write_bytes(struct.pack("<Q", size) + text.ljust(size) + data)
    cases.append((like, None))
    # input statistics (the data spec's arrays, tensors meta:<key>) that would divide by
    # zero, be huge, not fit the network, be integers or stand for a JSON entry
    def stats(mean: torch.Tensor, std: torch.Tensor) -> tuple[dict, bytes]:
        return _with_tensors(header, data, {"meta:mean": mean, "meta:std": std})
    add("std.safetensors", *stats(torch.zeros(64), torch.zeros(64)),
        "input_pipeline.std: must be a list of positive numbers")
    add("wide.safetensors", *stats(torch.zeros(10**4), torch.ones(64)),
        "tensor 'meta:mean': must be a float16 or float32 vector of 1 to 4096 values")
    add("narrow.safetensors", *stats(torch.zeros(8), torch.ones(8)),
        "input_pipeline.mean: has 8 entries, the network takes 64")
    add("int.safetensors", *stats(torch.zeros(64, dtype=torch.int64), torch.ones(64)),
        "tensor 'meta:mean': must be a float16 or float32 vector")
    add("taken.safetensors", *_with_tensors(header, data, {"meta:input_dim": torch.ones(1)}),
        "tensor 'meta:input_dim': names no free entry")
    # a file of format 2 is still read, its input pipeline checked as it was
    pixels = {"kind": "pixels", "scale": 0.0625, "mean": [0.0] * 64, "std": [1.0] * 64}
    add("kind.safetensors", _with_doc(header, lambda d_: d_.update(
        format_version=2, input_pipeline={**pixels, "kind": "eval"})), data,
        "input_pipeline.kind")
    # JSON metadata that is not an object; no CoMERA metadata at all
    hdr = json.loads(json.dumps(header))
    hdr["__metadata__"]["comera"] = "[1, 2, 3]"
    add("list.safetensors", hdr, data, "must be a JSON object, got list")
    hdr = json.loads(json.dumps(header))
    hdr["__metadata__"] = {"format": "pt"}
    add("plain.safetensors", hdr, data, "not a CoMERA export")
    # a missing tensor and an extra unknown tensor (offsets kept consistent)
    hdr = json.loads(json.dumps(header))
    del hdr["params"]
    add("missing.safetensors", hdr, b"", "tensor 'params' is missing")
    hdr = json.loads(json.dumps(header))
    hdr["extra.weight"] = {"dtype": "F32", "shape": [2], "data_offsets": [len(data),
                                                                         len(data) + 8]}
    add("extra.safetensors", hdr, data + bytes(8), "unknown tensor 'extra.weight'")
    # byte ranges that overlap / lie outside the data / disagree with the shape
    hdr = json.loads(json.dumps(header))
    hdr["extra"] = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    add("overlap.safetensors", hdr, data, "overlapping or gapped")
    hdr = json.loads(json.dumps(header))
    hdr["params"]["shape"] = [n + 1]
    add("bytes.safetensors", hdr, data, f"needs {4 * (n + 1)}")
    # truncated file, random bytes, huge declared header, header that is not JSON
    trunc = d / "truncated.safetensors"
    trunc.write_bytes(good.read_bytes()[:-100])
    cases.append((trunc, "truncated"))
    noise = d / "noise.safetensors"
    noise.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(3),
                                    dtype=torch.uint8).numpy().tobytes())
    cases.append((noise, "not a safetensors file|truncated"))
    huge = d / "huge_header.safetensors"
    huge.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    cases.append((huge, "exceeds the 104857600-byte limit"))
    short = d / "short.safetensors"
    short.write_bytes(b"abc")
    cases.append((short, "too short"))
    garbage = d / "garbage.safetensors"
    garbage.write_bytes(struct.pack("<Q", 16) + b"\xff" * 16)
    cases.append((garbage, "header is not valid JSON"))
    cases.append((d / "absent.safetensors", "file not found"))
    return cases


def test_hostile_and_corrupt_files_are_refused(good_file: Path, tmp_path: Path) -> None:
    assert isinstance(load(good_file), nn.Module)  # the source of the variants is fine
    cases = _hostile_cases(good_file, tmp_path)
    assert len(cases) >= 20
    for path, match in cases:
        if match is None:
            assert max(m.tt.ranks[1] for _, m in tt_layers(load(path))) < 16
            continue
        with pytest.raises(ValueError, match=match) as info:
            load(path)
        msg = str(info.value)
        assert msg.startswith(str(path)) and "\n" not in msg, msg


def test_deep_json_is_refused_before_it_is_parsed(good_file: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A header, or the CoMERA document in it, nested 5,000 deep is refused as not valid
    JSON without being handed to ``json.loads`` (which would recurse to Python's limit)."""
    parsed: list[str] = []
    loads = json.loads
    monkeypatch.setattr(json, "loads", lambda text, *a, **k: parsed.append(
        text if isinstance(text, str) else text.decode()) or loads(text, *a, **k))
    deep = "[" * 5000 + "]" * 5000
    header, data = _split(good_file)
    header["__metadata__"]["comera"] = deep
    doc = _raw_safetensors(tmp_path / "deep_doc.safetensors", header, data)
    whole = tmp_path / "deep_header.safetensors"
    whole.write_bytes(struct.pack("<Q", len(deep)) + deep.encode())
    for path, match in ((doc, "'comera' is not valid JSON"),
                        (whole, "header is not valid JSON")):
        with pytest.raises(ValueError, match=match):
            load(path)
    # the first file's header was parsed (the deep document is a string in it), not the
    # document, nor the second file's header
    assert parsed and not any(t.startswith("[" * 100) for t in parsed)


def test_pickle_payloads_are_never_unpickled(good_file: Path, tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    payload = pickle.dumps({"state": _Armed(marker)}, protocol=4)
    files = []
    for name in ("model.pkl", "model.safetensors", "pickle_v2.safetensors"):
        p = tmp_path / name
        p.write_bytes(payload if name != "pickle_v2.safetensors"
                      else pickle.dumps(_Armed(marker), protocol=2))
        files.append(p)
    pt = tmp_path / "torch_save.pt"
    torch.save({"model": _Armed(marker)}, pt)  # torch.save is a zip of pickles
    renamed = tmp_path / "torch_save.safetensors"
    renamed.write_bytes(pt.read_bytes())
    files += [pt, renamed]
    for p in files:
        with pytest.raises(BadExportFile, match="pickle|zip archive"):
            load(p)
        with pytest.raises(BadExportFile):
            read_metadata(p)
    assert not marker.exists()
    # the payload is live: unpickling it would have created the marker
    pickle.loads(payload)["state"].close()
    assert marker.exists()


def test_hostile_run_checkpoint_is_refused(good_file: Path, tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "run" / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    marker = tmp_path / "PWNED"
    (ckpt_dir / "step_000001.safetensors").write_bytes(pickle.dumps(_Armed(marker)))
    (ckpt_dir / "step_000001.json").write_text(json.dumps(
        {"config": {"name": "x", "model": {"name": "tt_mlp"}, "data": {"name": "digits"}},
         "data_spec": SPECS["tt_mlp"]}))
    # named: the loader's own checks refuse it (by default it is no usable checkpoint,
    # as a resume finds, and nothing is read either)
    with pytest.raises(BadExportFile, match="pickle"):
        export_run(tmp_path / "run", checkpoint=1, out=tmp_path / "o.safetensors")
    with pytest.raises(ConfigError, match="no usable checkpoint"):
        export_run(tmp_path / "run", out=tmp_path / "o.safetensors")
    (ckpt_dir / "step_000001.json").write_text("[1, 2]")
    with pytest.raises(BadExportFile, match="JSON object with a 'config'"):
        export_run(tmp_path / "run", checkpoint=1, out=tmp_path / "o.safetensors")
    assert not marker.exists() and not (tmp_path / "o.safetensors").exists()
    with pytest.raises(ConfigError, match="^run: run folder not found"):
        export_run(str(tmp_path / "nope") + "/", out=tmp_path / "o.safetensors")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_exports_and_loads_onto_the_gpu(tmp_path: Path) -> None:
    model = family_model("transformer_cls").cuda()
    meta = family_metadata("transformer_cls")
    inputs = tuple(t.cuda() for t in family_inputs("transformer_cls"))
    res = export_model(model, tmp_path, "compressed", meta)
    loaded = load(res.path, map_location="cuda")
    assert next(loaded.parameters()).is_cuda
    assert max_diff(model, loaded, inputs) <= 1e-5
    dense = load(export_model(model, tmp_path, "dense", meta).path, map_location="cuda")
    assert max_diff(model, dense, inputs) <= 1e-4
    pytest.importorskip("onnxruntime")
    assert export_model(model, tmp_path, "onnx", meta).onnx_max_abs_diff <= 1e-5


def test_nan_weights_load_with_a_warning_and_a_million_entries_are_refused_fast(
        good_file: Path, tmp_path: Path) -> None:
    """NaN weights load, but never without a word; a header listing a million tensors is
    refused from a byte count, before it is parsed."""
    import time as _time

    from comera_engine.export.core import NonFiniteWeightsWarning

    header, data = _split(good_file)
    begin = header["params"]["data_offsets"][0]
    nan = struct.pack("<f", float("nan"))
    bad = _raw_safetensors(tmp_path / "nan.safetensors", header,
                           data[:begin] + nan + data[begin + 4:])
    with pytest.warns(NonFiniteWeightsWarning, match=r"nan\.safetensors: 1 tensor\(s\) hold NaN"):
        model = load(bad)
    assert isinstance(model, nn.Module)
    many = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
            for i in range(1_000_000)}
    path = _raw_safetensors(tmp_path / "many.safetensors", many, b"")
    t0 = _time.perf_counter()
    with pytest.raises(ValueError, match="lists about 1,000,000 tensors"):
        load(path)
    print(f"a million-entry header refused in {_time.perf_counter() - t0:.2f} s")
