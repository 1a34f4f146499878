"""The grouped halves op (comera_engine/ops/tt_halves_group.py) and the block that uses it
(comera_engine/tensor/grouped.py): the halves of several TT trains of one structure made
in one batched pass equal, in float64, the plain per-train reference (values, core and
gate gradients, zero for dead and below-``tau`` gates); under bf16 autocast within bf16
error; a layer inside ``grouped_halves`` gives what it gives outside, on the halves and
the reconstructed path; a structure of one train is left to its layer."""

import pytest
import torch

from comera_engine import TTLinear
from comera_engine.ops.tt_halves_group import tt_halves_group, tt_halves_group_reference
from comera_engine.tensor.grouped import grouped_halves, prepared_halves

DT = torch.float64


def _layers(n: int, dtype: torch.dtype = DT, ins=(4, 3, 4), outs=(3, 4, 5)) -> list[TTLinear]:
    """``n`` TT linears of one structure (d = 3, rank 6) with gates in (0, 1), on each
    bond one entry at ``tau`` / 2 and one entry dead."""
    torch.manual_seed(0)
    layers = [TTLinear(48, 60, rank=6, in_factors=list(ins), out_factors=list(outs),
                       dtype=dtype) for _ in range(n)]
    for i, layer in enumerate(layers):
        tt = layer.tt
        with torch.no_grad():
            tt.gate.uniform_(0.05, 1.0)
            at = 0
            for r in tt.bond_ranks:
                tt.gate[at + (i % r)] = tt.tau / 2
                tt.alive[at + (i + 1) % r] = False
                at += r
    return layers


