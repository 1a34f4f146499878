"""The TT-linear halves op (comera_engine/ops/tt_linear_halves.py) and the reconstructed
one beside it (``W = L·R``, one GEMM) against the plain PyTorch reference: float64
outputs and gradients, gradcheck, gates with dead entries, odd shapes; on the pure
PyTorch path and, where it is built, through the CPU backend (tests/op_checks.py). Every
TT-linear Function also takes all bonds' gates as one vector (what a layer passes): the
same values and gradients as per bond."""

import math

import pytest
import torch

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
