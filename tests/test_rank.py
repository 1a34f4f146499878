"""Issue 3: the rank-adaptive objective, on real training runs."""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch
from torch import nn

from comera_engine import TTLinear
from comera_engine.config import CoMERAConfig
from comera_engine.errors import ConfigError
from comera_engine.rank.objective import CoMERAObjective, PlateauDetector
from comera_engine.rank.optim import (
    RankTracker,
    param_groups,
    refresh_gates,
    truncate_model_and_optimizer,
)
from comera_engine.rank.size import dense_size, model_sizes

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_early_stage_recovers_planted_ranks() -> None:
    """A student at rank 8 fitted to a teacher of planted ranks: the early stage's size
    term alone brings every bond to within 2 of its planted rank and keeps the fit. The
    teacher's cores are i.i.d. Gaussian, so its bonds' components differ in strength, as
    a trained layer's do (the engine's own init, scaled isometries, would plant bonds
    whose components are all equally strong)."""
    torch.manual_seed(0)
    planted = [2, 3, 4, 3, 2]
    teacher = TTLinear(64, 64, rank=planted, bias=False)
    with torch.no_grad():
        for core in teacher.tt.cores:
            core.copy_(torch.randn_like(core) * teacher.tt.init_std)
    X = torch.randn(4096, 64)
    with torch.no_grad():
        Y = teacher(X)
        Y /= Y.std()
    student = TTLinear(64, 64, rank=8, bias=False)
    obj = CoMERAObjective(student, CoMERAConfig(gamma=0.2, gamma_warmup=300))
    opt = torch.optim.AdamW(param_groups(student, lr_cores=3e-3, lr_gates=2e-2))
    tracker = RankTracker(student)
    events = []
    t0 = time.time()
    for step in range(2000):
        idx = torch.randint(0, 4096, (256,))
        f = (student(X[idx]) - Y[idx]).pow(2).mean()
        obj.begin_step(step)
        loss, _ = obj(f)
        opt.zero_grad()
        loss.backward()
        opt.step()
        events += refresh_gates(student, step)
    assert time.time() - t0 < 60
    ranks = student.effective_ranks()
    assert all(p <= r <= p + 2 for p, r in zip(planted, ranks)), (ranks, planted)
    assert float(f.detach()) < 1e-2  # the fit is kept while ranks shrink
    # one event per change, consistent with the tracker's view
    assert events and all(e.new < e.old for e in events)
    tracked = tracker.update(step)
    assert {(e.bond, e.new) for e in tracked} == {
        (b, r) for b, (r, a) in enumerate(zip(ranks, [4, 8, 8, 8, 4])) if r != a}


def _compression(obj: CoMERAObjective, model: nn.Module) -> float:
    """Dense size / effective size, on the objective's scope (host integers)."""
    scope = obj.cfg.target_scope
    return dense_size(model)[scope] / model_sizes(model)[scope]


def _digits():
    from sklearn.datasets import load_digits

    Xd, yd = load_digits(return_X_y=True)
    X = torch.tensor(Xd, dtype=torch.float32) / 16
    y = torch.tensor(yd)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(X), generator=g)
    return X, y, perm[:1400], perm[1400:]