def _loss(pairs: list, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return sum((L * torch.randn(L.shape, generator=g, dtype=DT).to(L.dtype)).sum()
               + (R * torch.randn(R.shape, generator=g, dtype=DT).to(R.dtype)).sum()
               for L, R in pairs)


def _copies(layers: list[TTLinear], dtype: torch.dtype, device: str = "cpu"
            ) -> tuple[list, list[torch.Tensor]]:
    """The layers' trains as ``(cores, gate, alive)`` leaf copies in ``dtype`` on
    ``device``, and those cores and gates in order (what to differentiate)."""
    trains = [([c.detach().to(device, dtype).requires_grad_() for c in t.cores],
               t.gate.detach().to(device, dtype).requires_grad_(), t.alive.to(device))
              for t in (layer.tt for layer in layers)]
    return trains, [p for cores, g, _ in trains for p in (*cores, g)]


def _unpadded(got: list, want: list) -> list:
    """The group's halves cut to the reference's middle rank, after checking the padding:
    a width that is a multiple of 8 (at least 16) and zeros beyond ``r_d``."""
    out = []
    for (L, R), (Lw, _) in zip(got, want):
        rd, rp = Lw.shape[1], L.shape[1]
        assert rp % 8 == 0 and rp >= max(16, rd) and R.shape[0] == rp, (L.shape, R.shape)
        assert not L[:, rd:].detach().any() and not R[rd:].detach().any()
        out.append((L[:, :rd], R[:rd]))
    return out


def _assert_within_bf16(got: list, want: list, g_got: tuple, g_want: tuple) -> None:
    """bf16 halves and gradients ``got`` against float64 ``want``: 2 % on the halves,
    3 % on the gradients (relative norms)."""
    for (L, R), (Lw, Rw) in zip(got, want):
        assert float((L.detach().double().cpu() - Lw.detach()).norm() / Lw.detach().norm()) < 2e-2
        assert float((R.detach().double().cpu() - Rw.detach()).norm() / Rw.detach().norm()) < 2e-2
    for a, b in zip(g_got, g_want):
        assert float((a.double().cpu() - b).norm() / b.norm()) < 3e-2


def test_group_matches_the_per_train_reference_float64() -> None:
    layers = _layers(3)
    trains = [layer.tt.flat_parts() for layer in layers]
    d, tau = layers[0].tt.d, layers[0].tt.tau
    want = tt_halves_group_reference(trains, d, tau)
    got = _unpadded(tt_halves_group(trains, d, tau), want)
    for (L, R), (Lw, Rw) in zip(got, want):
        torch.testing.assert_close(L, Lw, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(R, Rw, rtol=1e-12, atol=1e-12)
    wrt = [p for layer in layers for p in (*layer.tt.cores, layer.tt.gate)]
    g_got = torch.autograd.grad(_loss(got), wrt)
    g_want = torch.autograd.grad(_loss(want), wrt)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for layer, g in zip(layers, g_got[len(layers[0].tt.cores)::len(layers[0].tt.cores) + 1]):
        tt = layer.tt
        masked = ~tt.alive | (tt.gate.detach().abs() <= tt.tau)
        assert masked.sum() == 2 * len(tt.bond_ranks)
        assert not bool(g[masked].any())


def test_group_under_bf16_autocast_within_bf16_error() -> None:
    layers = _layers(2, torch.float32)
    trains = [layer.tt.flat_parts() for layer in layers]
    d, tau = layers[0].tt.d, layers[0].tt.tau
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = tt_halves_group(trains, d, tau)
    assert all(L.dtype == torch.bfloat16 and R.dtype == torch.bfloat16 for L, R in got)
    ref, wrt_ref = _copies(layers, DT)
    want = tt_halves_group_reference(ref, d, tau)
    got = _unpadded(got, want)
    wrt = [p for layer in layers for p in (*layer.tt.cores, layer.tt.gate)]
    g_got = torch.autograd.grad(_loss([(L.float(), R.float()) for L, R in got]), wrt)
    g_want = torch.autograd.grad(_loss(want), wrt_ref)
    assert all(a.dtype == p.dtype for a, p in zip(g_got, wrt))
    _assert_within_bf16(got, want, g_got, g_want)


@pytest.mark.parametrize("path", ["halves", "dense"])
def test_layers_inside_the_block_give_what_they_give_outside(path: str) -> None:
    """Three layers of one structure and one of another: inside ``grouped_halves`` the
    three run on the grouped halves (the fourth on its own), with the outputs and every
    gradient (input, bias, cores, gates) they have outside the block."""
    layers = [*_layers(3), *_layers(1, ins=(2, 6, 4), outs=(5, 3, 4))]
    for layer in layers:
        layer.path = path
    x = torch.randn(7, 48, dtype=DT, requires_grad=True)
    wrt = [x, *(p for layer in layers for p in layer.parameters())]
    runs = []
    for grouped in (False, True):
        if grouped:
            with grouped_halves([layer.tt for layer in layers]) as n:
                assert n == 3
                hits = [prepared_halves(layer.tt.cores[0]) is not None for layer in layers]
                ys = [layer(x) for layer in layers]
            assert hits == [True, True, True, False]
        else:
            ys = [layer(x) for layer in layers]
        g = torch.Generator().manual_seed(3)
        loss = sum((y * torch.randn(y.shape, generator=g, dtype=DT)).sum() for y in ys)
        runs.append((ys, torch.autograd.grad(loss, wrt)))
    (y1, g1), (y2, g2) = runs
    for a, b in zip(y1, y2):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert prepared_halves(layers[0].tt.cores[0]) is None  # forgotten after the block


def test_comera_grouped_in_a_users_loop() -> None:
    """``with comera.grouped():`` around a user's forward: the network's three TT linears
    of one shape are grouped (the differently shaped head is not), and the loss and every
    gradient equal the same forward without the block (float64)."""
    from comera_engine import CoMERA

    torch.manual_seed(0)
    body = _layers(3)
    model = torch.nn.Sequential(body[0], torch.nn.Tanh(), torch.nn.Linear(60, 48, dtype=DT),
                                body[1], torch.nn.Tanh(), torch.nn.Linear(60, 48, dtype=DT),
                                body[2], torch.nn.Tanh(),
                                TTLinear(60, 10, rank=4, dtype=DT))
    comera = CoMERA(model)
    x = torch.randn(16, 48, dtype=DT)
    y = torch.randint(0, 10, (16,))
    runs = []
    for grouped in (False, True):
        model.zero_grad(set_to_none=True)
        if grouped:
            with comera.grouped() as n:
                loss = comera.loss(torch.nn.functional.cross_entropy(model(x), y))
            assert n == 3
        else:
            loss = comera.loss(torch.nn.functional.cross_entropy(model(x), y))
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in model.parameters()
                                     if p.grad is not None]))
    (l1, g1), (l2, g2) = runs
    torch.testing.assert_close(l2, l1, rtol=1e-12, atol=1e-12)
    assert len(g1) == len(g2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
def test_group_on_cuda_matches_the_cpu_group_under_bf16() -> None:
    """On a GPU (gpu_check's tests step), in bf16 autocast: the grouped halves and their
    gradients agree with the same group on the CPU in float64 within bf16 error."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the grouped halves on a GPU need one")
    layers = _layers(4, torch.float32)
    d, tau = layers[0].tt.d, layers[0].tt.tau
    cpu, wrt_cpu = _copies(layers, DT)
    gpu, wrt_gpu = _copies(layers, torch.float32, "cuda")
    want = tt_halves_group(cpu, d, tau)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = tt_halves_group(gpu, d, tau)
    assert [L.shape for L, _ in got] == [L.shape for L, _ in want]  # the same padding
    g_want = torch.autograd.grad(_loss(want), wrt_cpu)
    g_got = torch.autograd.grad(_loss([(L.float().cpu(), R.float().cpu()) for L, R in got]),
                                wrt_gpu)
    _assert_within_bf16(got, want, g_got, g_want)
