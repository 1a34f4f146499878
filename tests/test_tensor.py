"""Issue 2: the TT math against independent references (tensorly, dense products)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorly as tl
import torch
from tensorly.tt_matrix import tt_matrix_to_tensor

from comera_engine.tensor import (
    PATHS,
    TTLinearCores,
    TTMCores,
    explain,
    factorize,
    plan,
    resolve_factors,
    tt_linear,
)
from comera_engine.tensor.contract import TTLinearHalves, TTLinearSweep, gate_masks

DT = torch.float64


def _rand_linear_shapes(rng: np.random.Generator, d: int) -> tuple[list[int], list[int]]:
    hi = 4 if d <= 3 else 3
    return ([int(x) for x in rng.integers(2, hi + 1, d)],
            [int(x) for x in rng.integers(2, hi + 1, d)])


def _tensorly_dense(cores: list[torch.Tensor]) -> torch.Tensor:
    """Reference reconstruction with tensorly's PyTorch backend (differentiable)."""
    with tl.backend_context("pytorch"):
        return tl.tt_to_tensor(list(cores))


# ------------------------------------------------------------------ factorisation
def test_factorize_paper_examples_and_padding() -> None:
    assert factorize(768, 3).factors == (12, 8, 8)
    assert factorize(3072, 3).factors == (16, 16, 12)
    f = factorize(30522, 4)
    assert f.padded >= 30522 and f.pad == f.padded - 30522 and f.pad > 0
    assert math.prod(f.factors) == f.padded and len(f.factors) == 4
    assert max(f.factors) / min(f.factors) <= 2.0
    for n in range(1, 400):
        for d in (1, 2, 3):
            g = factorize(n, d)
            assert len(g.factors) == d and math.prod(g.factors) >= n


def test_explicit_factors_accepted_and_validated() -> None:
    assert resolve_factors(30522, [16, 20, 10, 10], 4, "vocab_factors").padded == 32000
    with pytest.raises(ValueError, match="vocab_factors"):
        resolve_factors(30522, [16, 20, 10, 9], 4, "vocab_factors")  # product too small
    with pytest.raises(ValueError, match="in_factors"):
        resolve_factors(768, [12, 0, 64], None, "in_factors")
    with pytest.raises(ValueError, match="in_factors"):
        resolve_factors(768, [12, 8, 8], 2, "in_factors")
    with pytest.raises(ValueError, match="^n:"):
        factorize(0, 3)
    with pytest.raises(ValueError, match="^d:"):
        factorize(10, 0)


# ------------------------------------------------------------------ reconstruction
@pytest.mark.parametrize("d", [1, 2, 3, 4, 5])
def test_to_dense_matches_tensorly(d: int) -> None:
    rng = np.random.default_rng(d)
    ins, outs = _rand_linear_shapes(rng, d)
    ranks = [int(x) for x in rng.integers(1, 5, 2 * d - 1)]
    caps = [min(math.prod((ins + outs)[:k]), math.prod((ins + outs)[k:])) for k in
            range(1, 2 * d)]
    ranks = [min(r, c) for r, c in zip(ranks, caps)]
    tt = TTLinearCores(ins, outs, ranks, dtype=DT)
    with torch.no_grad():
        for g in tt.gates:
            g.uniform_(0.5, 1.5)  # non-trivial gates: absorbed into cores in the reference
    with tl.backend_context("numpy"):  # importing tltorch elsewhere switches the default
        ref = tl.tt_to_tensor([c.detach().numpy() for c in tt.gated_cores()])
    np.testing.assert_allclose(tt.to_dense().detach().numpy(), ref, rtol=1e-12, atol=1e-12)
    assert tt.to_matrix().shape == (math.prod(ins), math.prod(outs))

    rows, cols = _rand_linear_shapes(rng, d)
    ttm = TTMCores(rows, cols, [min(r, 3) for r in ranks[:d - 1]], dtype=DT)
    with tl.backend_context("numpy"):
        ref_m = tt_matrix_to_tensor([c.detach().numpy() for c in ttm.gated_cores()])
    np.testing.assert_allclose(ttm.to_dense().detach().numpy(), ref_m, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("d", [1, 2, 3])
def test_tt_svd_roundtrip(d: int) -> None:
    rng = np.random.default_rng(10 + d)
    ins, outs = _rand_linear_shapes(rng, d)
    src = TTLinearCores(ins, outs, 2, dtype=DT)
    W = src.to_matrix().detach()
    back = TTLinearCores.from_dense(W, ins, outs, tol=1e-10)
    assert torch.allclose(back.to_matrix(), W, atol=1e-10)
    assert max(back.ranks) <= 2  # the planted rank is recovered, not exceeded
    capped = TTLinearCores.from_dense(torch.randn(12, 10, dtype=DT), [3, 4], [2, 5],
                                      max_rank=2)
    assert max(capped.ranks) <= 2
    E = TTMCores([3, 4], [2, 2], 3, dtype=DT).to_matrix().detach()
    backm = TTMCores.from_dense(E, [3, 4], [2, 2], tol=1e-12)
    assert torch.allclose(backm.to_matrix(), E, atol=1e-10) and max(backm.ranks) <= 3


# ------------------------------------------------------------------ contraction paths
@pytest.mark.parametrize("d", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("path", PATHS)
def test_paths_match_dense_values_and_gradients(d: int, path: str) -> None:
    rng = np.random.default_rng(100 + d)
    ins, outs = _rand_linear_shapes(rng, d)
    if d == 5:
        ins, outs = [2] * 5, [2] * 5
    tt = TTLinearCores(ins, outs, 3, dtype=DT)
    B = 5
    x = torch.randn(B, math.prod(ins), dtype=DT, requires_grad=True)
    cores = [c.detach().clone().requires_grad_() for c in tt.cores]
    y = tt_linear(x, cores, d, path)
    gy = torch.randn_like(y)
    gx, *gc = torch.autograd.grad((y * gy).sum(), [x, *cores])

    x_ref = x.detach().clone().requires_grad_()
    cores_ref = [c.detach().clone().requires_grad_() for c in cores]
    W = _tensorly_dense(cores_ref).reshape(math.prod(ins), math.prod(outs))
    y_ref = x_ref @ W
    gx_ref, *gc_ref = torch.autograd.grad((y_ref * gy).sum(), [x_ref, *cores_ref])

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).detach().norm() / b.detach().norm())

    assert rel(y, y_ref) < 1e-10
    assert rel(gx, gx_ref) < 1e-10
    for a, b in zip(gc, gc_ref):
        assert rel(a, b) < 1e-10
    if d <= 3:
        assert torch.autograd.gradcheck(lambda x_, *c: tt_linear(x_, c, d, path), (x, *cores))
        b = torch.randn(math.prod(outs), dtype=DT, requires_grad=True)
        yb = tt_linear(x, cores, d, path, bias=b)
        assert torch.allclose(yb, y + b, atol=1e-12)
        assert torch.autograd.gradcheck(lambda x_, b_, *c: tt_linear(x_, c, d, path, bias=b_),
                                        (x, b, *cores))


