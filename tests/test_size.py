"""The one size formula (``comera_engine.tensor.size``): ``tt_size`` against tensorly's
TT of the same ranks, and ``surrogate`` (``Ŝ`` of many trains as one quadratic form)
against a per-layer float64 reference written out bond by bond, value and gradient,
before and after the structure changes."""

from __future__ import annotations

import numpy as np
import pytest
import tensorly as tl
import torch
from tensorly.decomposition import tensor_train
from torch import nn

from comera_engine import TTEmbedding, TTLinear
from comera_engine.layers import size_report, tt_layers
from comera_engine.tensor.size import size_form, surrogate, tt_size

pytestmark = pytest.mark.pytorch_path


@pytest.mark.parametrize("modes, ranks", [((4, 4, 4, 4), (2, 3, 2)), ((3, 5), (3,)),
                                          ((2, 3, 4, 5), (2, 6, 5))])
def test_tt_size_is_the_parameter_count_of_a_tensorly_train(modes, ranks) -> None:
    """A TT-SVD (tensorly) at ranks ``ranks`` has exactly ``tt_size`` entries; a rank 0
    anywhere is the zero map, 0 parameters."""
    t = np.random.default_rng(0).standard_normal(modes)
    with tl.backend_context("numpy"):
        cores = tensor_train(t, [1, *ranks, 1])
    assert [c.shape[-1] for c in cores[:-1]] == list(ranks)
    assert tt_size(modes, ranks) == sum(c.size for c in cores)
    if ranks:
        assert tt_size(modes, (0, *ranks[1:])) == 0
    with pytest.raises(ValueError, match="ranks"):
        tt_size(modes, (*ranks, 2))
    assert tt_size((6,), ()) == 6  # one core: the vector itself


def _reference(layer: nn.Module) -> tuple[torch.Tensor, int]:
    """One layer's ``(Ŝ, S)`` written out bond by bond in float64: the l1 norm of each
    bond's active gates, then ``Σ_k s_k R_{k-1} R_k``; the count from the effective ranks
    (0 with an empty bond)."""
    tt = layer.tt
    norms = [(g.double().abs() * m).sum() for g, m in zip(tt.gates, tt.masks())]
    R = [torch.ones((), dtype=torch.float64), *norms, torch.ones((), dtype=torch.float64)]
    s_hat = sum(s * R[k] * R[k + 1] for k, s in enumerate(tt.mode_sizes))
    counts = [1, *tt.effective_ranks(), 1]
    size = 0 if min(counts) == 0 else sum(s * counts[k] * counts[k + 1]
                                          for k, s in enumerate(tt.mode_sizes))
    return s_hat, size


def _model(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(TTEmbedding(300, 24, rank=4, dtype=dtype),
                      TTLinear(24, 64, rank=5, dtype=dtype),
                      TTLinear(64, 32, rank=[2, 3, 4, 3, 2], tau=0.2, dtype=dtype),
                      TTLinear(16, 16, rank=3, layout="ttm", dtype=dtype))
    with torch.no_grad():
        for _, layer in tt_layers(m):
            layer.tt.gate.copy_(torch.rand_like(layer.tt.gate) * 2 - 1)  # some |g| <= tau
        m[1].tt.bond_alive()[1][0] = False  # pruned earlier: masked whatever its value
        m[2].tt.gates[0][1] = 0.1  # below this layer's tau (0.2), above the others'
    return m


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_surrogate_and_the_sizes_match_the_per_layer_reference(dtype: torch.dtype) -> None:
    """Over a TTM embedding, TT linears in both layouts, dead entries, entries at or
    below per-layer thresholds: ``Ŝ`` and its gradient in every gate equal the float64
    reference's, and each layer's ``num_params`` (``tt_size`` at the effective ranks)
    the reference count, which ``size_report`` sums; again after a truncation and an
    empty bond change the structure."""
    m = _model(dtype)
    layers = [layer for _, layer in tt_layers(m)]
    trains = [layer.tt for layer in layers]
    tol = 1e-12 if dtype == torch.float64 else 1e-5

    def check() -> None:
        s_hat = surrogate(trains)
        assert s_hat.dtype == dtype
        refs = [_reference(layer) for layer in layers]
        ref_hat = sum(r[0] for r in refs)
        torch.testing.assert_close(s_hat.double(), ref_hat, rtol=tol, atol=tol)
        assert [t.num_params(True) for t in trains] == [r[1] for r in refs]
        bias = sum(layer.bias.numel() for layer in layers if getattr(layer, "bias", None)
                   is not None)
        assert sum(r[1] for r in refs) + bias == size_report(m)["tensorized"]["effective_params"]
        gates = [t.gate for t in trains]
        got = torch.autograd.grad(s_hat, gates)
        want = torch.autograd.grad(ref_hat, gates)
        for a, b, t in zip(got, want, trains):
            torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)
            assert not a[~t.active()].any()  # masked entries get no gradient

    check()
    trains[2].refresh_()
    trains[2].truncate_()  # new ranks: a new form
    check()
    with torch.no_grad():
        trains[1].gates[2].zero_()
        trains[1].refresh_(floor=False)  # an empty bond: the layer counts 0
    check()


