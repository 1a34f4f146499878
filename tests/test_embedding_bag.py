"""``TTEmbeddingBag``: an ``nn.EmbeddingBag`` (sum / mean / max over bags of rows) whose
table is TT, against torch's own ``nn.EmbeddingBag`` holding the TT layer's table in
float64; ``tensorize`` and ``save`` / ``load_into`` of a network that holds one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import comera_engine as ce
from comera_engine.export.container import BadExportFile
from comera_engine.layers import TTEmbedding, TTEmbeddingBag, tensorize_layers

DT = torch.float64


def _reference(bag: TTEmbeddingBag) -> nn.EmbeddingBag:
    """torch's ``nn.EmbeddingBag`` with the same options, its table the TT layer's."""
    ref = nn.EmbeddingBag(bag.num_embeddings, bag.embedding_dim, mode=bag.mode,
                          include_last_offset=bag.include_last_offset,
                          padding_idx=bag.padding_idx, dtype=DT)
    with torch.no_grad():
        ref.weight.copy_(bag.dense_weight())
    return ref


CASES = [  # (mode, padding_idx, include_last_offset, per-sample weights)
    ("sum", None, False, False), ("sum", 5, False, True), ("mean", None, True, False),
    ("mean", 5, False, False), ("max", None, False, False), ("max", 5, True, False),
]


@pytest.mark.parametrize("path", ["gather", "dense"])
@pytest.mark.parametrize(("mode", "pad", "last", "weighted"), CASES)
def test_bags_match_torchs_embedding_bag(mode: str, pad: int | None, last: bool,
                                         weighted: bool, path: str) -> None:
    """Flat ids with offsets (repeats, an empty bag, padding entries left out of their
    bag) and a 2-D input of equal bags: outputs, and the cores' gradients mapped from
    the reference table's gradient through the reconstruction."""
    torch.manual_seed(0)
    bag = TTEmbeddingBag(300, 20, rank=5, mode=mode, padding_idx=pad,
                         include_last_offset=last, dtype=DT, path=path)
    ref = _reference(bag)
    ids = torch.tensor([5, 7, 7, 299, 0, 5, 12, 12, 3, 5, 5])
    offsets = torch.tensor([0, 4, 4, 6, 8] + ([11] if last else []))  # bag 1 is empty
    psw = torch.rand(ids.shape, dtype=DT) if weighted else None
    for args in ((ids, offsets, psw), (ids[:10].reshape(2, 5), None,
                                       None if psw is None else psw[:10].reshape(2, 5))):
        out = bag(*args)
        expect = ref(*args)
        torch.testing.assert_close(out, expect, rtol=0, atol=1e-12)
        w = torch.randn_like(out)
        grads = torch.autograd.grad((out * w).sum(), list(bag.tt.cores))
        ref.zero_grad()
        (ref(*args) * w).sum().backward()
        mapped = torch.autograd.grad((bag.dense_weight() * ref.weight.grad).sum(),
                                     list(bag.tt.cores))
        for a, b in zip(grads, mapped):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_bad_bag_input_is_refused_as_torch_refuses_it() -> None:
    bag = TTEmbeddingBag(50, 8, rank=2, mode="mean")
    with pytest.raises(ValueError, match="mode"):
        TTEmbeddingBag(50, 8, mode="median")
    with pytest.raises((ValueError, RuntimeError), match="offsets"):
        bag(torch.tensor([1, 2, 3]))  # 1-D ids need offsets, as torch says
    with pytest.raises((ValueError, RuntimeError, NotImplementedError)):
        bag(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2))  # weights: sum only


class Clicks(nn.Module):
    """A click model of one's own: a multi-hot field pooled by an ``nn.EmbeddingBag``, a
    one-hot field through an ``nn.Embedding``, an MLP over both."""

    def __init__(self, max_norm: float | None = None) -> None:
        super().__init__()
        self.tags = nn.EmbeddingBag(4000, 16, mode="sum", padding_idx=0, max_norm=max_norm)
        self.user = nn.Embedding(3000, 16)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, tags: torch.Tensor, user: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.tags(tags), self.user(user)], 1)).squeeze(1)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tags = torch.randint(0, 4000, (6, 5), generator=g)
    tags[:, 3:] = 0  # padding: bags of three
    return tags, torch.randint(0, 3000, (6,), generator=g)