@pytest.mark.parametrize("rank", [7, 16])  # r_d + 1 fills the 16-wide block / needs more
@pytest.mark.parametrize("needs", ["all", "x_only", "bias_only"])
@pytest.mark.parametrize("B", [9, 130])  # unpadded (addmm) / padded with the bias inside
def test_halves_bias_in_padding_matches_dense(rank: int, needs: str, B: int) -> None:
    """The bias rides in the padded middle rank: same output and gradients as ``x·W + b``
    with the float64 reconstruction, whichever inputs need a gradient."""
    cores = [c.detach().clone() for c in TTLinearCores([8, 2], [4, 4], rank, dtype=DT).cores]
    assert cores[1].shape[-1] == rank  # the middle bond r_d
    x = torch.randn(B, 16, dtype=DT, requires_grad=needs != "bias_only")
    b = torch.randn(16, dtype=DT, requires_grad=True)
    for c in cores:
        c.requires_grad_(needs == "all")
    y = TTLinearHalves.apply(x, 2, b, *cores)
    W = _tensorly_dense([c.detach() for c in cores]).reshape(16, 16)
    assert torch.allclose(y, x.detach() @ W + b.detach(), rtol=1e-12, atol=1e-12)
    gy = torch.randn_like(y)
    wrt = [t for t in (x, b, *cores) if t.requires_grad]
    got = torch.autograd.grad((y * gy).sum(), wrt)
    ib = next(i for i, t in enumerate(wrt) if t is b)
    assert torch.allclose(got[ib], gy.sum(0), rtol=1e-12, atol=1e-12)
    if x.requires_grad:
        assert torch.allclose(got[0], gy @ W.t(), rtol=1e-12, atol=1e-12)
    if needs == "all" and B < 100:
        assert torch.autograd.gradcheck(lambda *t: TTLinearHalves.apply(t[0], 2, t[1], *t[2:]),
                                        (x, b, *cores))