def test_unit_gates_give_the_allocated_size_and_the_form_is_cached() -> None:
    """All gates at 1 and alive: ``Ŝ`` = the cores' allocated size (a single-core train
    included); the form is built once per structure, device and dtype, one threshold
    kept as a number, several as a vector."""
    m = nn.Sequential(TTLinear(64, 64, rank=5), TTLinear(64, 32, rank=[2, 3, 4, 3, 2]),
                      TTLinear(7, 5, d=1))
    trains = [m[0].tt, m[1].tt, m[2].tt]
    allocated = sum(c.numel() for t in trains for c in t.cores)
    size_form.cache_clear()
    assert float(surrogate(trains).detach()) == allocated
    surrogate(trains)
    assert size_form.cache_info().misses == 1 and size_form.cache_info().hits >= 1
    assert isinstance(size_form(tuple(t.structure() for t in trains), torch.device("cpu"),
                                torch.float32).tau, float)
    trains[1].tau = 0.2
    assert size_form(tuple(t.structure() for t in trains), torch.device("cpu"),
                     torch.float32).tau.shape == (sum(sum(t.bond_ranks) for t in trains),)


@pytest.mark.parametrize("floor", [True, False])
def test_refresh_entries_equals_the_per_bond_refresh(floor: bool) -> None:
    """``refresh_entries`` (all trains' bonds at once, segment reductions; the trainer's
    device refresh ``rank.optim.refresh_gates_on_device``) leaves every gate and
    ``alive`` flag bit for bit as each train's own per-bond host ``refresh_``, and
    counts the same alive entries: bonds dying whole (their strongest kept with
    ``floor``, the first of tied magnitudes), entries pruned earlier with a gate left
    non-zero, two thresholds, both layouts and an embedding."""
    import copy

    from comera_engine.tensor.size import refresh_entries

    torch.manual_seed(0)
    model = nn.ModuleList([TTLinear(64, 48, rank=6), TTEmbedding(100, 16, rank=5, tau=0.02),
                           TTLinear(48, 64, rank=4, layout="ttm")])
    for _ in range(8):
        with torch.no_grad():
            for layer in model:
                tt = layer.tt
                tt.gate.copy_(torch.randn(tt.gate.shape) * 0.02)  # many at or below tau
                tt.gate[:3] = torch.tensor([0.004, -0.004, 0.004])  # tied magnitudes
                dying = tt.gates[1]  # a whole bond below tau, a tie for its strongest
                dying.fill_(-0.001)
                dying[2], dying[3] = -0.005, 0.005
                tt.alive.copy_(torch.rand(tt.alive.shape) > 0.2)  # some pruned before
        host = copy.deepcopy(model)
        counts = refresh_entries([m.tt for m in model], floor)
        for m in host:
            m.tt.refresh_(floor)
        for a, c in zip(model, host):
            assert torch.equal(a.tt.gate, c.tt.gate) and torch.equal(a.tt.alive, c.tt.alive)
        assert counts.tolist() == [int(v.sum()) for m in host for v in m.tt.bond_alive()]
    assert refresh_entries([]).numel() == 0
