"""The TTM lookup op (comera_engine/ops/ttm_lookup.py) against its plain reference (the
per-token contraction, ttm_lookup_naive) and the dense table: float64 rows and core
gradients, gradcheck, repeated ids, odd shapes, a rank-0 bond."""

from __future__ import annotations

import math

import pytest
import torch

from comera_engine.ops.ttm_lookup import ttm_lookup, ttm_lookup_naive
from comera_engine.tensor import TTMCores

DT = torch.float64


def _cores(rows: list[int], cols: list[int], rank: int) -> list[torch.Tensor]:
    return [c.detach().requires_grad_() for c in TTMCores(rows, cols, rank, dtype=DT).cores]


@pytest.mark.parametrize(("rows", "cols", "rank", "shape"), [
    ([7], [3], 2, (5,)),               # d = 1
    ([5, 3], [2, 3], 3, (4, 6)),       # d = 2, ids in a 2-D batch
    ([3, 1, 4], [2, 5, 1], 2, (9,)),   # d = 3, unit factors
])
@pytest.mark.parametrize("dedup", [True, False])
def test_matches_reference_float64(rows, cols, rank, shape, dedup) -> None:  # noqa: ANN001
    cores = _cores(rows, cols, rank)
    V = math.prod(rows)
    ids = torch.randint(0, V, shape, generator=torch.Generator().manual_seed(0))
    ids.view(-1)[0] = ids.view(-1)[-1]  # a repeated id
    got, want = ttm_lookup(ids, cores, dedup=dedup), ttm_lookup_naive(ids, cores)
    assert got.shape == (*shape, math.prod(cols))
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    gy = torch.randn(got.shape, dtype=DT)
    g1 = torch.autograd.grad((got * gy).sum(), cores)
    g2 = torch.autograd.grad((ttm_lookup_naive(ids, cores) * gy).sum(), cores)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    table = ttm_lookup(torch.arange(V), cores)  # the dense table row by row
    assert torch.allclose(got, table[ids], rtol=1e-12, atol=1e-12)


def test_gradcheck() -> None:
    cores = _cores([3, 2], [2, 2], 2)
    ids = torch.tensor([0, 5, 3, 5])
    assert torch.autograd.gradcheck(lambda *c: ttm_lookup(ids, list(c)), tuple(cores))


def test_a_rank_zero_bond_gives_zero_rows() -> None:
    cores = _cores([3, 2], [2, 2], 2)
    cores = [cores[0][..., :0], cores[1][:0]]
    out = ttm_lookup(torch.tensor([1, 4]), cores)
    assert out.shape == (2, 4) and not out.any()