@pytest.mark.parametrize("target", [15.0, 30.0])
def test_late_stage_reaches_target_compression(target: float) -> None:
    torch.manual_seed(0)
    X, y, tr, te = _digits()
    # no TT biases: the tensorized size is the cores alone (the late stage's dynamics,
    # not the fixed bias share of the size, are under test here)
    model = nn.Sequential(TTLinear(64, 256, rank=16, bias=False), nn.ReLU(),
                          TTLinear(256, 256, rank=16, bias=False), nn.ReLU(), nn.Linear(256, 10))
    cfg = CoMERAConfig(gamma=0.02, target_compression=target, target_scope="tensorized")
    obj = CoMERAObjective(model, cfg)
    start = _compression(obj, model)
    assert start < target / 1.1  # the target is not met by the initial ranks
    opt = torch.optim.AdamW(param_groups(model, lr_cores=3e-3, lr_gates=2e-2, lr_dense=3e-3))
    plateau = PlateauDetector(patience=50, rel_tol=1e-2, min_steps=200)
    switched_at = reached_at = None
    for step in range(5000):  # the late stage gets there in ~2000-4000 steps
        idx = tr[torch.randint(0, len(tr), (128,))]
        f = nn.functional.cross_entropy(model(X[idx]), y[idx])
        if obj.stage == "early" and plateau.update(float(f.detach())):
            obj.switch_to_late(plateau.value)
            switched_at = step
        obj.begin_step(step)
        loss, info = obj(f)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if refresh_gates(model, step):  # ranks died: the objective counts its S again
            obj.recount()
        if reached_at is None and _compression(obj, model) >= 0.95 * target:
            reached_at = step
        if reached_at is not None and step >= reached_at + 300:  # and it stays there
            break
    assert reached_at is not None, _compression(obj, model)
    assert switched_at is not None and obj.z_f == pytest.approx(plateau.value, rel=0.5)
    final = _compression(obj, model)
    assert abs(final / target - 1) <= 0.10, (final, target)
    with torch.no_grad():
        acc = (model(X[te]).argmax(1) == y[te]).float().mean().item()
    assert acc >= 0.90


def test_truncation_mid_training_keeps_next_loss() -> None:
    torch.manual_seed(0)
    X, y, tr, _ = _digits()
    model = nn.Sequential(TTLinear(64, 128, rank=12), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.AdamW(param_groups(model, lr_cores=3e-3, lr_gates=2e-2, lr_dense=3e-3))
    obj = CoMERAObjective(model, CoMERAConfig(gamma=0.05))

    def step(m, o, ob, idx):
        f = nn.functional.cross_entropy(m(X[idx]), y[idx])
        loss, _ = ob(f)
        o.zero_grad()
        loss.backward()
        o.step()
        refresh_gates(m)
        return float(loss.detach())

    batches = [tr[torch.randint(0, len(tr), (64,))] for _ in range(60)]
    for b in batches[:50]:
        step(model, opt, obj, b)
    with torch.no_grad():  # force some pruning so truncation really slices
        model[0].tt.gates[2][:4] = 0.0
    refresh_gates(model)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(param_groups(twin, lr_cores=3e-3, lr_gates=2e-2,
                                              lr_dense=3e-3))
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # no shared moments
    twin_obj = CoMERAObjective(twin, CoMERAConfig(gamma=0.05))
    twin_obj.S0 = obj.S0
    alloc_before = model[0].tt.num_params(effective=False)
    changes = truncate_model_and_optimizer(model, opt)
    assert changes and model[0].tt.num_params(effective=False) < alloc_before
    for p in model.parameters():  # optimizer state was sliced with the parameters
        st = opt.state[p]
        assert st["exp_avg"].shape == p.shape and st["exp_avg_sq"].shape == p.shape
    for b in batches[50:]:
        a, c = step(model, opt, obj, b), step(twin, twin_opt, twin_obj, b)
        assert a == pytest.approx(c, abs=1e-6)


def test_bad_targets_are_refused() -> None:
    m = nn.Sequential(TTLinear(64, 64, rank=4))
    with pytest.raises(ConfigError, match="^comera.target_compression"):
        CoMERAObjective(m, CoMERAConfig(target_compression=1.0))
    with pytest.raises(ConfigError, match="^comera.target_compression"):
        CoMERAObjective(m, CoMERAConfig(target_compression=0.5))
    with pytest.raises(ConfigError, match="^comera.target_compression.*rank 1 everywhere"):
        CoMERAObjective(m, CoMERAConfig(target_compression=10_000, target_scope="model"))
    with pytest.raises(ConfigError, match="^comera.target_scope"):
        CoMERAObjective(m, CoMERAConfig(target_scope="all"))


def test_settings_built_in_code_are_checked_as_a_toml_file_is() -> None:
    """A config built in code gets the reader's checks: a typo of a method
    (``"svd"``: it ran without the objective), ``enabled="no"`` (taken as true), a target
    as text; and ``tensorize``'s own arguments. One line each, naming the field."""
    import comera_engine as ce

    def dense() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 10))

    for settings, said in (
            ({"method": "svd"}, r"^comera\.method: unknown value 'svd' \(did you mean tt_svd\?\)"),
            ({"enabled": "no"}, r"^comera\.enabled: must be true or false, got 'no'"),
            ({"target_compression": "10"}, r"^comera\.target_compression: must be a number"),
            ({"tau": 2}, r"^comera\.tau")):
        with pytest.raises(ConfigError, match=said):
            ce.tensorize(dense(), CoMERAConfig(**{"target_compression": 4, **settings}))
    for rank in (2.5, 0, True, [4, "a"]):
        with pytest.raises(ConfigError, match=r"^rank: must be a positive integer"):
            ce.tensorize(dense(), CoMERAConfig(), rank=rank)
    with pytest.raises(ConfigError, match=r"^model: give the torch\.nn\.Module"):
        ce.tensorize("model", CoMERAConfig())  # type: ignore[arg-type]
    for layer, kind in ((nn.Linear(64, 64), "TTLinear"), (nn.Embedding(500, 16), "TTEmbedding"),
                        (nn.EmbeddingBag(500, 16), "TTEmbeddingBag")):
        before = copy.deepcopy(layer.state_dict())
        with pytest.raises(ConfigError, match=rf"^model: a bare {type(layer).__name__} "
                                              rf"cannot be replaced in place: build ce\.{kind}"):
            ce.tensorize(layer, CoMERAConfig(), rank=4)
        assert not list(layer.children())  # nothing registered under it (a TT child "")
        assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())


