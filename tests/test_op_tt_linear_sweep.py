"""The TT-linear sweep op (comera_engine/ops/tt_linear_sweep.py) against its plain PyTorch
reference: float64 outputs and gradients, gradcheck, gates with dead entries, odd
shapes; on the pure PyTorch path and, where it is built, through the CPU backend
(tests/op_checks.py)."""

from comera_engine.ops.tt_linear_sweep import tt_linear_sweep, tt_linear_sweep_reference
from tests.op_checks import op_tests

test_matches_reference_float64, test_gradcheck = op_tests(tt_linear_sweep,
                                                          tt_linear_sweep_reference)
