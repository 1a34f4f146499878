"""The Triton kernels, proven without a GPU: numerics under ``TRITON_INTERPRET=1`` on the
CPU against a float64 reference, and compiled ahead for sm_80 and sm_90 with no spills
and shared memory within the device limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
triton = pytest.importorskip("triton", reason="triton is not installed (Linux x86-64 only)")

from comera_engine.kernels import aot, configs  # noqa: E402
from comera_engine.kernels import tt_linear as K  # noqa: E402
from tests.kernel_checks import bench_smoke_run  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="no GPU and TRITON_INTERPRET is not 1")

ROOT = Path(__file__).resolve().parents[1]

# 37 tokens, odd in and out widths (not multiples of any block), ranks below, at and above
# a rank tile
SHAPES = [(37, 45, 5, 29), (37, 70, 30, 33), (19, 33, 64, 70)]


# interpreted on the CPU here; compiled on a GPU (experiments/gpu_check.sh sets
# TRITON_INTERPRET=0)
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def _inputs(B, N, r, M, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, generator=g, dtype=torch.float64)
    L = torch.randn(N, r, generator=g, dtype=torch.float64) / N ** 0.5
    R = torch.randn(r, M, generator=g, dtype=torch.float64) / r ** 0.5
    b = torch.randn(M, generator=g, dtype=torch.float64)
    return [t.to(DEVICE, dtype).requires_grad_() for t in (x, L, R, b)]


TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,N,r,M", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_fused_tt_linear_forward_and_every_gradient_match_float64(B, N, r, M, dtype,
                                                                   with_bias) -> None:
    x, L, R, b = _inputs(B, N, r, M, dtype)
    bias = b if with_bias else None
    y = K.tt_linear_chain(x, L, R, bias)
    assert y.dtype == dtype and y.shape == (B, M)
    dy = torch.randn(B, M, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y.backward(dy.to(DEVICE, dtype))
    refs = [t.detach().cpu().double().requires_grad_() for t in (x, L, R, b)]
    y_ref = K.tt_linear_chain_reference(refs[0], refs[1], refs[2],
                                        refs[3] if with_bias else None)
    y_ref.backward(dy)
    scale = y_ref.abs().max()
    torch.testing.assert_close(y.cpu().double() / scale, y_ref.detach() / scale, **TOL[dtype])
    for got, ref in zip((x, L, R, b), refs):
        if ref.grad is None:
            assert got.grad is None
            continue
        s = ref.grad.abs().max()
        torch.testing.assert_close(got.grad.cpu().double() / s, ref.grad / s, **TOL[dtype])


def test_three_dimensional_input_and_rank_limits() -> None:
    x, L, R, b = (t.detach() for t in _inputs(2 * 7, 24, 8, 17, torch.float32))
    x3 = x.reshape(2, 7, 24)
    y = K.tt_linear_chain(x3, L, R, b)
    ref = K.tt_linear_chain_reference(*(t.cpu().double() for t in (x3, L, R, b)))
    torch.testing.assert_close(y.cpu().double(), ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="^rank"):
        K.rank_block(K.MAX_RANK + 1)
    with pytest.raises(ValueError, match="^p: expected shape"):
        K.chain(x, R, R)


def test_kernels_compile_ahead_for_a100_and_h100_without_spills(tmp_path) -> None:
    """Each kernel at the paper's shapes compiles to a cubin for sm_80 and sm_90 (fp32 and
    bf16) with no register spills and shared memory within the block limit; the script
    prints the table and writes the JSON (in its own process: the kernels here are the
    interpreted ones)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "kernels_aot.py"),
                          "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=600, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "kernels_aot.json").read_text())["rows"]
    cases = len(aot.paper_cases())
    assert len(rows) == 2 * 2 * cases and {r["arch"] for r in rows} == {80, 90}
    for r in rows:
        assert r["spill_bytes"] == 0 and 0 < r["registers"] <= 255, r
        assert r["shared_bytes"] <= r["shared_limit"], r


def test_bench_kernels_smoke_run(tmp_path) -> None:
    """experiments/bench_kernels.py runs its four variants, eager and in a CUDA graph
    where there is one, and writes its JSON (at a tiny shape: the code path, not a
    timing): interpreted on the CPU, compiled on a GPU."""
    bench_smoke_run("bench_kernels", ["--shapes", "64x48", "--tokens", "37", "--rank", "6"],
                    tmp_path, DEVICE, {"fused", "halves", "dense", "nn.Linear"})