def test_tensorize_names_the_layers_no_tt_layer_replaces(capsys) -> None:
    """A CNN with a recurrent head: its convolutions and GRU stay dense, said once with
    their share of the parameters (the target counts the TT layers); a network without
    such layers is told nothing."""
    import comera_engine as ce

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.convs = nn.Sequential(nn.Conv2d(3, 16, 3), nn.Conv2d(16, 16, 3))
            self.gru = nn.GRU(16, 32, batch_first=True)
            self.head = nn.Linear(32, 64)

    net = Net()
    dense = {n: sum(p.numel() for p in m.parameters()) for n, m in
             (("conv", net.convs), ("gru", net.gru), ("all", net))}
    ce.tensorize(net, CoMERAConfig(), rank=4)
    said = capsys.readouterr().err
    share = (dense["conv"] + dense["gru"]) / dense["all"]
    assert (f"CoMERA: Conv2d ×2, GRU ×1 stay dense ({dense['conv'] + dense['gru']:,} "
            f"parameters, {share:.0%} of the model)") in said
    ce.tensorize(nn.Sequential(nn.Linear(64, 64)), CoMERAConfig(), rank=4)
    assert "stay dense" not in capsys.readouterr().err


def test_a_fresh_tt_layer_starts_at_the_scale_of_the_layer_it_replaces() -> None:
    """A network initialised its own way (a Hugging Face model's ``normal(0, 0.02)``, a
    zero bias): each TT layer's rebuilt weight starts at the dense weight's mean square
    and keeps its bias, so a tied LM head starts near ``ln V`` as the dense one does; a
    torch-default layer keeps its usual scale; a zero weight keeps the TT default (cores
    of zeros could not train)."""
    import comera_engine as ce

    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 256), nn.Linear(256, 64),
                        nn.Linear(64, 128))
    for m in (net[0], net[1]):
        nn.init.normal_(m.weight, std=0.02)
    nn.init.zeros_(net[1].bias)
    nn.init.zeros_(net[3].weight)
    dense = [m.weight.detach().pow(2).mean().sqrt().item() for m in net]
    biases = {i: net[i].bias.detach().clone() for i in (1, 2)}
    ce.tensorize(net, CoMERAConfig(), rank=8)
    got = [net[0].tt.full_tensor().pow(2).mean().sqrt().item(),
           *(net[i].dense_weight().pow(2).mean().sqrt().item() for i in (1, 2, 3))]
    for i in range(3):
        assert got[i] == pytest.approx(dense[i], rel=1e-4), i  # the cores scaled exactly
    assert got[3] == pytest.approx((1 / (3 * 64)) ** 0.5, rel=0.3)  # TTLinear's own
    assert net[0].tt.init_var == pytest.approx(dense[0] ** 2)  # what a reset draws at
    for i, b in biases.items():
        assert torch.equal(net[i].bias.detach(), b)

    from transformers import GPT2Config, GPT2LMHeadModel  # its head tied to the table

    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(vocab_size=200, n_positions=32, n_embd=64, n_layer=1,
                                    n_head=4))
    ids = torch.randint(0, 200, (4, 16))
    ce.tensorize(lm, CoMERAConfig(target_compression=5))
    with torch.no_grad():
        loss = lm(input_ids=ids, labels=ids).loss.item()
    assert loss == pytest.approx(math.log(200), abs=0.3)  # not the ~40 of a table at std 1


