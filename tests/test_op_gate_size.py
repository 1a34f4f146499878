"""The rank gates' per-step work over a whole model (``rank.size.gate_sizes``: the size
surrogate, its gradient and the cores' effective size; ``rank.optim.refresh_gates``'s
check), on the PyTorch path and through the CPU backend (``csrc/gate_size.cpp``), against
a layer-by-layer float64 reference written from the formulas."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comera_engine.layers import TTEmbedding, TTLinear, tt_layers
from comera_engine.rank import gate_sizes, refresh_gates
from comera_engine.rank.size import GateBank

TAU = 0.05


def _model(dtype: torch.dtype) -> nn.Module:
    """Three TT layers of different orders and ranks; gates spread around the threshold,
    some entries dead for good, one layer with a bond where every entry is dead."""
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "a": TTLinear(24, 36, rank=4, tau=TAU),
        "b": TTEmbedding(60, 12, rank=3, tau=TAU),
        "c": TTLinear(16, 8, rank=2, tau=TAU),
    }).to(dtype)
    with torch.no_grad():
        for _, m in tt_layers(model):
            for k, g in enumerate(m.tt.gates):
                g.copy_(torch.randn(g.shape, dtype=dtype) * 0.2)
                m.tt.alive(k).copy_(torch.rand(g.shape) > 0.2)
        model["c"].tt.alive(0).zero_()  # a dead bond: the layer counts 0
    return model


def _reference(model: nn.Module) -> tuple[torch.Tensor, float]:
    """Σ over layers of Σ_k s_k ‖g_{k-1}‖₁‖g_k‖₁ over live entries (outer norms 1), as a
    float64 autograd expression in the gates, and the cores' effective size counted from
    the live entries (0 for a layer with an empty bond)."""
    s_hat = torch.zeros((), dtype=torch.float64)
    size = 0.0
    for _, m in tt_layers(model):
        tt = m.tt
        live = [tt.alive(k) & (g.abs() > tt.tau) for k, g in enumerate(tt.gates)]
        R = [1.0, *[(g.double().abs() * lv).sum() for g, lv in zip(tt.gates, live)], 1.0]
        C = [1, *[int(lv.sum()) for lv in live], 1]
        for k, s in enumerate(tt.mode_sizes):
            s_hat = s_hat + s * R[k] * R[k + 1]
        if min(C) > 0:
            size += sum(s * C[k] * C[k + 1] for k, s in enumerate(tt.mode_sizes))
    return s_hat, size


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_surrogate_size_and_gradient_match_the_layer_by_layer_reference(
        op_impl: str, dtype: torch.dtype) -> None:
    model = _model(dtype)
    gates = [g for _, m in tt_layers(model) for g in m.tt.gates]
    ref, ref_size = _reference(model)
    ref_grads = torch.autograd.grad(ref, gates)

    s_hat, size = gate_sizes(model, counts=True)
    assert s_hat.dtype == dtype and size is not None and size.dtype == torch.float64
    grads = torch.autograd.grad(3.0 * s_hat, gates)  # the backward scales by dL/dŜ
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_hat.double(), ref.detach(), **tol)
    assert float(size) == ref_size
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), 3.0 * r.double(), **tol)
    assert any(bool((g == 0).any()) for g in grads)  # dead and sub-threshold entries: 0


def test_the_bank_follows_truncation_and_a_new_threshold(op_impl: str) -> None:
    model = _model(torch.float64)
    bank = GateBank([m for _, m in tt_layers(model)])
    gate_sizes(model, counts=True, bank=bank)  # the layout is built once here
    for _, m in tt_layers(model):  # shapes change under the bank
        m.tt.tau = 0.1
        if m is not model["c"]:
            m.tt.truncate_()
    s_hat, size = gate_sizes(model, counts=True, bank=bank)
    ref, ref_size = _reference(model)
    torch.testing.assert_close(s_hat, ref.detach(), rtol=1e-12, atol=1e-12)
    assert float(size) == ref_size


def test_the_bank_looks_up_the_backend_once_per_structure(cpu_backend) -> None:  # noqa: ANN001
    """The hook's answer for the bank's gates, kept until the structure changes: a
    float16 copy (``.to()``) gets none, as the hook says; CPU autocast gets none."""
    from comera_engine import backends

    model = _model(torch.float32)
    bank = GateBank([m for _, m in tt_layers(model)])
    assert bank.backend() is cpu_backend is backends.cpu_backend(bank.flat()[0][0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert bank.backend() is None
    assert bank.backend() is cpu_backend
    model.half()  # a new structure generation: looked up again
    assert bank.flat()[0][0].dtype == torch.float16 and bank.backend() is None


def test_refresh_finds_an_entry_that_fell_to_its_threshold(op_impl: str) -> None:
    model = _model(torch.float64)
    assert refresh_gates(model) != []  # the random gates: some below tau die now
    assert refresh_gates(model) == []  # nothing left at or below tau
    layer = model["a"].tt
    k = next(k for k in range(len(layer.gates)) if int(layer.alive(k).sum()) >= 2)
    j = int(torch.nonzero(layer.alive(k))[0])
    with torch.no_grad():
        layer.gates[k][j] = TAU  # exactly at the threshold: dies
    events = refresh_gates(model)
    assert [(e.layer, e.bond, e.old - e.new) for e in events] == [("a", k, 1)]
    assert not bool(layer.alive(k)[j]) and float(layer.gates[k][j].detach()) == 0.0


def _ttm_net(dtype: torch.dtype) -> nn.Module:
    """Two TT-matrix (``ttm`` layout) layers, gates spread around the threshold, some
    entries dead for good: each layer's node gives its own size outputs."""
    torch.manual_seed(1)
    net = nn.Sequential(TTLinear(24, 36, rank=4, tau=TAU, layout="ttm"), nn.Tanh(),
                        TTLinear(36, 16, rank=3, tau=TAU, layout="ttm")).to(dtype)
    with torch.no_grad():
        for _, m in tt_layers(net):
            for k, g in enumerate(m.tt.gates):
                g.copy_(torch.randn(g.shape, dtype=dtype) * 0.2)
                m.tt.alive(k).copy_(torch.rand(g.shape) > 0.2)
    return net