def test_tensorize_makes_an_embedding_bag_tt_and_keeps_what_it_computes() -> None:
    """At full rank from the trained tables (exact TT-SVD) the model gives its outputs;
    at a target the bag is TT with its reduction and padding; a table that renormalises
    its rows (``max_norm``) stays dense with its reason."""
    torch.manual_seed(0)
    model = Clicks().double()
    batch = _batch()
    with torch.no_grad():
        expect = model(*batch)
    torch.manual_seed(0)
    same = Clicks().double()
    ce.tensorize(same, ce.CoMERAConfig(), rank=4000, from_pretrained=True)
    assert isinstance(same.tags, TTEmbeddingBag) and same.tags.mode == "sum"
    assert same.tags.padding_idx == 0
    with torch.no_grad():
        torch.testing.assert_close(same(*batch), expect, rtol=1e-8, atol=1e-8)
    small = ce.tensorize(Clicks(), ce.CoMERAConfig(target_compression=50))
    assert isinstance(small.tags, TTEmbeddingBag) and isinstance(small.user, TTEmbedding)
    assert small(*_batch()).shape == (6,)
    rows = {r["name"]: r for r in tensorize_layers(Clicks(max_norm=1.0), rank=4)}
    assert not rows["tags"]["replaced"] and "max_norm" in rows["tags"]["reason"]
    assert rows["user"]["replaced"]


def test_save_and_load_into_keep_the_bag(tmp_path: Path) -> None:
    """A TT bag saved loads into a fresh instance (its mode and padding back); loading it
    where the model has a plain table is refused in one line naming the layer."""
    torch.manual_seed(1)
    model = ce.tensorize(Clicks(), ce.CoMERAConfig(target_compression=50)).eval()
    path = ce.save(model, tmp_path / "clicks.safetensors")
    loaded = ce.load_into(Clicks(), path).eval()
    assert isinstance(loaded.tags, TTEmbeddingBag) and loaded.tags.mode == "sum"
    with torch.no_grad():
        torch.testing.assert_close(loaded(*_batch()), model(*_batch()))

    class Plain(Clicks):
        def __init__(self) -> None:
            super().__init__()
            self.tags = nn.Embedding(4000, 16)

    with pytest.raises(BadExportFile, match="'tags' was saved as a TT EmbeddingBag"):
        ce.load_into(Plain(), path)
    # ce.load reads exports, which name how to build the model; a save names no class
    with pytest.raises(BadExportFile, match=r"load it with comera_engine\.load_into\("):
        ce.load(path)


@pytest.mark.parametrize(("mode", "pad", "last", "weighted"), CASES)
def test_the_onnx_form_reduces_as_the_layer_does(mode: str, pad: int | None, last: bool,
                                                 weighted: bool) -> None:
    """The export form (plain ONNX ops: torch's exporter has no ``embedding_bag`` with a
    padding row) gives the layer's bags, flat with offsets and 2-D, in torch and (flat,
    on bags other than the traced ones) through onnxruntime."""
    from comera_engine.export.onnx_export import OnnxTTEmbeddingBag

    torch.manual_seed(0)
    bag = TTEmbeddingBag(300, 20, rank=5, mode=mode, padding_idx=pad,
                         include_last_offset=last).eval()
    form = OnnxTTEmbeddingBag(bag).eval()
    ids = torch.tensor([5, 7, 7, 299, 0, 5, 12, 12, 3, 5, 5])
    offsets = torch.tensor([0, 4, 4, 6, 8] + ([11] if last else []))
    psw = torch.rand(ids.shape) if weighted else None
    with torch.no_grad():
        for args in ((ids, offsets, psw), (ids[:10].reshape(2, 5), None,
                                           None if psw is None else psw[:10].reshape(2, 5))):
            torch.testing.assert_close(form(*args), bag(*args), rtol=1e-5, atol=1e-6)
    if pad is None:  # onnxruntime: the cases with a padding row, one per mode
        return
    ort = pytest.importorskip("onnxruntime")
    import io
    import warnings

    names = ["ids", "offsets"] + (["weights"] if weighted else [])
    buf = io.BytesIO()
    with warnings.catch_warnings():  # the tracer's notes on shapes it treats as constants
        warnings.simplefilter("ignore")
        torch.onnx.export(form, (ids, offsets, psw), buf, dynamo=False, opset_version=17,
                          input_names=names, dynamic_axes={"ids": {0: "n"}, "offsets": {0: "b"},
                                                           "weights": {0: "n"}})
    session = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    ids2 = torch.tensor([1, 5, 2, 2, 9, 5])  # other bags than the traced ones
    offsets2 = torch.tensor([0, 2, 5] + ([6] if last else []))
    psw2 = torch.rand(ids2.shape) if weighted else None
    feeds = {"ids": ids2.numpy(), "offsets": offsets2.numpy()}
    if weighted:
        feeds["weights"] = psw2.numpy()
    (got,) = session.run(None, feeds)
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), bag(ids2, offsets2, psw2),
                                   rtol=1e-5, atol=1e-6)