def test_tensorize_says_a_sparse_table_gets_dense_gradients(capsys) -> None:
    """An ``nn.Embedding(sparse=True)`` made TT: its cores' gradients are dense, which
    torch's SparseAdam refuses; tensorize names the table once, and a table left dense
    (excluded) or without ``sparse`` is not named."""
    import comera_engine as ce

    def net() -> nn.Module:
        return nn.Sequential(nn.Embedding(4096, 64, sparse=True),
                             nn.Embedding(4096, 64, sparse=True), nn.Embedding(4096, 64))

    model = ce.tensorize(net(), CoMERAConfig(), rank=4, exclude=["1"])
    said = capsys.readouterr().err
    assert "CoMERA: '0' had sparse=True" in said and "'1'" not in said and "'2'" not in said
    model[0](torch.tensor([[1, 2]])).sum().backward()
    assert all(not c.grad.is_sparse for c in model[0].tt.cores)  # what the line says
    with pytest.raises(RuntimeError, match="SparseAdam does not support dense gradients"):
        torch.optim.SparseAdam(model[0].tt.cores.parameters()).step()
    ce.tensorize(nn.Sequential(nn.Embedding(4096, 64)), CoMERAConfig(), rank=4)
    assert "sparse" not in capsys.readouterr().err


CONV_MODULE = '''
import torch
from torch import nn

COMERA_MODELS = ["pixels_conv"]


class Net(nn.Module):
    def __init__(self, in_features, num_classes):
        super().__init__()
        self.conv = nn.Conv1d(1, 8, 5, padding=2)
        self.body = nn.Linear(8 * in_features, 64)
        self.head = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.head(torch.relu(self.body(self.conv(x.unsqueeze(1)).flatten(1))))


def pixels_conv(in_features, num_classes):
    return Net(in_features, num_classes)
'''


