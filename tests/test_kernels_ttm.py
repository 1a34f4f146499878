"""The fused TTM lookup kernels (kernels/ttm_lookup.py) under ``TRITON_INTERPRET=1`` on
the CPU, against float64: rows and both half tables' gradients, repeated ids, rows no id
touches, odd shapes, ranks below and above a tile; fp32 and bf16; deterministic."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
triton = pytest.importorskip("triton", reason="triton is not installed (Linux x86-64 only)")

from comera_engine.kernels import ttm_lookup as K  # noqa: E402
from comera_engine.ops.ttm_lookup import merge_tables  # noqa: E402
from comera_engine.tensor.tt import TTMCores  # noqa: E402
from tests.kernel_checks import bench_smoke_run  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="no GPU and TRITON_INTERPRET is not 1")
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}

# (row factors, column factors, rank, split, ids): V_a·V_b rows, E_a·E_b columns
CASES = [((5, 4, 3), (2, 3, 2), 5, 1, 37),   # V 60 = 5·12, E 12 = 2·6, r 5
         ((7, 3), (3, 5), 30, 1, 23),         # r 30 (a 32 tile), E_b 5
         ((3, 2, 4), (4, 2, 3), 20, 2, 41)]   # split after two cores: V_a 6, E_a 8


def _tables(rows, cols, rank, split, dtype):
    torch.manual_seed(0)
    tt = TTMCores(rows, cols, rank, dtype=torch.float64)
    with torch.no_grad():
        for g in tt.gates:
            g.uniform_(0.3, 1.2)
    A, Bt = merge_tables([c.detach() for c in tt.gated_cores()], split)
    return A, Bt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols,rank,split,n", CASES)
def test_fused_lookup_and_its_gradients_match_float64(rows, cols, rank, split, n,
                                                      dtype) -> None:
    A64, Bt64 = _tables(rows, cols, rank, split, dtype)
    V = A64.shape[0] * Bt64.shape[0]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (n,), generator=g)
    ids[:5] = ids[0]  # one id several times: its segment sums five gradients
    A = A64.to(DEVICE, dtype).requires_grad_()
    Bt = Bt64.to(DEVICE, dtype).requires_grad_()
    out = K.ttm_lookup_fused(ids.to(DEVICE), A, Bt)
    assert out.dtype == dtype and out.shape == (n, A.shape[1] * Bt.shape[2])
    dy = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(dy.to(DEVICE, dtype))
    Ar, Btr = A64.clone().requires_grad_(), Bt64.clone().requires_grad_()
    ref = K.ttm_lookup_fused_reference(ids, Ar, Btr)
    ref.backward(dy)
    s = ref.abs().max()
    torch.testing.assert_close(out.detach().cpu().double() / s, ref.detach() / s, **TOL[dtype])
    for got, want in ((A.grad, Ar.grad), (Bt.grad, Btr.grad)):
        s = want.abs().max()
        torch.testing.assert_close(got.cpu().double() / s, want / s, **TOL[dtype])
    untouched = torch.ones(A.shape[0], dtype=torch.bool)
    untouched[torch.div(ids, Bt.shape[0], rounding_mode="floor")] = False
    assert (A.grad.cpu()[untouched] == 0).all()  # rows no id uses: exactly zero


def test_backward_is_deterministic_and_empty_ids_are_fine() -> None:
    A64, Bt64 = _tables((5, 4, 3), (2, 3, 2), 5, 1, torch.float32)
    A, Bt = A64.float().to(DEVICE), Bt64.float().to(DEVICE)
    ids = torch.randint(0, 60, (50,), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    grad = torch.randn(50, A.shape[1], Bt.shape[2], device=DEVICE)
    first = K.lookup_backward(ids, grad, A, Bt)
    second = K.lookup_backward(ids, grad, A, Bt)
    assert all(torch.equal(x, y) for x, y in zip(first, second))
    empty = K.lookup(ids[:0], A, Bt)
    assert empty.shape == (0, A.shape[1], Bt.shape[2])
    with pytest.raises(ValueError, match="^Bt: expected rank"):
        K.lookup(ids, A, Bt[:, :3])


@pytest.mark.skipif(DEVICE != "cuda", reason="a CUDA graph needs a GPU (run by "
                    "experiments/gpu_check.sh tests)")
def test_lookup_and_backward_replay_in_a_cuda_graph() -> None:
    """Forward and backward captured in one CUDA graph (no host sync inside: the
    segment counts stay on the device), replayed on new ids, equal to eager."""
    A64, Bt64 = _tables((7, 3), (3, 5), 30, 1, torch.float32)
    A = A64.float().cuda().requires_grad_()
    Bt = Bt64.float().cuda().requires_grad_()
    ids = torch.randint(0, 21, (64,), device="cuda")
    dy = torch.randn(64, 15, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture, as torch.cuda.graphs asks
        K.ttm_lookup_fused(ids, A, Bt).backward(dy)
    torch.cuda.current_stream().wait_stream(stream)
    A.grad = Bt.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.ttm_lookup_fused(ids, A, Bt)
        out.backward(dy)
    for seed in (1, 2):
        new = torch.randint(0, A.shape[0] * Bt.shape[0], (64,),
                            generator=torch.Generator().manual_seed(seed)).cuda()
        ids.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        Ae, Bte = A.detach().clone().requires_grad_(), Bt.detach().clone().requires_grad_()
        eager = K.ttm_lookup_fused(new, Ae, Bte)
        eager.backward(dy)
        torch.testing.assert_close(out, eager, **TOL[torch.float32])
        torch.testing.assert_close(A.grad, Ae.grad, **TOL[torch.float32])
        torch.testing.assert_close(Bt.grad, Bte.grad, **TOL[torch.float32])


def test_bench_kernels_ttm_smoke_run(tmp_path) -> None:
    """experiments/bench_kernels_ttm.py runs its three variants, eager and in a CUDA graph
    where there is one, and writes its JSON (at a tiny shape: the code path, not a
    timing): interpreted on the CPU, compiled on a GPU."""
    bench_smoke_run("bench_kernels_ttm", ["--tokens", "37", "--rows", "5", "4", "3", "--cols",
                                          "2", "3", "2", "--rank", "5"],
                    tmp_path, DEVICE, {"fused", "gather", "dense", "nn.Embedding"})


def test_tt_embedding_rows_come_from_the_fused_lookup(monkeypatch, count_calls) -> None:
    """A TTEmbedding on its ``fused`` path (gates with a dead entry, a padding row,
    repeated ids): with the kernels on (``interpret`` takes CPU tensors under the
    interpreter) its rows and core and gate gradients equal the PyTorch path's (what the
    path runs where the kernels are off), and the kernel ran."""
    from comera_engine import TTEmbedding

    torch.manual_seed(0)
    emb = TTEmbedding(60, 12, rank=5, padding_idx=0, path="fused").to(DEVICE)
    with torch.no_grad():
        emb.tt.gates[0][1] = 0.0
    ids = torch.tensor([[3, 0, 59, 3], [17, 17, 42, 1]], device=DEVICE)
    dy = torch.randn(2, 4, 12, device=DEVICE)
    calls = count_calls(K, "ttm_lookup_fused")

    def run() -> list[torch.Tensor]:
        emb.zero_grad()
        y = emb(ids)
        y.backward(dy)
        return [y.detach(), *(p.grad for p in emb.parameters() if p.grad is not None)]

    monkeypatch.setenv("COMERA_KERNELS", "0")
    want = run()
    assert not calls
    monkeypatch.setenv("COMERA_KERNELS", "interpret" if DEVICE == "cpu" else "1")
    got = run()
    assert calls
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel", ["lookup", "segment_grad"])
def test_every_lookup_configuration_matches_float64(kernel) -> None:
    """Each launch configuration a tuning sweep may pick for the lookup and for its
    backward's segment kernel gives the same rows and gradients."""
    from comera_engine.kernels import configs

    A64, Bt64 = _tables((5, 4, 3), (2, 3, 2), 5, 1, torch.float32)
    ids = torch.randint(0, 60, (29,), generator=torch.Generator().manual_seed(4))
    dy = torch.randn(29, 12, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    Ar, Btr = A64.clone().requires_grad_(), Bt64.clone().requires_grad_()
    ref = K.ttm_lookup_fused_reference(ids, Ar, Btr)
    ref.backward(dy)
    for cfg in configs.CANDIDATES[kernel]:
        A = A64.to(DEVICE, torch.float32).requires_grad_()
        Bt = Bt64.to(DEVICE, torch.float32).requires_grad_()
        with configs.forced(kernel, cfg):
            out = K.ttm_lookup_fused(ids.to(DEVICE), A, Bt)
            out.backward(dy.to(DEVICE, torch.float32))
        for got, want in ((out.detach(), ref.detach()), (A.grad, Ar.grad), (Bt.grad, Btr.grad)):
            s = want.abs().max()
            torch.testing.assert_close(got.cpu().double() / s, want / s, rtol=1e-4, atol=1e-4)