@pytest.fixture(params=["native", "pytorch"])
def native_impl(request, monkeypatch) -> str:
    """Runs a test with the CPU backend's C++ ops and with the PyTorch Functions."""
    if request.param == "pytorch":
        monkeypatch.setenv("COMERA_NATIVE", "0")
    else:
        request.getfixturevalue("cpu_backend")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_module_gates_are_the_masked_product_bit_for_bit(dtype: torch.dtype) -> None:
    """``TensorTrain.gated_cores`` (``absorb_gates``: hardshrink, then the alive vector) is
    ``G_k · diag(g_k ⊙ m_k)`` with ``m = alive & (|g| > tau)`` written out by hand, the
    same bits for the cores and for the gradients of cores and gates; entries dead, at
    tau or below get exactly zero gradient."""
    torch.manual_seed(5)
    tt = TTMCores((2, 3, 2), (3, 2, 2), 4, tau=0.05, dtype=dtype)
    with torch.no_grad():
        for k, g in enumerate(tt.gates):
            g.copy_(torch.randn(g.shape[0], dtype=dtype))
            g[0] = 0.05  # at tau: masked
            g[1] = -0.5
            tt.bond_alive()[k][2] = False  # dead, its gate not yet zeroed
    cores, gates, alive = tt.parts()
    hand = [c * (g * (a & (g.detach().abs() > tt.tau)).to(dtype))
            for c, g, a in zip(cores, gates, alive)] + [cores[-1]]
    got = tt.gated_cores()
    assert all(torch.equal(a, b) for a, b in zip(got, hand))
    w = [torch.randn_like(c) for c in got]
    g_got = torch.autograd.grad(sum((c * v).sum() for c, v in zip(got, w)), [*cores, tt.gate])
    g_hand = torch.autograd.grad(sum((c * v).sum() for c, v in zip(hand, w)),
                                 [*cores, tt.gate])
    assert all(torch.equal(a, b) for a, b in zip(g_got, g_hand))
    for dg in g_got[-1].split(tt.bond_ranks):  # each bond's part of the one gate tensor
        assert float(dg[0]) == 0.0 and float(dg[2]) == 0.0 and float(dg[1]) != 0.0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("d", [2, 3])
def test_gates_absorbed_inside_match_pre_gated_cores(path: str, d: int, native_impl: str
                                                     ) -> None:
    """Passing gates, alive vectors and tau to ``tt_linear`` (absorbed inside the halves
    and sweep Functions, input-half bonds on the right of their core, output-half bonds on
    the left of the next) is the same function, with the same gradients for x, bias,
    cores and gates, as gating the cores first with plain autograd; entries that are dead
    or at/below tau get exactly zero gradient."""
    torch.manual_seed(3)
    ins, outs = ([4, 3], [2, 5]) if d == 2 else ([2, 3, 2], [3, 2, 2])
    N, M = math.prod(ins), math.prod(outs)
    cores = [c.detach().clone().requires_grad_()
             for c in TTLinearCores(ins, outs, 3, dtype=DT).cores]
    tau = 0.05
    gates = []
    for c in cores[:-1]:
        g = torch.randn(c.shape[-1], dtype=DT).abs() + 0.1
        g[0] *= -1
        if c.shape[-1] > 2:
            g[2] = 0.5 * tau  # below the threshold: masked by tau, not by alive
        gates.append(g.requires_grad_())
    alive = [torch.tensor([True, False, True][: c.shape[-1]]) for c in cores[:-1]]
    masks = [a & (g.detach().abs() > tau) for a, g in zip(alive, gates)]
    assert all(torch.equal(m, r) for m, r in zip(gate_masks(gates, tau, alive), masks))
    x = torch.randn(7, N, dtype=DT, requires_grad=True)
    b = torch.randn(M, dtype=DT, requires_grad=True)
    args = (x, b, *cores, *gates)

    def fused(x_, b_, *t):  # noqa: ANN001, ANN202
        return tt_linear(x_, t[: 2 * d], d, path, bias=b_, gates=t[2 * d :], tau=tau,
                         alive=alive)

    def reference(x_, b_, *t):  # noqa: ANN001, ANN202
        gated = [c * (g * m.to(DT)) for c, g, m in zip(t[: 2 * d - 1], t[2 * d :], masks)]
        return x_ @ _tensorly_dense([*gated, t[2 * d - 1]]).reshape(N, M) + b_

    y, y_ref = fused(*args), reference(*args)
    assert torch.allclose(y, y_ref, atol=1e-12)
    gy = torch.randn_like(y)
    got = torch.autograd.grad((y * gy).sum(), args)
    ref = torch.autograd.grad((y_ref * gy).sum(), args)
    for a, r in zip(got, ref):
        assert torch.allclose(a, r, atol=1e-11)
    for g, m in zip(got[2 + 2 * d :], masks):
        assert torch.all(g[~m] == 0) and torch.all(g[m] != 0)
    assert torch.autograd.gradcheck(fused, args)


