"""The TT-linear halves op (comera_engine/ops/tt_linear_halves.py) and the reconstructed
one beside it (``W = L·R``, one GEMM) against the plain PyTorch reference: float64
outputs and gradients, gradcheck, gates with dead entries, odd shapes; on the pure
PyTorch path and, where it is built, through the CPU backend (tests/op_checks.py). Every
TT-linear Function also takes all bonds' gates as one vector (what a layer passes): the
same values and gradients as per bond."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from comera_engine.ops.tt_linear_halves import (
    tt_linear_halves,
    tt_linear_halves_reference,
    tt_linear_reconstructed,
)
from comera_engine.ops.tt_linear_sweep import tt_linear_sweep
from tests.op_checks import CASES, DT, op_tests, tt_case

test_matches_reference_float64, test_gradcheck = op_tests(tt_linear_halves,
                                                          tt_linear_halves_reference)
test_reconstructed_matches_reference_float64, test_reconstructed_gradcheck = op_tests(
    tt_linear_reconstructed, tt_linear_halves_reference)


@pytest.mark.parametrize("op", [tt_linear_halves, tt_linear_sweep, tt_linear_reconstructed])
@pytest.mark.parametrize(("ins", "outs", "rank", "B"), CASES[1:4])
def test_one_gate_vector_equals_the_gates_per_bond(op_impl: str, op, ins: list[int],
                                                   outs: list[int], rank: int, B: int) -> None:
    """The gates as one vector (and ``alive`` as one) give bit for bit the values and
    gradients of the same gates passed per bond; the one vector's gradient is the
    per-bond gradients end to end, zero on dead and below-``tau`` entries."""
    d = len(ins)
    x, cores, b, gates, alive, tau = tt_case(ins, outs, rank, B, True, True)
    flat = torch.cat([g.detach() for g in gates]).requires_grad_()
    gy = torch.randn(B, math.prod(outs), dtype=DT, generator=torch.Generator().manual_seed(2))
    y1 = op(x, cores, d, b, gates, tau, alive)
    g1 = torch.autograd.grad((y1 * gy).sum(), [x, b, *cores, *gates])
    y2 = op(x, cores, d, b, flat, tau, torch.cat(alive))
    g2 = torch.autograd.grad((y2 * gy).sum(), [x, b, *cores, flat])
    assert torch.equal(y1, y2)
    for a, c in zip(g1[: 2 + 2 * d], g2[: 2 + 2 * d]):
        assert torch.equal(a, c)
    assert torch.equal(torch.cat(g1[2 + 2 * d :]), g2[-1])
    assert not bool(g2[-1][torch.cat(alive).logical_not()].any())
    with pytest.raises(ValueError, match="alive"):
        op(x, cores, d, b, flat, tau, torch.cat(alive)[1:])


class _Casts(TorchDispatchMode):
    """Counts the dtype casts (``_to_copy``) that reach the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.n += func._schema.name == "aten::_to_copy"
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op", [tt_linear_halves, tt_linear_sweep, tt_linear_reconstructed])
def test_bf16_autocast_matches_float64_and_casts_the_cores_once(op_impl: str, op) -> None:
    """Under bf16 autocast (a GPU step's precision; CPU here) every TT-linear Function's
    output and gradients (x, bias, cores, gates) stay within bf16 error of the float64
    reference, the masked gate entries get exactly zero, every gradient keeps its
    parameter's dtype; and the gated cores are cast to bf16 once a layer, not before
    each product: a train of six cores casts no more often than one of four."""
    torch.manual_seed(0)  # the cores' draw (bf16 error varies with it: 1-3 % here)
    casts = []
    for ins, outs in (([4, 6], [6, 4]), ([3, 4, 2], [2, 4, 3])):  # every bond of rank >= 3
        d = len(ins)
        x, cores, b, gates, alive, tau = tt_case(ins, outs, 5, 160, True, True, torch.float32)
        wrt = [x, b, *cores, *gates]
        gy = torch.randn(160, math.prod(outs), generator=torch.Generator().manual_seed(3))
        counter = _Casts()
        with counter:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = op(x, cores, d, b, gates, tau, alive)
            got = torch.autograd.grad((y.float() * gy).sum(), wrt)
        casts.append(counter.n)
        assert y.dtype == torch.bfloat16
        ref_in = [t.detach().double().requires_grad_() for t in wrt]
        xr, br, cr, gr = ref_in[0], ref_in[1], ref_in[2 : 2 + 2 * d], ref_in[2 + 2 * d :]
        yr = tt_linear_halves_reference(xr, cr, d, br, gr, tau, alive)
        want = torch.autograd.grad((yr * gy.double()).sum(), ref_in)
        assert float((y.double() - yr).detach().norm() / yr.detach().norm()) < 2e-2
        for g, w, t in zip(got, want, wrt):
            assert g.dtype == t.dtype
            assert float((g.double() - w).norm() / w.norm()) < 3e-2, op.__name__
        for g, a, v in zip(got[2 + 2 * d :], alive, gates):
            dead = ~a | (v.detach().abs() <= tau)
            assert not bool(g[dead].any())
    assert casts[1] <= casts[0], casts
