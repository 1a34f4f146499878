"""Every path of every TT layer kind against float64: the TT linear in both layouts, the
TTM embedding's lookup and its tied decoder, each path forced in turn (reconstructed,
factorised, fused where a Triton kernel exists), value and every gradient (input, cores,
gates, bias) against a reference computed here from the same parameters by plain
contractions (no engine code), with gates that have a dead entry and an entry below
``tau`` on every bond (both must get exactly zero gradient). The fused kernels run
interpreted on the CPU (``TRITON_INTERPRET=1``), in float32."""

from __future__ import annotations

import math

import pytest
import torch

from comera_engine.layers import TTEmbedding, TTLinear
from comera_engine.tensor.costs import OPS

DT = torch.float64
TAU = 0.05


def _gate(tt, seed: int) -> list[tuple[int, int]]:
    """Random gates in [0.1, 1.1); on every bond entry 0 dead (its value kept, so only the
    mask can silence it) and the last at ``tau / 2``. Returns those entries' offsets."""
    g = torch.Generator().manual_seed(seed)
    tt.tau = TAU
    quiet, off = [], 0
    with torch.no_grad():
        tt.gate.copy_(torch.rand(tt.gate.shape, generator=g, dtype=DT) + 0.1)
        for r in tt.bond_ranks:
            tt.alive[off] = False
            tt.gate[off + r - 1] = 0.5 * TAU
            quiet.append((off, off + r - 1))
            off += r
    return quiet


def _gated_cores(tt) -> list[torch.Tensor]:
    """``G_k · diag(g_k ⊙ [alive_k and |g_k| > tau])`` on every bond, the last core as is."""
    out, off = [], 0
    for k, core in enumerate(tt.cores):
        if k < len(tt.bond_ranks):
            r = tt.bond_ranks[k]
            g = tt.gate[off:off + r]
            keep = (tt.alive[off:off + r] & (g.detach().abs() > tt.tau)).to(g.dtype)
            core = core * (g * keep)
            off += r
        out.append(core)
    return out