FOLDED = "CoMERAObjectiveOverLayersBackward"  # the objective's node over the layers' own outputs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("stage", ["early", "late", "late, paper's norm", "late, at target"])
@pytest.mark.parametrize("model", ["gates", "ttm layers"])
def test_the_objective_is_its_expressions_differentiated_to_the_bit(
        op_impl: str, dtype: torch.dtype, stage: str, model: str) -> None:
    """The CoMERA objective's loss is one autograd node (one call each way on the CPU
    backend): its loss, logged terms and gradients are those of its expressions over the
    surrogate, differentiated by autograd, bit for bit, for both λ outcomes. Over the
    gates (a task loss of its own), and over TT-matrix layers, whose node on the backend
    hands the objective the layer's ``(Ŝ, S)`` and takes the size term's gradient too."""
    from comera_engine.config import CoMERAConfig
    from comera_engine.rank import CoMERAObjective

    if model == "gates":
        net = _model(dtype)
        wrt = [g for _, m in tt_layers(net) for g in m.tt.gates]
        leaf = torch.tensor(0.7, dtype=dtype, requires_grad=True)
        wrt.insert(0, leaf)

        def task_loss() -> torch.Tensor:
            return leaf
    else:
        net = _ttm_net(dtype)
        wrt = list(net.parameters())
        x = torch.randn(5, 24, dtype=dtype)

        def task_loss() -> torch.Tensor:
            return net(x).pow(2).mean()
    cfg = CoMERAConfig(gamma=0.3, gamma_warmup=10, target_compression=2.0,
                       late_norm="initial" if "paper" in stage else "current")
    obj = CoMERAObjective(net, cfg)
    obj.begin_step(3)  # γ still warming up
    lambdas = set()
    for z_f in (0.69, -10.0):  # λ 1 (the loss near its target) and λ 0
        if stage != "early":
            obj.switch_to_late(z_f=z_f)  # the size above the target, or at it
            obj.target_size = 1e9 if stage == "late, at target" else 10.0
        runs = []
        for reference in (False, True):
            f = task_loss()
            info: dict[str, torch.Tensor] = {}
            if reference:  # the expressions, autograd through every op
                s_raw, cores = gate_sizes(net, counts=stage != "early", bank=obj.bank)
                total, _ = obj._terms(f, s_raw, cores, info)
            else:
                total, info = obj(f)
                if model != "gates" and op_impl == "backend":
                    assert total.grad_fn.name() == FOLDED
            grads = torch.autograd.grad(2.0 * total, wrt)
            runs.append((total.detach(), {k: v.detach() for k, v in info.items()
                                          if k != "target_size"}, grads))
        (total, info, grads), (ref_total, ref_info, ref_grads) = runs
        assert torch.equal(total, ref_total)
        assert info.keys() == ref_info.keys()
        assert all(torch.equal(info[k], ref_info[k]) for k in info)
        assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
        lambdas.add(float(info["lambda"]))
        if stage == "early":
            break
    assert lambdas == ({0.0} if stage in ("early", "late, at target") else {0.0, 1.0})