def test_halves_saves_only_input_xl_and_merges(native_impl: str) -> None:
    ins, outs, r = [4, 4, 4], [4, 4, 4], 6
    tt = TTLinearCores(ins, outs, r, dtype=DT)
    B = 150  # differs from N = 64, so only batch-sized tensors have B rows; >= 128: padded
    x = torch.randn(B, 64, dtype=DT, requires_grad=True)
    cores = [c.detach().clone().requires_grad_() for c in tt.cores]
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = TTLinearHalves.apply(x, 3, None, *cores)
    rd = cores[2].shape[-1]
    rd_padded = max(16, -(-rd // 8) * 8)  # X·L is kept at the aligned middle rank
    batch_sized = [t for t in saved if t.dim() == 2 and t.shape[0] == B]
    # exactly two batch-sized tensors are kept: the input and X·L (not Y, not dY paths)
    assert sorted(t.shape[1] for t in batch_sized) == sorted([64, rd_padded])
    core_numel = sum(c.numel() for c in cores)
    assert sum(t.numel() for t in saved) <= B * 64 + B * rd_padded + 3 * core_numel + 4 * 64 * rd
    y.sum().backward()
    assert x.grad is not None and all(c.grad is not None for c in cores)


def test_planner_choices_and_explain() -> None:
    ins, outs = (12, 8, 8), (8, 8, 12)
    r30 = [1, 12, 30, 30, 30, 12, 1]
    e = explain(4096, ins, outs, r30)
    assert e["path"] == "halves"
    h = e["paths"]["halves"]
    assert h["macs_fwd"] < e["dense_linear_macs_fwd"] / 8
    assert {"macs_fwd", "macs_bwd", "bytes_fwd", "bytes_bwd", "seconds"} <= set(h)
    # a single row with large ranks: sweeping cores beats merging halves
    assert plan(1, ins, outs, [1, 12, 96, 96, 96, 12, 1]) == "sweep"
    # near full middle rank with a large batch: one dense GEMM is cheapest
    big = [1, 12, 96, 768, 96, 12, 1]
    assert plan(8192, ins, outs, big) == "dense"
    # the choice is cached
    before = plan.__wrapped__ if hasattr(plan, "__wrapped__") else None
    assert before is None
    from comera_engine.tensor.planner import _plan_cached

    hits = _plan_cached.cache_info().hits
    plan(4096, ins, outs, r30)
    assert _plan_cached.cache_info().hits == hits + 1


# ------------------------------------------------------------------ gates and truncation
def test_gate_at_threshold_acts_as_removed_rank() -> None:
    torch.manual_seed(0)
    tt = TTLinearCores([3, 4], [4, 3], [3, 5, 3], tau=1e-2, dtype=DT)
    k, j = 1, 2
    with torch.no_grad():
        tt.gates[k][j] = 1e-2  # exactly at tau: pruned
    removed = TTLinearCores([3, 4], [4, 3], [3, 4, 3], dtype=DT)
    keep = [i for i in range(5) if i != j]
    with torch.no_grad():
        for i, c in enumerate(tt.cores):
            src = c
            if i == k:
                src = src[..., keep] * tt.gates[k][keep]
            if i == k + 1:
                src = src[keep]
            if i == 0:
                src = src * tt.gates[0]
            if i == 2:
                src = src * tt.gates[2]
            removed.cores[i].copy_(src)
    assert torch.equal(tt.to_matrix(), removed.to_matrix()) or torch.allclose(
        tt.to_matrix(), removed.to_matrix(), rtol=0, atol=1e-14)
    assert tt.effective_ranks() == [3, 4, 3]
    # no gradient to the dead gate entry nor to the core slices it controls
    x = torch.randn(7, 12, dtype=DT)
    tt_linear(x, tt.gated_cores(), 2).pow(2).sum().backward()
    assert tt.gate.grad.split(tt.bond_ranks)[k][j] == 0
    assert torch.all(tt.cores[k].grad[..., j] == 0)
    assert torch.all(tt.cores[k + 1].grad[j] == 0)


def test_truncate_keeps_outputs_and_counts() -> None:
    torch.manual_seed(1)
    tt = TTLinearCores([4, 3, 2], [2, 3, 4], 6, dtype=DT)
    with torch.no_grad():
        tt.gates[1][[0, 3]] = 0.0
        tt.gates[2][1] = -0.005  # |g| <= tau
        tt.gates[3][2:] = 1e-3
    W = tt.to_matrix().detach()
    eff = tt.num_params(effective=True)
    assert tt.num_params(effective=False) > eff
    changes = tt.truncate_()
    assert {c.bond for c in changes} == {1, 2, 3}
    assert (tt.to_matrix() - W).abs().max() <= 1e-12
    assert tt.num_params(effective=False) == eff == tt.num_params(effective=True)
    s = tt.mode_sizes
    R = [1, *tt.effective_ranks(), 1]
    assert eff == sum(s[k] * R[k] * R[k + 1] for k in range(len(s)))


def test_refresh_makes_pruning_permanent() -> None:
    tt = TTLinearCores([2, 2], [2, 2], 3, dtype=DT)
    with torch.no_grad():
        tt.gates[1][0] = 0.001
    ch = tt.refresh_()
    assert [(c.bond, c.old, c.new) for c in ch] == [(1, 3, 2)]
    with torch.no_grad():
        tt.gates[1][0] = 0.5  # an optimizer pushing it back cannot revive it
    assert tt.effective_ranks()[1] == 2


# ------------------------------------------------------------------ bad input
def test_bad_input_names_the_argument() -> None:
    with pytest.raises(ValueError, match="^rank"):
        TTLinearCores([2, 2], [2, 2], 0)
    with pytest.raises(ValueError, match="^rank"):
        TTLinearCores([2, 2], [2, 2], [2, -1, 2])
    with pytest.raises(ValueError, match="^rank.*maximal TT rank"):
        TTLinearCores([2, 2], [2, 2], [2, 5, 2])
    with pytest.raises(ValueError, match="^out_factors"):
        TTLinearCores([2, 2], [2, 2, 2], 2)
    tt = TTLinearCores([2, 2], [2, 2], 2, dtype=DT)
    with pytest.raises(ValueError, match="^x:"):
        tt_linear(torch.randn(3, 5, dtype=DT), tt.gated_cores(), 2)
    with pytest.raises(ValueError, match="^cores:"):
        tt_linear(torch.randn(3, 4, dtype=DT), tt.gated_cores()[:3], 2)
    with pytest.raises(ValueError, match="^path:"):
        tt_linear(torch.randn(3, 4, dtype=DT), tt.gated_cores(), 2, "bogus")
    with pytest.raises(ValueError, match="^W:"):
        TTLinearCores.from_matrix(torch.randn(5, 4), [2, 2], [2, 2])


def test_rank_zero_bond_is_the_zero_map() -> None:
    from comera_engine import TTEmbedding, TTLinear

    lin = TTLinear(16, 16, rank=3, dtype=DT)
    emb = TTEmbedding(64, 8, rank=3, dtype=DT)
    with torch.no_grad():
        lin.tt.gates[1].zero_()
        emb.tt.gates[0].zero_()
    lin.tt.truncate_()
    emb.tt.truncate_()
    assert lin.effective_ranks()[1] == 0 and lin.num_params() == 16  # bias only
    x = torch.randn(4, 16, dtype=DT)
    assert torch.equal(lin(x), lin.bias.expand(4, 16))
    assert torch.equal(lin.dense_weight(), torch.zeros(16, 16, dtype=DT))
    assert torch.equal(emb(torch.tensor([1, 5])), torch.zeros(2, 8, dtype=DT))


# ------------------------------------------------------------------ GEMM ways, sweep
def _use(monkeypatch, backend) -> None:  # noqa: ANN001
    """Route the ops' hook to ``backend`` (a CPUBackend) for this test."""
    from comera_engine import backends

    monkeypatch.setattr(backends, "cpu_backend", lambda x=None, like=None: backend)


@pytest.mark.parametrize("ways", ["gemms", "blocked"])
def test_halves_layer_same_under_every_gemm_way(monkeypatch, cpu_backend, ways: str) -> None:
    """The padded halves step (bias inside, 1024 rows: the size that takes the install's
    ways) gives the float64 layer's output and gradients whichever way runs each batch
    GEMM: all way 0, all way 1 (oneDNN / (bᵀ·a)ᵀ), the whole step row-blocked."""
    from comera_engine import TTLinear
    from comera_engine.backends.cpu import CPUBackend
    from comera_engine.backends.cpu.gemm import ROLES, Ways, onednn_linear

    torch.manual_seed(0)
    lin = TTLinear(96, 64, rank=10, in_factors=[4, 4, 6], out_factors=[4, 4, 4],
                   path="halves")
    ref = TTLinear(96, 64, rank=10, in_factors=[4, 4, 6], out_factors=[4, 4, 4],
                   path="halves", dtype=DT)
    ref.load_state_dict({k: v.double() for k, v in lin.state_dict().items()})
    x = torch.randn(1024, 96)
    gy = torch.randn(1024, 64)
    xr = x.double().requires_grad_()
    yr = ref(xr)
    (yr * gy.double()).sum().backward()
    products = [r for r, k in ROLES.items() if k != "step"
                and (k == "tn" or onednn_linear() is not None)]
    choices = ([{}, dict.fromkeys(products, 1)] if ways == "gemms"
               else [{"halves-fwd": 1, "halves-bwd": 1}])
    for chosen in choices:
        _use(monkeypatch, CPUBackend(cpu_backend.ops, Ways(chosen), cpu_backend.folder))
        lin.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = lin(xi)
        (y * gy).sum().backward()
        assert torch.allclose(y.double(), yr, rtol=1e-4, atol=1e-5)
        assert torch.allclose(xi.grad.double(), xr.grad, rtol=1e-4, atol=1e-5)
        for p, pr in zip(lin.parameters(), ref.parameters()):
            assert torch.allclose(p.grad.double(), pr.grad, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("B", [1, 5])  # 1: plain sweep; 5: outermost cores merged first
def test_sweep_saves_no_merged_half_and_no_output(B: int, native_impl: str) -> None:
    """The sweep Function keeps ``Xᵀ`` and the batch × rank intermediates (plus the merged
    outer cores), never ``L``, ``R`` or ``Y``; values and gradients, gates and bias
    included, match the float64 dense product."""
    from comera_engine.ops.tt_linear_sweep import sweep_merges as _sweep_merges

    ins, outs, r = [4, 4, 4], [4, 4, 4], 6
    tt = TTLinearCores(ins, outs, r, dtype=DT)
    assert _sweep_merges(B, ins, outs, tt.ranks) == ((True, True) if B == 5 else (False, False))
    cores = [c.detach().clone().requires_grad_() for c in tt.cores]
    x = torch.randn(B, 64, dtype=DT, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = TTLinearSweep.apply(x, 3, None, *cores)
    # a core, or a view of one (same storage: no memory of its own)
    ptrs = {c.untyped_storage().data_ptr() for c in cores}
    non_core = [t for t in saved if t.untyped_storage().data_ptr() not in ptrs]
    assert not any(t is y for t in saved)
    assert max(t.numel() for t in non_core) <= max(B * 64, 16 * r)  # Xᵀ or a merged core
    assert sum(t.numel() for t in non_core) <= B * 64 + 2 * B * 16 * r + 2 * B * r + 32 * r
    W = _tensorly_dense([c.detach() for c in cores]).reshape(64, 64)
    assert torch.allclose(y, x.detach() @ W, atol=1e-12)
    gy = torch.randn_like(y)
    got = torch.autograd.grad((y * gy).sum(), [x, *cores])
    xr = x.detach().clone().requires_grad_()
    cr = [c.detach().clone().requires_grad_() for c in cores]
    yr = xr @ _tensorly_dense(cr).reshape(64, 64)
    ref = torch.autograd.grad((yr * gy).sum(), [xr, *cr])
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-11)
    gates = [torch.rand(c.shape[-1], dtype=DT, requires_grad=True) + 0.5 for c in cores[:-1]]
    gates = [g.detach().requires_grad_() for g in gates]
    alive = [torch.arange(g.shape[0]) != 1 for g in gates]
    bias = torch.randn(64, dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x_, b_, *t: TTLinearSweep.apply(x_, 3, b_, *t[:6], *t[6:], *alive, 0.0),
        (x, bias, *cores, *gates))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("fn", "ins", "outs", "B"), [
    (TTLinearSweep, [6], [5], 3),                 # d = 1
    (TTLinearSweep, [4, 3], [2, 5], 2),           # d = 2, no merges
    (TTLinearSweep, [4, 3], [2, 5], 40),          # d = 2, outer pairs merged
    (TTLinearSweep, [2, 3, 2], [3, 2, 2], 7),     # d = 3
    (TTLinearSweep, [4, 3], [2, 5], 11000),       # X, dX over 2^17 entries: ATen transposes
    (TTLinearHalves, [6], [5], 3),                # d = 1
    (TTLinearHalves, [4, 3], [2, 5], 7),          # d = 2, middle rank not padded
    (TTLinearHalves, [4, 3], [2, 5], 130),        # d = 2, padded, the bias in R
    (TTLinearHalves, [2, 3, 2], [3, 2, 2], 150),  # d = 3, padded
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_native_ops_match_the_pytorch_functions(fn, ins, outs, B, dtype, monkeypatch,
                                                cpu_backend) -> None:
    """The C++ sweep, and the halves Function with its merges and gates in C++, compute
    what the PyTorch Functions do: outputs and every gradient (x, bias, cores, gates;
    dead and tau-masked gate entries get zero), with and without gates and bias, with x
    or only some cores needing gradients, or only x."""
    torch.manual_seed(5)
    d = len(ins)
    N, M = math.prod(ins), math.prod(outs)
    base = [c.detach().to(dtype) for c in TTLinearCores(ins, outs, 4, dtype=DT).cores]
    tau = 0.05
    gates0 = [torch.randn(c.shape[-1], dtype=dtype).abs() + 0.1 for c in base[:-1]]
    for g in gates0:
        g[-1] = 0.5 * tau  # masked by tau
    alive = [torch.arange(g.shape[0]) != 0 for g in gates0]  # entry 0 dead
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == DT else dict(rtol=1e-4, atol=1e-5)
    for gated, with_bias, need_x, core_req in [(True, True, True, None),
                                               (False, True, True, None),
                                               (True, False, False, None),
                                               (True, True, True, [1, 2 * d - 1]),
                                               (True, True, True, [])]:
        runs = []
        for impl in ("native", "pytorch"):
            monkeypatch.setenv("COMERA_NATIVE", "1" if impl == "native" else "0")
            cores = [c.clone().requires_grad_(core_req is None or k in core_req)
                     for k, c in enumerate(base)]
            gates = ([g.clone().requires_grad_(core_req != []) for g in gates0]
                     if gated else [])
            x = torch.randn(B, N, dtype=dtype, generator=torch.Generator().manual_seed(1))
            x.requires_grad_(need_x)
            b = (torch.randn(M, dtype=dtype, generator=torch.Generator().manual_seed(3))
                 .requires_grad_() if with_bias else None)
            extra = (*gates, *alive, tau) if gated else ()
            y = fn.apply(x, d, b, *cores, *extra)
            assert (y.grad_fn.backend is not None) == (impl == "native")
            wrt = [t for t in (x, b, *cores, *gates) if t is not None and t.requires_grad]
            gy = torch.randn(y.shape, dtype=dtype, generator=torch.Generator().manual_seed(2))
            runs.append((y.detach(), torch.autograd.grad((y * gy).sum(), wrt)))
        (y_n, g_n), (y_p, g_p) = runs
        assert torch.allclose(y_n, y_p, **tol)
        assert len(g_n) == len(g_p)
        for a, r in zip(g_n, g_p):
            assert torch.allclose(a, r, **tol)
        if gated and core_req != []:
            for g in g_n[-len(gates0):]:
                assert g[0] == 0 and g[-1] == 0  # dead, and at/below tau


def test_native_ops_can_be_switched_off(monkeypatch) -> None:
    """``COMERA_NATIVE=0`` keeps every call on the PyTorch Function (and builds nothing)."""
    from comera_engine import backends

    monkeypatch.setenv("COMERA_NATIVE", "0")
    assert not backends.enabled() and backends.cpu_backend() is None
    cores = list(TTLinearCores([4, 3], [2, 5], 3, dtype=DT).cores)
    y = TTLinearSweep.apply(torch.randn(2, 12, dtype=DT), 2, None, *cores)
    assert y.grad_fn.backend is None


def test_planner_sweeps_small_batches_with_large_ranks() -> None:
    """At 32 rows and rank 64 (768×768) merging the halves costs more than the batch work,
    so the planner sweeps; at 4096 rows it merges."""
    ins, outs = (12, 8, 8), (8, 8, 12)
    r64 = [1, 12, 64, 64, 64, 12, 1]
    e = explain(32, ins, outs, r64)
    assert e["path"] == "sweep"
    assert e["paths"]["sweep"]["macs_fwd"] < e["paths"]["halves"]["macs_fwd"]
    assert plan(4096, ins, outs, r64) == "halves"


# ------------------------------------------------------------------ row-blocked batch step
@pytest.mark.parametrize("blas", ["direct", "aten"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("B", "block"), [(1100, 512), (1024, 256), (700, 1024), (37, 8)])
def test_native_blocked_batch_step_matches_float64(B: int, block: int, threads: int,
                                                   blas: str, cpu_backend) -> None:
    """The row-blocked batch GEMMs of the halves step (C++) are the float64 products:
    forward with and without the ones column, backward with every combination of
    gradients asked for, blocks that do not divide the batch, one and two threads
    (per-thread partial sums), BLAS called directly and through ATen (the fallback)."""
    mod = cpu_backend.ops
    if blas == "direct" and not mod.halves_batch_blas(-1):
        pytest.skip("this torch build links no sgemm_: the ATen path is the only one")
    mod.halves_batch_blas(int(blas == "direct"))
    g = torch.Generator().manual_seed(B)
    N, M, rp = 96, 80, 16
    x, dy = torch.randn(B, N, generator=g), torch.randn(B, M, generator=g)
    Lp, Rp = torch.randn(N, rp, generator=g), torch.randn(rp, M, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for ones_col in (-1, 5):
            y, XL = mod.halves_batch_forward(x, Lp, Rp, ones_col, block)
            XLr = x.double() @ Lp.double()
            if ones_col >= 0:
                XLr[:, ones_col] = 1.0
            assert torch.allclose(XL.double(), XLr, rtol=1e-5, atol=1e-4)
            assert torch.allclose(y.double(), XLr @ Rp.double(), rtol=1e-5, atol=1e-3)
        dXLr = dy.double() @ Rp.double().t()
        for need_x, need_w in ((True, True), (True, False), (False, True)):
            dx, dL, dR, dXL = mod.halves_batch_backward(dy, x, XL, Lp, Rp, need_x, need_w,
                                                        block)
            assert torch.allclose(dXL.double(), dXLr, rtol=1e-5, atol=1e-4)
            if need_x:
                assert torch.allclose(dx.double(), dXLr @ Lp.double().t(), rtol=1e-5, atol=1e-3)
            else:
                assert dx is None
            if need_w:
                assert dL.shape == (N, rp) and dR.shape == (rp, M)
                assert torch.allclose(dL.double(), x.double().t() @ dXLr, rtol=1e-4, atol=1e-2)
                assert torch.allclose(dR.double(), XL.double().t() @ dy.double(),
                                      rtol=1e-4, atol=1e-2)
            else:
                assert dL is None and dR is None
    finally:
        torch.set_num_threads(before)
        mod.halves_batch_blas(1)


@pytest.mark.parametrize("way", [0, 1])
def test_halves_layer_blocked_and_plain_batch_steps_match_float64(monkeypatch, cpu_backend,
                                                                   way: int) -> None:
    """The layer with its batch GEMMs one by one (way 0) or row-blocked in C++ (way 1):
    outputs and every gradient as the float64 layer's, gates and bias included, and with
    only x or only the parameters needing gradients."""
    from comera_engine import TTLinear
    from comera_engine.backends.cpu import CPUBackend
    from comera_engine.backends.cpu.gemm import Ways

    picked: list[str] = []

    class Recording(Ways):
        def blocked(self, role: str, x: torch.Tensor) -> bool:
            picked.append(role)
            return super().blocked(role, x)

    ways = Recording({"halves-fwd": way, "halves-bwd": way})
    _use(monkeypatch, CPUBackend(cpu_backend.ops, ways, cpu_backend.folder))
    torch.manual_seed(0)
    kw = dict(rank=10, in_factors=[4, 4, 6], out_factors=[4, 4, 4], path="halves")
    lin = TTLinear(96, 64, **kw)
    ref = TTLinear(96, 64, **kw, dtype=DT)
    ref.load_state_dict({k: v.double() for k, v in lin.state_dict().items()})
    with torch.no_grad():  # some gates below tau and one dead entry
        for gate in lin.tt.gates[:2]:
            gate[0] = 0.5 * lin.tt.tau
        for gate in ref.tt.gates[:2]:
            gate[0] = 0.5 * ref.tt.tau
    x, gy = torch.randn(1030, 96), torch.randn(1030, 64)
    xr = x.double().requires_grad_()
    (ref(xr) * gy.double()).sum().backward()
    for x_grad, w_grad in ((True, True), (True, False), (False, True)):
        lin.zero_grad(set_to_none=True)
        for p in lin.parameters():
            p.requires_grad_(w_grad)
        xi = x.clone().requires_grad_(x_grad)
        y = lin(xi)
        (y * gy).sum().backward()
        assert torch.allclose(y.double(), ref(xr).detach(), rtol=1e-4, atol=1e-4)
        if x_grad:
            assert torch.allclose(xi.grad.double(), xr.grad, rtol=1e-4, atol=1e-4)
        if w_grad:
            for p, pr in zip(lin.parameters(), ref.parameters()):
                assert torch.allclose(p.grad.double(), pr.grad, rtol=1e-3, atol=1e-3)
    assert "halves-fwd" in picked and "halves-bwd" in picked


def test_planner_cost_model_per_device_kind(monkeypatch) -> None:
    """The planner's cost model comes from a table by device kind: the CPU model for CPU
    tensors, CUDA by compute capability, the generic CUDA model where the capability
    is not listed or cannot be read; explain() names the model it used."""
    from comera_engine.tensor import planner

    assert explain(64, [4, 4], [4, 4], [1, 3, 3, 3, 1])["device_model"] == "cpu"
    assert planner.device_model("cpu")[0] is planner.DEVICE_MODELS["cpu"]
    planner._cuda_major.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    assert planner.device_model("cuda")[0].name == "cuda-sm9"
    planner._cuda_major.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (12, 0))
    assert planner.device_model("cuda")[0].name == "cuda"
    planner._cuda_major.cache_clear()

    def no_cuda(dev=None):  # noqa: ANN001, ANN202
        raise RuntimeError("no CUDA")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_cuda)
    assert planner.device_model("cuda:0")[0].name == "cuda"
    planner._cuda_major.cache_clear()
    rates = {m.mac_rate for m in planner.DEVICE_MODELS.values()}
    assert len(rates) > 2  # not one hard-coded GPU rate


def test_a_train_built_on_the_meta_device_draws_nothing_and_a_real_one_is_as_seeded() -> None:
    """The run plan, the preview and an export's skeleton build their model on the meta
    device: its cores are drawn from nothing there (torch's meta randn would import sympy
    and Dynamo, a second or more of ``comera launch``); on a real device the cores are
    :func:`scaled_isometry` draws at the entry scale ``std``, from the seed."""
    from comera_engine.tensor.tt import TensorTrain, scaled_isometry
    from tests.run_checks import heavy_imports

    assert heavy_imports("import torch\n"
                         "from comera_engine.tensor.tt import TensorTrain\n"
                         "with torch.device('meta'):\n"
                         "    t = TensorTrain([(4, 8), (8, 4)], rank=3)\n"
                         "assert all(c.is_meta for c in t.cores), [c.device for c in t.cores]"
                         ) == []
    torch.manual_seed(3)
    t = TensorTrain([(4, 8), (8, 4)], rank=3)
    torch.manual_seed(3)
    want = [scaled_isometry((1, 4, 8, 3), t.init_std), scaled_isometry((3, 8, 4, 1), t.init_std)]
    assert all(torch.equal(c, w) for c, w in zip(t.cores, want))