def test_tt_linear_layer_runs_its_fused_path_on_the_fused_kernels(monkeypatch,
                                                                  count_calls) -> None:
    """A TTLinear with gates (one dead entry) on its ``fused`` path: on the fused kernels
    (``COMERA_KERNELS=interpret`` takes CPU tensors under the interpreter) it gives the
    halves op's output and gradients; where the kernels do not run (the default for a
    CPU tensor) the path is the halves op and no tensor reaches Triton."""
    from comera_engine import TTLinear
    from comera_engine.kernels import tt_linear as kt

    torch.manual_seed(0)
    layer = TTLinear(24, 20, rank=6, path="fused").to(DEVICE)
    with torch.no_grad():
        layer.tt.gates[1][2] = 0.0
    x = torch.randn(13, 24, device=DEVICE, requires_grad=True)
    dy = torch.randn(13, 20, device=DEVICE)

    def run() -> list[torch.Tensor]:
        layer.zero_grad()
        x.grad = None
        y = layer(x)
        y.backward(dy)
        return [y.detach(), x.grad, *(p.grad for p in layer.parameters() if p.grad is not None)]

    calls = count_calls(kt, "tt_linear_chain")
    monkeypatch.setenv("COMERA_KERNELS", "0")
    want = run()  # the PyTorch halves op
    monkeypatch.setenv("COMERA_KERNELS", "1")
    if DEVICE == "cpu":
        run()
        assert not calls  # the default never sends a CPU tensor to Triton
        monkeypatch.setenv("COMERA_KERNELS", "interpret")
    got = run()
    assert calls  # the same layer on the fused kernels
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _rel_close(got: torch.Tensor, want: torch.Tensor) -> None:
    s = want.abs().max()
    torch.testing.assert_close(got.cpu().double() / s, want / s, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cfg", configs.CANDIDATES["chain"], ids=str)
def test_every_chain_configuration_matches_float64(cfg) -> None:
    """Each launch configuration a tuning sweep may pick for the chain (tiles, column
    groups, warps) gives ``(x·L)·R + b`` and ``x·L`` at a shape with several row and
    column tiles and a ragged edge."""
    x, L, R, b = (t.detach() for t in _inputs(70, 45, 30, 300, torch.float32))
    y, mid = K.chain(x, L, R, b, save_mid=True, cfg=cfg)
    x64, L64, R64, b64 = (t.cpu().double() for t in (x, L, R, b))
    _rel_close(mid, x64 @ L64)
    _rel_close(y, (x64 @ L64) @ R64 + b64)


@pytest.mark.parametrize("cfg", configs.CANDIDATES["matmul_tn"], ids=str)
def test_every_batch_sum_configuration_matches_float64(cfg) -> None:
    """``matmul_tn`` (row groups summed after) at 150 rows, and the bias gradient's
    ``colsum`` at every one of its configurations."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(150, 40, generator=g, dtype=torch.float64)
    gg = torch.randn(150, 70, generator=g, dtype=torch.float64)
    _rel_close(K.matmul_tn(a.to(DEVICE, torch.float32), gg.to(DEVICE, torch.float32),
                           cfg=cfg), a.t() @ gg)
    for col_cfg in configs.CANDIDATES["colsum"]:
        _rel_close(K.colsum(gg.to(DEVICE, torch.float32), cfg=col_cfg), gg.sum(0))


def test_the_launch_configuration_follows_the_installed_table() -> None:
    """The nearest tuned shape of the same dtype gives the configuration; none, the
    default; a forced one wins inside its block."""
    tuned = {"BLOCK_B": 64, "BLOCK_K": 32, "BLOCK_M": 64, "SPLIT": 8, "num_warps": 4}
    try:
        configs.install({"chain": [{"shape": [4096, 768, 30, 3072], "dtype": "bfloat16",
                                    "config": tuned}], "unknown": []})
        assert configs.config("chain", (2048, 768, 30, 3072), "bfloat16") == tuned
        assert configs.config("chain", (2048, 768, 30, 3072), "float32") == configs.DEFAULTS[
            "chain"]
        assert configs.installed() == {"chain": 1}
        with configs.forced("chain", configs.CANDIDATES["chain"][2]):
            assert configs.config("chain", (1, 1, 1, 1), "bfloat16")["SPLIT"] == 4
        assert configs.config("chain", (1, 1, 1, 1), "bfloat16") == tuned
    finally:
        configs.reset()
    assert configs.launch_options(tuned) == {"num_warps": 4}