def test_a_layer_without_an_output_of_this_step_sends_the_objective_to_the_gates(
        cpu_backend: object) -> None:
    """An output counts only within its step and once: a layer that did not run since
    the last step (or whose output a call already took) leaves the objective to its own
    pass over the gates, with the same loss and gradients; frozen ranks switch the
    layers' outputs off; a copy of the model starts with none."""
    import copy

    from comera_engine.config import CoMERAConfig
    from comera_engine.rank import CoMERAObjective

    net = _ttm_net(torch.float64)
    x = torch.randn(5, 24, dtype=torch.float64)
    obj = CoMERAObjective(net, CoMERAConfig(gamma=0.3, target_compression=2.0))
    params = list(net.parameters())
    assert obj(net(x).pow(2).mean())[0].grad_fn.name() == FOLDED
    f = net(x).pow(2).mean()
    obj.begin_step(2)  # a step went by: the outputs of that forward are stale
    total, info = obj(f)
    assert total.grad_fn.name() != FOLDED
    assert torch.equal(info["size_surrogate"], gate_sizes(net, bank=obj.bank)[0].detach())
    f = net(x).pow(2).mean()
    assert obj(f)[0].grad_fn.name() == FOLDED
    assert obj(f)[0].grad_fn.name() != FOLDED  # taken once
    # the last layer does not run in this step: its gates still get the size term
    f = net[1](net[0](x)).pow(2).mean()
    total, _ = obj(f)
    assert total.grad_fn.name() != FOLDED
    s_raw, _ = gate_sizes(net, bank=obj.bank)
    ref, _ = obj._terms(f, s_raw, None, {})
    for g, r in zip(torch.autograd.grad(total, params, retain_graph=True, allow_unused=True),
                    torch.autograd.grad(ref, params, allow_unused=True)):
        assert (g is None) == (r is None) and (g is None or torch.equal(g, r))
    net(x)
    twin = copy.deepcopy(net)  # right after a forward: the outputs are not copied
    assert all(m.tt.size_tap.slots is None for _, m in tt_layers(twin))
    obj.frozen = True
    assert all(m.tt.size_tap.slots is None for _, m in tt_layers(net))


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_keeps_the_objective_and_its_gradients(
        cpu_backend: object, reentrant: bool) -> None:
    """A TT-matrix layer under ``torch.utils.checkpoint``: non-reentrant, its forward runs
    with gradients and hands the objective its size pair; reentrant, the first forward
    runs without (the objective makes its own pass over the gates). Either way the loss
    and every gradient are those of the same step without checkpointing, bit for bit."""
    from torch.utils.checkpoint import checkpoint

    from comera_engine.config import CoMERAConfig
    from comera_engine.rank import CoMERAObjective

    net = _ttm_net(torch.float64)
    # an input that wants a gradient: the reentrant checkpoint gives the wrapped layer's
    # parameters theirs only then
    x = torch.randn(5, 24, dtype=torch.float64, requires_grad=True)
    obj = CoMERAObjective(net, CoMERAConfig(gamma=0.3, target_compression=2.0))
    params = list(net.parameters())
    runs = []
    for wrapped in (True, False):
        obj.begin_step(1)
        h = (checkpoint(net[0], x, use_reentrant=reentrant) if wrapped else net[0](x))
        total, _ = obj(net[2](net[1](h)).pow(2).mean())
        if wrapped:
            assert (total.grad_fn.name() == FOLDED) is not reentrant
        for p in params:
            p.grad = None
        total.backward()  # (the reentrant checkpoint takes no torch.autograd.grad)
        runs.append((total.detach(), [p.grad for p in params]))
    (a, ga), (b, gb) = runs
    assert torch.equal(a, b)
    assert all(torch.equal(u, v) for u, v in zip(ga, gb))
