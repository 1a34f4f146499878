"""The TT-linear sweep op (comera_engine/ops/tt_linear_sweep.py) against its plain PyTorch
reference: float64 outputs and gradients, gradcheck, gates with dead entries, odd
shapes; on the pure PyTorch path and, where it is built, through the CPU backend."""

from __future__ import annotations

import pytest
from op_checks import check_against_reference, gradcheck_op

from comera_engine.ops.tt_linear_sweep import tt_linear_sweep, tt_linear_sweep_reference


@pytest.fixture(params=["pytorch", "backend"])
def impl(request, monkeypatch) -> str:  # noqa: ANN001
    if request.param == "pytorch":
        monkeypatch.setenv("COMERA_NATIVE", "0")
    else:
        request.getfixturevalue("cpu_backend")
    return request.param


@pytest.mark.parametrize(("ins", "outs", "rank", "B"), [
    ([6], [5], 3, 3),                 # d = 1
    ([4, 3], [2, 5], 4, 7),           # d = 2, odd batch
    ([4, 3], [2, 5], 4, 130),         # d = 2, from 128 rows (halves: padded, bias in R)
    ([2, 3, 2], [3, 2, 2], 3, 40),    # d = 3
    ([5, 1, 3], [1, 7, 2], 2, 1),     # unit factors, one row
])
@pytest.mark.parametrize(("gated", "bias"), [(True, True), (False, True), (True, False)])
def test_matches_reference_float64(impl: str, ins, outs, rank, B, gated, bias) -> None:  # noqa: ANN001
    check_against_reference(tt_linear_sweep, tt_linear_sweep_reference, ins, outs, rank,
                            B, gated, bias)


@pytest.mark.parametrize(("ins", "outs", "B"), [([3, 2], [2, 3], 5), ([2, 2, 2], [2, 3, 1], 3)])
def test_gradcheck(impl: str, ins, outs, B) -> None:  # noqa: ANN001
    gradcheck_op(tt_linear_sweep, ins, outs, 2, B)
