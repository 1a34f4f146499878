"""Shared by tests/test_op_*.py: one TT-linear op against its plain PyTorch reference."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from comera_engine.tensor import TTLinearCores

DT = torch.float64


def tt_case(ins: list[int], outs: list[int], rank: int, B: int, gated: bool, bias: bool,
            dtype: torch.dtype = DT) -> tuple:
    """``(x, cores, bias, gates, alive, tau)`` for a TT-linear op: random cores of rank
    ``rank``, gates with entry 0 dead and the last entry at/below ``tau`` on every bond."""
    g = torch.Generator().manual_seed(B + 7 * rank)
    cores = [c.detach().to(dtype).requires_grad_()
             for c in TTLinearCores(ins, outs, rank, dtype=DT).cores]
    N, M = math.prod(ins), math.prod(outs)
    x = torch.randn(B, N, dtype=dtype, generator=g).requires_grad_()
    b = torch.randn(M, dtype=dtype, generator=g).requires_grad_() if bias else None
    tau = 0.05
    gates, alive = [], []
    if gated:
        for c in cores[:-1]:
            v = torch.rand(c.shape[-1], dtype=dtype, generator=g) + 0.1
            v[-1] = 0.5 * tau
            gates.append(v.requires_grad_())
            alive.append(torch.arange(v.shape[0]) != 0)
    return x, cores, b, gates, alive, tau


def check_against_reference(op: Callable, ref: Callable, ins: list[int], outs: list[int],
                            rank: int, B: int, gated: bool, bias: bool) -> None:
    """``op`` and ``ref`` (same signature: ``x, cores, d, bias, gates, tau, alive``) give
    the same float64 output and gradients for x, bias, cores and gates; dead and
    tau-masked gate entries get exactly zero gradient."""
    d = len(ins)
    x, cores, b, gates, alive, tau = tt_case(ins, outs, rank, B, gated, bias)
    wrt = [t for t in (x, b, *cores, *gates) if t is not None]
    gy = torch.randn(B, math.prod(outs), dtype=DT, generator=torch.Generator().manual_seed(1))
    got, want = [], []
    for fn, out in ((op, got), (ref, want)):
        y = fn(x, cores, d, b, gates, tau, alive)
        out.append(y.detach())
        out.extend(torch.autograd.grad((y * gy).sum(), wrt))
    for a, r in zip(got, want):
        assert a.shape == r.shape
        assert torch.allclose(a, r, rtol=1e-10, atol=1e-12)
    for gg in got[len(got) - len(gates):] if gates else ():
        assert gg[0] == 0 and gg[-1] == 0  # dead, and at/below tau


def gradcheck_op(op: Callable, ins: list[int], outs: list[int], rank: int, B: int) -> None:
    """``torch.autograd.gradcheck`` of ``op`` in x, bias, cores and live gates."""
    d = len(ins)
    x, cores, b, gates, alive, tau = tt_case(ins, outs, rank, B, True, True)
    n_c = len(cores)

    def f(*t: torch.Tensor) -> torch.Tensor:
        return op(t[0], list(t[2 : 2 + n_c]), d, t[1], list(t[2 + n_c :]), tau, alive)

    assert torch.autograd.gradcheck(f, (x, b, *cores, *gates))


CASES = [
    ([6], [5], 3, 3),                 # d = 1
    ([4, 3], [2, 5], 4, 7),           # d = 2, odd batch
    ([4, 3], [2, 5], 4, 130),         # d = 2, from 128 rows (halves: padded, bias in R)
    ([2, 3, 2], [3, 2, 2], 3, 40),    # d = 3
    ([5, 1, 3], [1, 7, 2], 2, 1),     # unit factors, one row
]


def op_tests(op: Callable, ref: Callable) -> tuple[Callable, Callable]:
    """A test module's two tests of TT-linear ``op`` against ``ref`` (see
    :func:`check_against_reference`, :func:`gradcheck_op`), each on the pure PyTorch
    path and through the CPU backend (the ``op_impl`` fixture):
    ``test_matches_reference_float64, test_gradcheck = op_tests(op, ref)``."""
    import pytest

    @pytest.mark.parametrize(("ins", "outs", "rank", "B"), CASES)
    @pytest.mark.parametrize(("gated", "bias"), [(True, True), (False, True), (True, False)])
    def test_matches_reference_float64(op_impl: str, ins: list[int], outs: list[int],
                                       rank: int, B: int, gated: bool, bias: bool) -> None:
        check_against_reference(op, ref, ins, outs, rank, B, gated, bias)

    @pytest.mark.parametrize(("ins", "outs", "B"), [([3, 2], [2, 3], 5),
                                                    ([2, 2, 2], [2, 3, 1], 3)])
    def test_gradcheck(op_impl: str, ins: list[int], outs: list[int], B: int) -> None:
        gradcheck_op(op, ins, outs, 2, B)

    return test_matches_reference_float64, test_gradcheck
