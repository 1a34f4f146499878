"""The matrix of a gated TT matrix (``ops.ttm_matrix``), on the PyTorch path and through
the CPU backend (``csrc/ttm_matrix.cpp``), against tensorly's ``tt_matrix_to_tensor`` of
the gated cores in float64 (values and gradients); and the training step's gradient
clipping on the backend against ``torch.nn.utils.clip_grad_norm_``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorly as tl
import torch
from tensorly.tt_matrix import tt_matrix_to_tensor

from comera_engine.layers import TTLinear
from comera_engine.ops.ttm_matrix import ttm_matrix, ttm_matrix_reference
from comera_engine.train.step import clip_grad_norm_

TAU = 0.1
SHAPES = {  # per core (r_{k-1}, n_k, m_k, r_k)
    "one core": [(1, 3, 5, 1)],
    "two cores": [(1, 2, 3, 4), (4, 5, 2, 1)],
    "digits layer": [(1, 4, 4, 6), (6, 4, 8, 6), (6, 4, 8, 1)],
    "four cores": [(1, 2, 3, 3), (3, 3, 2, 5), (5, 2, 2, 4), (4, 3, 2, 1)],
}


def _inputs(shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int = 0):
    """Cores, gates around the threshold (some at or below it) and alive vectors with
    some entries dead for good."""
    g = torch.Generator().manual_seed(seed)
    cores = [torch.randn(s, generator=g, dtype=dtype) / math.sqrt(s[0]) for s in shapes]
    gates = [torch.randn(s[-1], generator=g, dtype=dtype) * 0.5 for s in shapes[:-1]]
    for v in gates:
        v[0] = TAU / 2  # below the threshold: pruned though alive
    alive = [torch.rand(s[-1], generator=g) > 0.25 for s in shapes[:-1]]
    return cores, gates, alive


def _tensorly_w(cores: list[torch.Tensor], gates: list[torch.Tensor],
                alive: list[torch.Tensor]) -> torch.Tensor:
    """W (∏ n, ∏ m) from tensorly's TT-matrix contraction of the gated cores, float64,
    differentiable (tensorly on its PyTorch backend)."""
    gated = [c.double() for c in cores]
    for b, (v, a) in enumerate(zip(gates, alive)):
        keep = (v.detach().abs() > TAU) & a
        gated[b] = gated[b] * (v.double() * keep)
    rows = math.prod(c.shape[1] for c in cores)
    cols = math.prod(c.shape[2] for c in cores)
    with tl.backend_context("pytorch"):
        return tt_matrix_to_tensor(gated).reshape(rows, cols)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ttm_matrix_and_its_gradients_match_tensorly(op_impl: str, name: str,
                                                      dtype: torch.dtype) -> None:
    cores, gates, alive = _inputs(SHAPES[name], dtype)
    leaves = [t.clone().requires_grad_() for t in (*cores, *gates)]
    W = ttm_matrix(leaves[: len(cores)], leaves[len(cores):], alive, TAU)
    if op_impl == "backend":  # one node of the backend, not the reference's ops
        assert type(W.grad_fn).__name__ == "CppFunction"
    ref_leaves = [t.detach().double().requires_grad_() for t in (*cores, *gates)]
    R = _tensorly_w(ref_leaves[: len(cores)], ref_leaves[len(cores):], alive)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert W.dtype == dtype and W.shape == R.shape
    assert torch.allclose(W.double(), R, rtol=tol, atol=tol)
    dW = torch.randn(R.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    W.backward(dW.to(dtype))
    R.backward(dW)
    for mine, ref in zip(leaves, ref_leaves):
        scale = max(1.0, float(ref.grad.abs().max()))
        assert torch.allclose(mine.grad.double(), ref.grad, rtol=tol, atol=tol * scale)
    for v, a, grad in zip(gates, alive, leaves[len(cores):]):  # pruned entries get none
        assert not grad.grad[~(a & (v.abs() > TAU))].any()


def test_frozen_gates_and_no_grad_cores_take_the_same_node(op_impl: str) -> None:
    """Gates frozen (a fixed-rank model), or only some cores trained: the gradients asked
    for are the reference's, the others are not made."""
    cores, gates, alive = _inputs(SHAPES["digits layer"], torch.float64, seed=3)
    leaves = [c.clone().requires_grad_(k != 1) for k, c in enumerate(cores)]
    W = ttm_matrix(leaves, gates, alive, TAU)
    ref = [c.clone().requires_grad_(k != 1) for k, c in enumerate(cores)]
    R = ttm_matrix_reference(ref, gates, alive, TAU)
    torch.testing.assert_close(W, R, rtol=1e-12, atol=1e-12)
    W.sum().backward()
    R.sum().backward()
    assert leaves[1].grad is None
    for mine, r in zip(leaves, ref):
        if r.grad is not None:
            torch.testing.assert_close(mine.grad, r.grad, rtol=1e-12, atol=1e-12)