def _train(cores: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor of a train, flattened in core order: ``(∏ modes,)``."""
    acc = cores[0].reshape(-1, cores[0].shape[-1])
    for c in cores[1:]:
        acc = torch.einsum("ar,rb->ab", acc, c.reshape(c.shape[0], -1)).reshape(-1, c.shape[-1])
    return acc.reshape(-1)


def _weight(tt, layout: str) -> torch.Tensor:
    """``W`` (inputs × outputs, padded) of a layer's gated cores."""
    cores = _gated_cores(tt)
    if layout == "tt":
        N = math.prod(c.shape[1] for c in cores[: len(cores) // 2])
        return _train(cores).reshape(N, -1)
    rows = [c.shape[1] for c in cores]
    cols = [c.shape[2] for c in cores]
    t = _train(cores).reshape([x for n, m in zip(rows, cols) for x in (n, m)])
    d = len(cores)
    return t.permute([2 * k for k in range(d)] + [2 * k + 1 for k in range(d)]).reshape(
        math.prod(rows), math.prod(cols))


def _value_and_grads(fn, leaves: list[torch.Tensor], gy: torch.Tensor) -> list[torch.Tensor]:
    y = fn()
    grads = torch.autograd.grad((y * gy.to(y.dtype)).sum(), leaves, allow_unused=True)
    return [y.detach().to(DT), *(g.to(DT) if g is not None else torch.zeros_like(t, dtype=DT)
                                  for g, t in zip(grads, leaves))]


def _close(got: list[torch.Tensor], want: list[torch.Tensor], rtol: float) -> None:
    for a, b in zip(got, want):
        assert a.shape == b.shape
        scale = max(float(b.abs().max()), 1e-30)
        torch.testing.assert_close(a / scale, b / scale, rtol=rtol, atol=rtol)


def _quiet_zero(gate_grad: torch.Tensor, quiet: list[tuple[int, int]]) -> None:
    for dead, low in quiet:
        assert gate_grad[dead] == 0 and gate_grad[low] == 0


def _linear(layout: str) -> TTLinear:
    torch.manual_seed(0)  # 23 -> 19 on factors 2·3·4 | 4·1·5: both sides padded
    return TTLinear(23, 19, rank=4, in_factors=[2, 3, 4], out_factors=[4, 1, 5], dtype=DT,
                    layout=layout)


def _check_linear(layer: TTLinear, layout: str, path: str, rows: int, rtol: float,
                  dtype: torch.dtype = DT) -> None:
    quiet = _gate(layer.tt, rows)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 23, generator=g, dtype=DT)
    gy = torch.randn(rows, 19, generator=g, dtype=DT)
    leaves = [x.requires_grad_(), *layer.tt.cores, layer.tt.gate, layer.bias]

    def ref() -> torch.Tensor:
        W = _weight(layer.tt, layout)[:23, :19]
        return x @ W + layer.bias

    want = _value_and_grads(ref, leaves, gy)
    low = layer.to(dtype)
    low.path = path
    lx = x.detach().to(dtype).requires_grad_()
    got = _value_and_grads(lambda: low(lx), [lx, *low.tt.cores, low.tt.gate, low.bias], gy)
    _close(got, want, rtol)
    _quiet_zero(got[-2], quiet)


@pytest.mark.parametrize("layout", ["tt", "ttm"])
@pytest.mark.parametrize("rows", [7, 130])  # 130: the halves path pads from 128 rows
def test_every_linear_path_matches_float64(op_impl: str, layout: str, rows: int) -> None:
    op = "ttm_linear" if layout == "ttm" else "tt_linear"
    for path in OPS[op]:  # "fused" where the kernels do not run: the halves op
        _check_linear(_linear(layout), layout, path, rows, 1e-10)


def test_a_forced_path_runs_and_a_wrong_one_is_refused() -> None:
    layer = _linear("ttm")
    x = torch.randn(3, 2, 23, dtype=DT)  # leading dimensions kept
    assert layer(x).shape == (3, 2, 19)
    with pytest.raises(ValueError, match="^path"):
        TTLinear(8, 8, layout="ttm", path="halves")
    with pytest.raises(ValueError, match="^path"):
        TTEmbedding(10, 4, path="table")


def _embedding() -> TTEmbedding:
    torch.manual_seed(1)  # 57 rows on 3·4·5, dim 10 on 2·5·1, a padding row
    return TTEmbedding(57, 10, rank=3, padding_idx=2, vocab_factors=[3, 4, 5],
                       dim_factors=[2, 5, 1], dtype=DT)


def _table(emb: TTEmbedding) -> torch.Tensor:
    E = _weight(emb.tt, "ttm")[:57, :10]
    keep = torch.ones(57, 1, dtype=DT)
    keep[2] = 0
    return E * keep


IDS = torch.tensor([[5, 2, 56, 5], [0, 31, 31, 17]])


def _check_lookup(emb: TTEmbedding, path: str, rtol: float, dtype: torch.dtype = DT) -> None:
    quiet = _gate(emb.tt, 3)
    gy = torch.randn(2, 4, 10, generator=torch.Generator().manual_seed(2), dtype=DT)
    want = _value_and_grads(lambda: _table(emb)[IDS], [*emb.tt.cores, emb.tt.gate], gy)
    low = emb.to(dtype)
    low.path = path
    got = _value_and_grads(lambda: low(IDS), [*low.tt.cores, low.tt.gate], gy)
    _close(got, want, rtol)
    _quiet_zero(got[-1], quiet)


def _check_decode(emb: TTEmbedding, path: str, rtol: float) -> None:
    quiet = _gate(emb.tt, 4)
    g = torch.Generator().manual_seed(5)
    h = torch.randn(2, 3, 10, generator=g, dtype=DT).requires_grad_()
    gy = torch.randn(2, 3, 57, generator=g, dtype=DT)
    leaves = [h, *emb.tt.cores, emb.tt.gate]
    want = _value_and_grads(lambda: h @ _table(emb).t(), leaves, gy)
    got = _value_and_grads(lambda: emb.decode(h, path), leaves, gy)
    _close(got, want, rtol)
    _quiet_zero(got[-1], quiet)


def test_every_lookup_and_decoder_path_matches_float64(op_impl: str) -> None:
    for path in OPS["ttm_lookup"]:  # "fused" where the kernels do not run: gather
        _check_lookup(_embedding(), path, 1e-10)
    for path in OPS["ttm_decode"]:
        _check_decode(_embedding(), path, 1e-10)


def test_a_rank_zero_bond_reads_zero_on_every_path() -> None:
    """After a truncation that left a bond empty, every path gives the zero map (plus
    the bias) and the rows read zero."""
    x = torch.randn(4, 23, dtype=DT)
    for layout in ("tt", "ttm"):
        layer = _linear(layout)
        layer.tt.resize_([0] * len(layer.tt.bond_ranks))
        for path in OPS["ttm_linear" if layout == "ttm" else "tt_linear"]:
            layer.path = path
            torch.testing.assert_close(layer(x), layer.bias.expand(4, 19))
    emb = _embedding()
    emb.tt.resize_([0, 0])
    for path in OPS["ttm_lookup"]:
        emb.path = path
        assert not emb(IDS).any()


# ------------------------------------------------------------------ the fused kernels
@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton", reason="triton is not installed (Linux x86-64 only)")
    if __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the fused kernels run interpreted here only with TRITON_INTERPRET=1")
    monkeypatch.setenv("COMERA_KERNELS", "interpret")


def test_the_fused_linear_path_matches_float64(interpreted: None, count_calls) -> None:
    from comera_engine.kernels import tt_linear as kt

    calls = count_calls(kt, "tt_linear_chain")
    for rows in (7, 130):
        _check_linear(_linear("tt"), "tt", "fused", rows, 1e-4, torch.float32)
    assert len(calls) == 2


def test_the_fused_lookup_path_matches_float64(interpreted: None, count_calls) -> None:
    from comera_engine.kernels import ttm_lookup as kl

    calls = count_calls(kl, "ttm_lookup_fused")
    _check_lookup(_embedding(), "fused", 1e-4, torch.float32)
    assert calls


def test_a_run_says_which_path_each_tt_op_takes(tmp_path) -> None:
    """``comera train`` logs the planner's choices once training starts (a ``paths``
    event: each TT op's case, path and where its time came from), which the Live run
    page states above its charts."""
    import json

    from comera_engine.cli import main

    run = tmp_path / "run"
    assert main(["train", "experiments/configs/digits_tt_mlp.toml", "--no-store",
                 "--no-progress", "--run-dir", str(run), "--set", "train.steps=3",
                 "--set", "train.eval_every=3", "--set", "train.ckpt_every=3"]) == 0
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (paths,) = [e for e in events if e.get("type") == "event" and e["kind"] == "paths"]
    assert "ttm_linear 256×256" in paths["text"] and ": dense (cpu default)" in paths["text"]
    assert "Cost model: cpu" in paths["text"]
    assert "×64 " in paths["text"]  # the training batch's rows (evaluation's are not told)
