"""ops.ttm_decode against the table built in float64 (forward and every gradient)."""

from __future__ import annotations

import pytest
import torch

from comera_engine.ops.ttm_decode import ttm_decode, ttm_decode_reference
from comera_engine.ops.ttm_lookup import split_point
from comera_engine.tensor.tt import TTMCores


def _cores(rows: tuple[int, ...], cols: tuple[int, ...], rank: int, dtype: torch.dtype,
           dead: bool) -> tuple[list[torch.Tensor], TTMCores]:
    torch.manual_seed(0)
    tt = TTMCores(rows, cols, rank, dtype=dtype)
    with torch.no_grad():
        for g in tt.gates:
            g.uniform_(0.2, 1.5)
        if dead:
            tt.gates[0][1] = 0.0  # a dead entry: contributes and receives nothing
    return tt.gated_cores(), tt


@pytest.mark.parametrize("rows,cols,rank,num_rows,n,d,pad,chunk", [
    ((5, 4, 3), (2, 3, 2), 5, 60, 37, 12, None, None),  # V 60, D 12
    ((5, 4, 3), (2, 3, 2), 5, 60, 37, 10, 7, 4),  # D short of ∏ cols, padding row, chunks
    ((7, 3), (4, 4), 6, 21, 9, 16, 0, 1),  # two cores, one row per chunk
    ((3, 2, 2, 2), (2, 2, 2, 2), 3, 22, 20, 15, None, 6),  # four cores, 22 of 24 rows used
])
@pytest.mark.parametrize("dead", [False, True])
def test_decode_matches_the_dense_table_in_float64(rows, cols, rank, num_rows, n, d, pad,
                                                   chunk, dead) -> None:
    cores, tt = _cores(rows, cols, rank, torch.float64, dead)
    h = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    split = split_point(rows, cols, tt.ranks)
    out = ttm_decode(h, cores, split, num_rows, pad, chunk, path="tt")
    # the independent reference: the full table from the cores' own contraction
    E = tt.to_matrix()[:num_rows, :d]
    if pad is not None:
        E = E * torch.ones(num_rows, 1, dtype=E.dtype).index_fill_(0, torch.tensor([pad]), 0)
    want = h @ E.t()
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(ttm_decode_reference(h, cores, split, num_rows, pad), want)
    if pad is not None:
        assert (out[:, pad] == 0).all()
    g = torch.randn_like(out)
    params = [h, *tt.cores, tt.gate]
    got = torch.autograd.grad(out, params, g, allow_unused=True)
    ref = torch.autograd.grad(want, params, g, allow_unused=True)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    if dead:
        assert got[-1].split(tt.bond_ranks)[0][1] == 0


def test_decode_gradcheck() -> None:
    torch.manual_seed(1)
    A = torch.randn(4, 3, 2, dtype=torch.float64, requires_grad=True)
    Bt = torch.randn(5, 2, 2, dtype=torch.float64, requires_grad=True)
    h = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    from comera_engine.ops.ttm_decode import TTMDecode

    assert torch.autograd.gradcheck(
        lambda h, A, Bt: TTMDecode.apply(h, A, Bt, 18, 3, 4), (h, A, Bt))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_low_precision_close_to_float64(dtype: torch.dtype) -> None:
    cores, tt = _cores((5, 4, 3), (2, 3, 2), 5, torch.float64, False)
    h = torch.randn(33, 12, dtype=torch.float64)
    want = ttm_decode_reference(h, cores, 1, 60).detach()
    got = ttm_decode(h.to(dtype), [c.detach().to(dtype) for c in cores], 1, 60, path="tt")
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


def test_auto_path_picks_the_smaller_memory_and_both_agree() -> None:
    """A small vocabulary's table is cheaper than T; a paper-size one is not."""
    from comera_engine.ops.ttm_decode import decode_path

    assert decode_path(307, Va=10, Ea=4, r=8, Vb=200, Eb=16) == "table"  # V 2000, d 64
    assert decode_path(614, Va=320, Ea=16, r=32, Vb=100, Eb=48) == "tt"  # V 32000, d 768
    cores, tt = _cores((5, 4, 3), (2, 3, 2), 5, torch.float64, False)
    h = torch.randn(9, 12, dtype=torch.float64)
    want = ttm_decode_reference(h, cores, 1, 60)
    for path in ("auto", "tt", "table"):
        torch.testing.assert_close(ttm_decode(h, cores, 1, 60, path=path), want)
    with pytest.raises(ValueError, match="path"):
        ttm_decode(h, cores, 1, 60, path="fast")