def test_a_bond_of_rank_zero_and_autocast_take_the_reference(cpu_backend: object) -> None:
    cores, gates, alive = _inputs(SHAPES["two cores"], torch.float32)
    empty = [cores[0][..., :0], cores[1][:0]]
    W = ttm_matrix(empty, [gates[0][:0]], [alive[0][:0]], TAU)
    assert W.shape == (10, 6) and not W.any()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        Wb = ttm_matrix(cores, gates, alive, TAU)
    assert type(Wb.grad_fn).__name__ != "CppFunction"


def test_a_ttm_layer_trains_the_same_on_the_backend_and_in_pytorch(
        cpu_backend: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """A TTLinear (ttm layout) in float64: outputs and every gradient of a step agree
    between the backend's node and the PyTorch ops."""
    torch.manual_seed(0)
    layer = TTLinear(64, 256, rank=6, layout="ttm", tau=TAU).double()
    with torch.no_grad():
        for g in layer.tt.gates:
            g.uniform_(-1.0, 1.0)
    x = torch.randn(8, 64, dtype=torch.float64)
    results = []
    for native in ("1", "0"):
        monkeypatch.setenv("COMERA_NATIVE", native)
        layer.zero_grad()
        y = layer(x)
        (y ** 2).sum().backward()
        results.append((y.detach(), [p.grad.clone() for p in layer.parameters()]))
    (y1, g1), (y0, g0) = results
    torch.testing.assert_close(y1, y0, rtol=1e-12, atol=1e-12)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("max_norm", [1e-2, 1e6])
def test_clip_grad_norm_matches_torch(cpu_backend: object, dtype: torch.dtype,
                                      max_norm: float) -> None:
    """Clipped (a small bound) and left alone (a large one): the norm and every gradient
    as torch's ``clip_grad_norm_`` gives them."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in [(3, 4), (7,), (2, 2, 5)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=dtype)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(ref, params):
        r.grad = p.grad.clone()
    norm = clip_grad_norm_(params, [p.grad for p in params], max_norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    assert norm.dtype == ref_norm.dtype
    torch.testing.assert_close(norm, ref_norm, rtol=tol, atol=0)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r.grad, rtol=tol, atol=tol)
    if max_norm < 1:
        total = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
        assert abs(total - max_norm) < 1e-4 * max_norm


def test_clip_grad_norm_leaves_what_it_does_not_take_to_torch(cpu_backend: object) -> None:
    """Mixed dtypes and a non-contiguous gradient: torch's clipping, same numbers."""
    params = [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(5,
                                                                                   dtype=torch.float64))]
    params[0].grad = torch.randn(3, 4).t()  # non-contiguous
    params[1].grad = torch.randn(5, dtype=torch.float64)
    expect = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
    norm = clip_grad_norm_(params, [p.grad for p in params], 1e6)
    assert abs(float(norm) - expect) < 1e-5 * expect
    assert not np.isnan(float(norm))