def test_the_preview_names_a_factory_networks_convolution_as_kept_dense(
        tmp_path, monkeypatch) -> None:
    """The studio's preview of a network of one's own with a convolution names it among
    the layers kept dense, with why (before, it listed the TT layers alone)."""
    from comera_engine.preview import preview

    (tmp_path / "conv_mod.py").write_text(CONV_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    pv = preview({"name": "conv", "task": "classify",
                  "model": {"factory": "conv_mod:pixels_conv",
                            "tensorize": {"exclude": ["head"]}},
                  "data": {"name": "digits"}, "comera": {"target_compression": 3},
                  "train": {"steps": 100, "batch_size": 32}})
    assert not pv.errors, pv.errors
    assert [layer.name for layer in pv.layers] == ["body"]
    kept = [n for n in pv.notes if n.startswith("Kept dense")]
    assert kept == ["Kept dense: conv (a Conv1d: TT layers replace linears and tables)."]


def test_embedding_cores_learn_at_their_own_rate() -> None:
    """``lr_embedding`` puts the TT embedding's cores in their own AdamW group: AdamW's
    first step moves each entry by ``lr·sign(grad)`` (plus the decay ``lr·wd·p``), so
    the largest move of a core is its group's rate, measured on the parameters."""
    from comera_engine import TTEmbedding

    torch.manual_seed(0)
    emb, lin = TTEmbedding(60, 16, rank=4), TTLinear(16, 16, rank=4)
    model = nn.ModuleDict({"emb": emb, "lin": lin})
    plain = param_groups(model)
    assert [g["name"] for g in plain] == ["cores", "gates", "dense"]
    # nothing set: no group carries a rate (the optimizer's applies); the gates no decay
    assert [set(g) - {"name", "params"} for g in plain] == [set(), {"weight_decay"}, set()]
    groups = param_groups(model, lr_cores=1e-4, lr_gates=1e-3, lr_dense=1e-3,
                          lr_embedding=3e-3, weight_decay=0.0)
    by_name = {g["name"]: g for g in groups}
    assert {id(p) for p in by_name["embedding"]["params"]} == {id(p) for p in emb.tt.cores}
    assert {id(p) for p in by_name["cores"]["params"]} == {id(p) for p in lin.tt.cores}
    before = [p.detach().clone() for p in [*emb.tt.cores, *lin.tt.cores]]
    opt = torch.optim.AdamW(groups)
    lin(emb(torch.arange(60))).square().mean().backward()
    opt.step()
    after = [*emb.tt.cores, *lin.tt.cores]
    moves = [float((a.detach() - b).abs().max()) for a, b in zip(after, before)]
    n_emb = len(emb.tt.cores)
    for m in moves[:n_emb]:
        assert m == pytest.approx(3e-3, rel=1e-3)
    for m in moves[n_emb:]:
        assert m == pytest.approx(1e-4, rel=1e-3)


def test_a_loss_stuck_where_it_started_is_not_a_plateau() -> None:
    """A classifier at chance (loss ln 3 plus batch noise) has not converged: with
    ``min_drop`` the detector waits for the loss to fall first, then finds the plateau."""
    g = torch.Generator().manual_seed(0)
    stuck = (1.0986 + 0.013 * torch.randn(300, generator=g)).tolist()
    plain = PlateauDetector(patience=100)
    guarded = PlateauDetector(patience=100, min_drop=0.01)
    assert any(plain.update(v) for v in stuck)  # the plain rule calls chance a plateau
    assert not any(guarded.update(v) for v in stuck)
    assert guarded.start == pytest.approx(sum(stuck[:20]) / 20)
    twin = PlateauDetector(patience=100, min_drop=0.01)
    twin.load_state_dict(guarded.state_dict())
    learning = torch.linspace(1.0986, 0.9, 200).tolist() + [0.9] * 200
    fired = [i for i, v in enumerate(learning) if guarded.update(v)]
    assert fired and 300 <= fired[0] <= 400  # ~100 updates after the smoothed fall ends
    assert [i for i, v in enumerate(learning) if twin.update(v)] == fired


def test_gate_balancing_keeps_the_function_and_moves_the_scale_into_the_gates() -> None:
    """comera.balance: slices back at their initial entry scale, every bond of a layer at
    one mean |g|, and the layer computes the same map (float64)."""
    from comera_engine import TTEmbedding
    from comera_engine.rank.balance import balance_gates

    torch.manual_seed(0)
    lin = TTLinear(48, 36, rank=4, tau=0.01).double()
    emb = TTEmbedding(90, 16, rank=4, tau=0.01).double()
    with torch.no_grad():  # as training leaves them: slices grown, gates shrunk, unevenly
        for layer in (lin, emb):
            for k, g in enumerate(layer.tt.gates):
                g.mul_(torch.rand(g.shape, dtype=torch.float64) * 0.5 + 0.05 * (k + 1))
            for c in layer.tt.cores:
                c.mul_(1.0 + 3.0 * torch.rand(c.shape[-1], dtype=torch.float64))
        lin.tt.bond_alive()[1][2] = False  # a dead entry stays dead and zero
        lin.tt.gates[1][2] = 0.0
    x, ids = torch.randn(7, 48, dtype=torch.float64), torch.randint(0, 90, (11,))
    before = lin(x), emb(ids)
    balance_gates([lin, emb])
    after = lin(x), emb(ids)
    torch.testing.assert_close(after[0], before[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(after[1], before[1], rtol=1e-10, atol=1e-12)
    assert float(lin.tt.gates[1][2].detach()) == 0.0 and not bool(lin.tt.bond_alive()[1][2])
    for layer in (lin, emb):
        tt = layer.tt
        core = tt.cores[0]  # the first core has one bond: its right slices are at target
        norms = core.reshape(-1, core.shape[-1]).norm(dim=0)
        want = tt.init_std * (core.numel() // core.shape[-1]) ** 0.5
        torch.testing.assert_close(norms, torch.full_like(norms, want))
        means = [float(g.detach().abs()[tt.bond_alive()[k]].mean()) for k, g in enumerate(tt.gates)]
        assert means == pytest.approx([means[0]] * len(means), rel=1e-9)
