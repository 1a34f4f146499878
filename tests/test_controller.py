"""The rank controller for your own model and loop (``comera_engine.CoMERA``): a network
defined here (not a preset: an embedding and linears, the head kept dense) trained with
the public API in a hand-written loop on scikit-learn's digits."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_engine as ce
from comera_engine.errors import ConfigError
from comera_engine.layers import TiedDecoder, TTEmbedding, TTLinear, size_report, tt_layers

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.pytorch_path]

TARGET = 20.0
STEPS = 360


class PixelNet(nn.Module):
    """Digits as 64 tokens (pixel position × intensity 0–16) in an embedding table, the
    mean of the 64 vectors through two hidden layers to a 10-way head."""

    def __init__(self, dim: int = 32, hidden: int = 256) -> None:
        super().__init__()
        self.table = nn.Embedding(64 * 17, dim)
        self.up = nn.Linear(dim, hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 10)
        self.register_buffer("offset", torch.arange(64) * 17)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        h = self.table(pixels + self.offset).mean(1)
        h = F.relu(self.mid(F.relu(self.up(h))))
        return self.head(h)


@pytest.fixture(scope="module")
def digits() -> dict[str, torch.Tensor]:
    """scikit-learn's digits as intensity ids, 1,400 to train on and the rest held out."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(y), generator=g)
    x = torch.as_tensor(x, dtype=torch.long)[order]
    y = torch.as_tensor(y, dtype=torch.long)[order]
    return {"x": x[:1400], "y": y[:1400], "x_test": x[1400:], "y_test": y[1400:]}


def _batch(data: dict[str, torch.Tensor], step: int, size: int = 64) -> tuple:
    i = (step * size) % (len(data["y"]) - size)
    return data["x"][i : i + size], data["y"][i : i + size]


#: the learning rate PixelNet trains at dense (the optimizer's; CoMERA sets none)
LR = 3e-3


def _setup(seed: int = 0, target: float = TARGET, steps: int = STEPS, **settings) -> tuple:
    """The README's loop: one config, ``tensorize`` and the controller given it, the
    user's own AdamW at the network's dense learning rate."""
    torch.manual_seed(seed)
    config = ce.CoMERAConfig(target_compression=target, switch=60, **settings)
    model = ce.tensorize(PixelNet(), config, exclude=["head"])
    comera = ce.CoMERA(model, config, total_steps=steps)
    opt = torch.optim.AdamW(comera.param_groups(), lr=LR, weight_decay=0.0)
    return model, comera, opt


def _train(model: nn.Module, comera: ce.CoMERA, opt: torch.optim.Optimizer,
           data: dict[str, torch.Tensor], start: int, stop: int,
           attached: bool = False) -> list[float]:
    """Steps ``start..stop-1``, the controller's step by hand unless ``attached``."""
    losses = []
    for step in range(start, stop):
        x, y = _batch(data, step)
        loss = comera.loss(F.cross_entropy(model(x), y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if not attached:
            comera.step(opt)
        losses.append(float(loss.detach()))
    return losses


@torch.no_grad()
def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(x).argmax(1) == y).float().mean())


@pytest.fixture(scope="module")
def trained(digits) -> tuple:
    """The README's loop with ``attach``: the loop calls the optimizer only."""
    model, comera, opt = _setup()
    comera.attach(opt)
    for step in range(STEPS):
        x, y = _batch(digits, step)
        loss = comera.loss(F.cross_entropy(model(x), y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, comera, opt


def assert_truncated(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """The TT cores hold only live rank entries, and every optimizer state tensor has its
    parameter's (sliced) shape."""
    assert all(bool(mk.all()) for _, m in tt_layers(model) for mk in m.tt.masks())
    for group in opt.param_groups:
        for p in group["params"]:
            for v in opt.state[p].values():
                if torch.is_tensor(v) and v.dim():
                    assert v.shape == p.shape


def test_own_loop_lands_at_the_target_and_report_agrees_with_size_report(trained, digits):
    model, comera, opt = trained
    rep, sizes = comera.report(), size_report(model)
    assert isinstance(model.head, nn.Linear) and not isinstance(model.head, TTLinear)
    assert isinstance(model.table, TTEmbedding) and isinstance(model.mid, TTLinear)
    # the target, within the ±5 % the method promises (tensorized scope, the default)
    assert abs(rep["compression"] / TARGET - 1) <= 0.05, rep["message"]
    assert rep["compression"] == sizes["tensorized"]["compression"]
    assert rep["params"] == sizes["model"]["effective_params"]
    # the scope's own counts beside the whole model's: their ratio is the compression
    assert rep["scope_params"] == sizes["tensorized"]["effective_params"]
    assert rep["scope_dense_params"] / rep["scope_params"] == pytest.approx(rep["compression"])
    assert rep["ranks"] == {row["name"]: row["effective_ranks"] for row in sizes["layers"]}
    assert rep["target"] == TARGET and rep["stage"] == "fixed" and rep["step"] == STEPS
    assert rep["message"].startswith(f"target {TARGET:g}x · reached")
    kinds = [e.kind for e in comera.events]
    assert {"stage", "pace", "target_met", "truncate"} <= set(kinds)
    # who pruned: every entry that went, by the objective's gates or by the pace
    start = sum(sum(r) for r in _setup()[1].report()["ranks"].values())
    assert sum(rep["removed"].values()) == start - sum(sum(r) for r in rep["ranks"].values())
    assert rep["removed"]["pace"] > 0
    # truncation happened in the loop
    assert_truncated(model, opt)
    # learning, not a benchmark (experiments/own_loop.py compares with dense)
    assert _accuracy(model, digits["x_test"], digits["y_test"]) > 0.7


def test_save_then_load_into_a_fresh_instance_gives_equal_outputs(trained, digits, tmp_path):
    model, comera, _ = trained
    path = ce.save(model, tmp_path / "small.safetensors")
    fresh = ce.load_into(PixelNet(), path)
    assert isinstance(fresh.table, TTEmbedding) and isinstance(fresh.mid, TTLinear)
    assert fresh.mid.effective_ranks() == model.mid.effective_ranks()
    model.eval()
    fresh.eval()
    with torch.no_grad():
        # float32: the gates absorbed into the cores round differently than applied live
        torch.testing.assert_close(fresh(digits["x_test"]), model(digits["x_test"]),
                                   rtol=1e-5, atol=1e-5)
    # the file holds the effective size (4-byte floats) plus the buffer and a small header
    effective = size_report(model)["model"]["effective_bytes"]
    assert effective < path.stat().st_size < effective + 64 * 8 + 16_000


def test_load_into_refuses_another_model_and_leaves_it_untouched(trained, tmp_path):
    model, _, _ = trained
    path = ce.save(model, tmp_path / "small.safetensors")
    other = PixelNet(hidden=128)
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ConfigError, match="load into a fresh instance of the class") as err:
        ce.load_into(other, path)
    # both sides named with their shapes: what was saved, what the model has there
    assert "saved as a TT Linear(32, 256); the model has Linear(32, 128)" in str(err.value)
    assert isinstance(other.mid, nn.Linear) and not isinstance(other.mid, TTLinear)
    for k, v in other.state_dict().items():
        assert torch.equal(v, before[k])
    pickle = tmp_path / "model.pt"
    torch.save(model.state_dict(), pickle)
    with pytest.raises(ConfigError, match="not a safetensors file"):
        ce.load_into(PixelNet(), pickle)


def test_state_dict_round_trip_resumes_to_the_same_ranks_and_losses(digits):
    """Stopped after the late stage began and after truncations, rebuilt from a fresh
    instance through state dicts alone, the run goes on exactly as the uninterrupted one."""
    whole = _setup()
    whole_losses = _train(*whole, digits, 0, 200)
    first = _setup()
    _train(*first, digits, 0, 120)
    model, comera, opt = first
    assert comera.stage == "late" and any(e.kind == "truncate" for e in comera.events)
    # on its way: progress toward the target, not a verdict
    assert comera.report()["message"].endswith(f"at step 120 of {STEPS} (still training)")
    saved = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
             "comera": copy.deepcopy(comera.state_dict())}
    for order in ("controller first", "model first"):
        # a different initialisation: everything must come from `saved`
        again, resumed, opt2 = _setup(seed=123)
        if order == "controller first":
            resumed.load_state_dict(copy.deepcopy(saved["comera"]))  # reshapes the layers
            again.load_state_dict(saved["model"])
        else:
            again.load_state_dict(saved["model"])  # reshapes the TT layers itself
            resumed.load_state_dict(copy.deepcopy(saved["comera"]))
        opt2.load_state_dict(copy.deepcopy(saved["opt"]))  # (AdamW updates it in place)
        assert resumed.pace == comera.pace and resumed.stage == comera.stage, order
        assert resumed.steps_done == 120
        losses = _train(again, resumed, opt2, digits, 120, 200)
        assert losses == pytest.approx(whole_losses[120:], rel=1e-6, abs=1e-7), order
        assert resumed.report()["ranks"] == whole[1].report()["ranks"]
    # a live run rolled back in place (the same objects, after a loss spike, say): the
    # controller goes back to the saved stage, pace and unfixed ranks too
    _train(model, comera, opt, digits, 120, STEPS)
    assert comera.frozen and comera.stage == "fixed"
    model.load_state_dict(saved["model"])
    comera.load_state_dict(copy.deepcopy(saved["comera"]))
    opt.load_state_dict(copy.deepcopy(saved["opt"]))
    assert not comera.frozen and comera.stage == "late" and comera.steps_done == 120
    assert all(layer.tt.tau == comera.cfg.tau for layer in comera._layers.values())
    losses = _train(model, comera, opt, digits, 120, 200)
    assert losses == pytest.approx(whole_losses[120:], rel=1e-6, abs=1e-7)
    assert comera.report()["ranks"] == whole[1].report()["ranks"]


@pytest.mark.parametrize("make_opt", [
    lambda g: torch.optim.AdamW(g),
    lambda g: torch.optim.Adam(g),
    lambda g: torch.optim.SGD(g, momentum=0.9),
], ids=["adamw", "adam", "sgd-momentum"])
def test_truncation_keeps_outputs_and_slices_optimizer_state_float64(make_opt) -> None:
    """After ranks die, ``step(opt)`` slices the cores and every state tensor of the
    optimizer with the same indices; the outputs (float64) do not move."""
    torch.manual_seed(0)
    model = PixelNet(dim=16, hidden=64).double()
    ce.tensorize(model, rank=6, exclude=["head"])
    comera = ce.CoMERA(model)
    opt = make_opt(comera.param_groups())
    x = torch.randint(0, 17, (32, 64))
    y = torch.randint(0, 10, (32,))
    for _ in range(3):
        loss = comera.loss(F.cross_entropy(model(x), y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        comera.step(opt)
    layer = model.mid
    with torch.no_grad():  # two entries of the middle bond fall below the threshold
        layer.tt.gates[1][[1, 4]] = 1e-3
    keep = torch.tensor([j for j in range(layer.tt.ranks[2]) if j not in (1, 4)])
    first = layer.tt.bond_ranks[0]  # the middle bond's entries in the one gate tensor
    keep_gate = torch.tensor([j for j in range(sum(layer.tt.bond_ranks))
                              if j not in (first + 1, first + 4)])
    left, right, gate = layer.tt.cores[1], layer.tt.cores[2], layer.tt.gate
    want = {id(p): {k: v.index_select(dim, idx).clone() for k, v in opt.state[p].items()
                    if torch.is_tensor(v) and v.shape == p.shape}
            for p, dim, idx in ((left, left.dim() - 1, keep), (right, 0, keep),
                                (gate, 0, keep_gate))}
    with torch.no_grad():
        before = model(x)  # entries at |g| <= tau are masked out already
    assert float(left.detach()[..., [1, 4]].abs().min()) > 0  # what is cut held values
    events = comera.step(opt)
    assert [e.kind for e in events] == ["rank_change", "truncate"]
    assert layer.tt.ranks[2] == keep.numel() and left.shape[-1] == keep.numel()
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=1e-12, atol=1e-12)
    for p in (left, right, gate):
        assert want[id(p)], "the optimizer kept state for this parameter"
        for key, value in want[id(p)].items():
            torch.testing.assert_close(opt.state[p][key], value, rtol=0, atol=0)
    loss = comera.loss(F.cross_entropy(model(x), y))  # and training goes on
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert math.isfinite(float(loss.detach()))


def _dying_mid_bond(make_opt) -> tuple:  # noqa: ANN001
    """A TT PixelNet trained 3 steps by ``make_opt``'s optimizer, then two entries of its
    middle layer's middle bond set below the threshold: the next step truncates."""
    torch.manual_seed(0)
    model = PixelNet(dim=16, hidden=64).double()
    ce.tensorize(model, rank=6, exclude=["head"])
    comera = ce.CoMERA(model)
    opt = make_opt(comera.param_groups())
    x, y = torch.randint(0, 17, (32, 64)), torch.randint(0, 10, (32,))

    def train_step() -> torch.Tensor:
        loss = comera.loss(F.cross_entropy(model(x), y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    for _ in range(3):
        train_step()
        comera.step(opt)
    with torch.no_grad():
        model.mid.tt.gates[1][[1, 4]] = 1e-3
    return model, comera, opt, x, train_step


def test_a_graph_kept_alive_defers_truncation_instead_of_breaking_backward(capsys) -> None:
    """A graph built before and kept without its backward (a validation loss outside
    ``no_grad``) that saved a core for its backward holds it, so the core cannot be
    swapped for its sliced self: sliced through ``.data`` instead, the next backward
    failed inside torch against the old shape. The dead entries stay masked (outputs
    unchanged), said once, and are sliced at the first step after the graph is gone.
    A kept validation loss whatever its graph saved: training goes on."""
    model, comera, opt, x, train_step = _dying_mid_bond(lambda g: torch.optim.AdamW(g))
    allocated = model.mid.tt.ranks[2]
    # saves the cores themselves (a product's backward needs both factors)
    kept = sum((c * c).sum() for c in model.mid.tt.cores)
    with torch.no_grad():
        before = model(x)
    events = comera.step(opt)
    assert [e.kind for e in events] == ["rank_change"]  # died, not sliced
    assert model.mid.tt.ranks[2] == allocated and model.mid.effective_ranks()[1] == allocated - 2
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=1e-12, atol=1e-12)
    assert capsys.readouterr().err.count("keep their dead rank entries masked") == 1
    for _ in range(2):
        train_step()  # the backward that failed before
        assert comera.step(opt) == []
    assert "masked" not in capsys.readouterr().err  # said once
    del kept
    train_step()
    assert [e.kind for e in comera.step(opt)] == ["truncate"]
    assert model.mid.tt.ranks[2] == allocated - 2
    assert math.isfinite(float(train_step().detach()))

    model, comera, opt, x, train_step = _dying_mid_bond(lambda g: torch.optim.AdamW(g))
    val = F.cross_entropy(model(x), torch.zeros(32, dtype=torch.long))  # kept, no backward
    comera.step(opt)
    for _ in range(2):
        assert math.isfinite(float(train_step().detach()))
        comera.step(opt)
    del val
    train_step()
    comera.step(opt)
    assert model.mid.tt.ranks[2] == allocated - 2  # sliced by now, either way


def test_optimizer_state_it_cannot_slice_starts_afresh() -> None:
    """Adafactor keeps row and column factors, not tensors shaped like the parameter:
    those of a sliced core cannot be cut to the kept entries, so that parameter's state
    starts afresh (its step count at 0), the others' go on; before, its next step failed
    inside torch on the old shapes."""
    model, comera, opt, x, train_step = _dying_mid_bond(lambda g: torch.optim.Adafactor(g))
    left, other = model.mid.tt.cores[1], model.mid.tt.cores[0]
    assert int(opt.state[left]["step"]) == int(opt.state[other]["step"]) == 3
    events = comera.step(opt)
    assert [e.kind for e in events] == ["rank_change", "truncate"]
    assert left not in opt.state and int(opt.state[other]["step"]) == 3
    loss = train_step()
    assert int(opt.state[left]["step"]) == 1 and int(opt.state[other]["step"]) == 4
    assert math.isfinite(float(loss.detach()))


def test_events_reach_the_callback_and_bf16_autocast_trains(digits) -> None:
    seen: list[ce.rank.Event] = []
    torch.manual_seed(0)
    config = ce.CoMERAConfig(target_compression=TARGET, switch=20)
    model = ce.tensorize(PixelNet(), config, exclude=["head"])
    comera = ce.CoMERA(model, config, total_steps=120, on_event=seen.append)
    opt = torch.optim.AdamW(comera.param_groups(), lr=LR)
    for step in range(120):
        x, y = _batch(digits, step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            task = F.cross_entropy(model(x), y)
        loss = comera.loss(task)
        opt.zero_grad()
        loss.backward()
        opt.step()
        comera.step(opt)
        assert math.isfinite(float(loss.detach()))
    assert seen == comera.events and {"stage", "target_met"} <= {e.kind for e in seen}
    assert abs(comera.report()["compression"] / TARGET - 1) <= 0.05


def test_gradient_accumulation_matches_the_whole_batch_float64(digits) -> None:
    """Each step as two micro-batches of 32 (``comera.loss`` on each, divided by 2,
    ``comera.step`` once) against one batch of 64 (float64): the same parameters through
    the early stage (the rank terms count once a step), the same stage switch and the
    same plateau loss ``z_f`` (the mean of the micro-batches' losses, not the last)."""
    def run(parts: int) -> tuple:
        torch.manual_seed(0)
        config = ce.CoMERAConfig(target_compression=TARGET, switch=40)
        model = ce.tensorize(PixelNet(), config, exclude=["head"]).double()
        comera = ce.CoMERA(model, config, total_steps=STEPS)
        opt = torch.optim.AdamW(comera.param_groups(), lr=LR)
        x0, y0 = _batch(digits, 0)
        with torch.no_grad():
            first = float(F.cross_entropy(model(x0), y0))
        for step in range(40):
            x, y = _batch(digits, step)
            opt.zero_grad()
            for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
                (comera.loss(F.cross_entropy(model(xs), ys)) / parts).backward()
            opt.step()
            comera.step(opt)
        with torch.no_grad():  # it trained on the task, not on the rank terms alone
            assert float(F.cross_entropy(model(x0), y0)) < 0.5 * first
        return model, comera

    whole, whole_c = run(1)
    acc, acc_c = run(2)
    assert whole_c.stage == acc_c.stage == "late"
    assert acc_c.state_dict()["z_f"] == pytest.approx(whole_c.state_dict()["z_f"], rel=1e-9)
    assert acc_c.state_dict()["plateau"] == pytest.approx(whole_c.state_dict()["plateau"],
                                                          rel=1e-9)
    for (name, a), b in zip(whole.named_parameters(), acc.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-8, atol=1e-10, msg=name)


def test_plain_model_trains_on_the_task_loss_alone() -> None:
    model = PixelNet()
    comera = ce.CoMERA(model, lr_dense=1e-3)
    assert [g["name"] for g in comera.param_groups()] == ["dense"]
    task = F.cross_entropy(model(torch.randint(0, 17, (4, 64))), torch.tensor([0, 1, 2, 3]))
    assert comera.loss(task) is task and comera.step() == []
    rep = comera.report()
    assert rep["compression"] == 1.0 and rep["message"].endswith("no target")


def test_bad_settings_and_unreachable_targets_are_refused_in_one_line() -> None:
    model = PixelNet()
    with pytest.raises(ConfigError, match="comera.gama") as info:
        ce.CoMERA(model, gama=0.1)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="comera.tau"):
        ce.CoMERA(model, tau=2.0)
    with pytest.raises(ConfigError, match="total_steps"):
        ce.CoMERA(model, total_steps=-5)
    with pytest.raises(ConfigError, match="^rank"):
        ce.tensorize(model, rank="auto")
    with pytest.raises(ConfigError, match="^config: give a comera_engine.CoMERAConfig"):
        ce.tensorize(model, 20)  # the target is a config's, not an argument
    with pytest.raises(ConfigError, match="^config: give a comera_engine.CoMERAConfig"):
        ce.CoMERA(model, 20)
    with pytest.raises(ConfigError, match="target_compression") as info:
        ce.tensorize(model, ce.CoMERAConfig(target_compression=1e6), exclude=["head"])
    assert "\n" not in str(info.value) and "choose at most" in str(info.value)
    assert not tt_layers(model)  # nothing was replaced
    with pytest.raises(ConfigError, match="rank"):  # rank 8 is already smaller than 1.5x
        ce.tensorize(model, ce.CoMERAConfig(target_compression=1.5), rank=8, exclude=["head"])
    assert not tt_layers(model)
    # a pattern naming no layer (a typo) would leave "haed" dense and make the head TT
    with pytest.raises(ConfigError, match="^exclude: 'haed' matches none") as info:
        ce.tensorize(model, rank=4, exclude=["haed"])
    assert "table, up, mid, head" in str(info.value)  # the names it could have meant
    with pytest.raises(ConfigError, match="^include: 'blocks.*' matches none"):
        ce.tensorize(model, rank=4, include=["blocks.*"])
    assert not tt_layers(model)
    # tied weights are not cut silently: two linears sharing one matrix are refused; an
    # output layer sharing the embedding's matrix decodes through the TT table
    shared = PixelNet(dim=32, hidden=32)
    shared.mid.weight = shared.up.weight
    with pytest.raises(ConfigError, match="^exclude: 'up' shares its weight with 'mid'"):
        ce.tensorize(shared, rank=4)
    assert not tt_layers(shared) and shared.mid.weight is shared.up.weight
    ce.tensorize(shared, rank=4, exclude=["up", "mid"])  # the fix it names
    assert shared.mid.weight is shared.up.weight and tt_layers(shared)
    tied = PixelNet(dim=32, hidden=32)
    tied.head = nn.Linear(32, 64 * 17)
    tied.head.weight = tied.table.weight
    ce.tensorize(tied, rank=4)
    assert isinstance(tied.head, TiedDecoder) and tied.head.embedding is tied.table


def test_auto_ranks_start_at_the_headroom_the_trainer_uses() -> None:
    """``rank="auto"`` starts at the smallest rank whose TT layers are ``headroom`` times
    the target size (counted independently here), as ``comera train`` does."""
    model = ce.tensorize(PixelNet(), ce.CoMERAConfig(target_compression=TARGET, headroom=3.0),
                         exclude=["head"])
    rows = size_report(model)["layers"]
    dense = sum(r["dense_params"] for r in rows)
    start = sum(r["allocated_params"] for r in rows)
    assert start >= 3.0 * dense / TARGET
    rank = max(model.mid.tt.ranks)
    smaller = PixelNet()
    ce.tensorize(smaller, rank=rank - 1, exclude=["head"])
    below = sum(r["allocated_params"] for r in size_report(smaller)["layers"])
    assert below < 3.0 * dense / TARGET


_DDP_LOOP = """
import json, os, sys
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
sys.path.insert(0, sys.argv[2])
import comera_engine as ce
from test_controller import PixelNet

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
torch.manual_seed(0)  # the same initial model in both processes
config = ce.CoMERAConfig(target_compression=8, switch="plateau", plateau_patience=5,
                         plateau_min_delta=0.05, gamma=0.5, lr_gates=5e-2)
model = ce.tensorize(PixelNet(dim=16, hidden=64), config, exclude=["head"])
comera = ce.CoMERA(model, config, total_steps=90)
opt = torch.optim.AdamW(comera.param_groups(), lr=3e-3)
ddp = DDP(model)
g = torch.Generator().manual_seed(1 + rank)  # each process its own examples
x = torch.randint(0, 17, (90, 32, 64), generator=g)
y = (x[..., :8].sum(-1) % 10)  # a task the loss can learn, different per process
out = {"lambda": [], "switch": None}
for step in range(90):
    loss = comera.loss(F.cross_entropy(ddp(x[step]), y[step]))
    opt.zero_grad()
    loss.backward()
    opt.step()
    events = comera.step(opt, truncate=False)  # no shape change under a live DDP wrapper
    out["lambda"].append(float(comera.info["lambda"]))
    if any(e.kind == "stage" for e in events):
        out["switch"] = comera.steps_done
del ddp
comera.truncate(opt)  # what a loop does when it rebuilds the wrapper
out["ranks"] = comera.report()["ranks"]
out["z_f"] = comera.state_dict()["z_f"]  # the smoothed loss the plateau judged
out["shapes"] = {n: list(p.shape) for n, p in model.named_parameters()}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as fh:
    json.dump(out, fh)
dist.destroy_process_group()
"""


def run_two_processes(script: str, folder: Path, *args: str, timeout: int) -> tuple:
    """``script`` under torchrun in two gloo processes (1 thread each), with ``folder`` and
    this tests folder as its first arguments (then ``args``); each process writes
    ``rank{r}.json`` into ``folder``: the two, read back."""
    path = folder / "ddp_script.py"
    path.write_text(script)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(path), str(folder), str(root / "tests"), *args],
        cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tuple(json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1))


def test_ddp_processes_agree_on_the_switch_lambda_and_ranks(tmp_path) -> None:
    """Two gloo processes, each with its own examples (so its own loss), in a
    hand-written DDP loop: the plateau and λ are judged on the loss averaged over the
    processes, so both switch at the same step with the same plateau loss ``z_f`` (each
    process's own loss gives each its own), take the same λ at every step and end at the
    same ranks."""
    a, b = run_two_processes(_DDP_LOOP, tmp_path, timeout=180)
    assert a["switch"] is not None and a["switch"] == b["switch"] and a["z_f"] == b["z_f"]
    assert a["lambda"] == b["lambda"] and {0.0, 1.0} <= set(a["lambda"])
    assert a["ranks"] == b["ranks"] and a["shapes"] == b["shapes"]


def test_schedules_set_every_switch_and_a_switch_set_against_one_is_named() -> None:
    """``comera.schedule`` names the method; each addition of ours is its own switch with
    the schedule's value unless set, and a switch set against the schedule is named."""
    from comera_engine.config import SCHEDULE_NAMES, CoMERAConfig
    from comera_engine.rank.schedule import SCHEDULES, resolve_schedule, schedule_label

    assert tuple(SCHEDULES) == SCHEDULE_NAMES  # the names the config accepts, each defined
    switches = set(SCHEDULES["paper"])
    assert set(SCHEDULES["comera"]) == set(SCHEDULES["paced"]) == switches
    for name, values in SCHEDULES.items():
        resolved = resolve_schedule(CoMERAConfig(schedule=name))
        assert {k: getattr(resolved, k) for k in switches} == values
        assert schedule_label(resolved) == name
    assert not SCHEDULES["paper"]["pace"] and not SCHEDULES["comera"]["pace"]
    assert SCHEDULES["paced"]["pace"] and SCHEDULES["comera"]["rank_floor"]
    model = PixelNet()
    ce.tensorize(model, rank=8, exclude=["head"])
    comera = ce.CoMERA(model, target_compression=2.0, total_steps=100, schedule="comera",
                       pace=True)
    assert comera.schedule == "comera (pace on)" and comera.report()["schedule"] == comera.schedule
    assert comera.cfg.pace and comera.cfg.late_norm == "current"
    assert ce.CoMERA(model, target_compression=2.0).schedule == "paced"
    with pytest.raises(ConfigError, match="comera.schedule"):
        ce.CoMERA(model, schedule="papr")
    from comera_engine.rank.schedule import method_label  # what cards and run records say

    assert method_label({"comera": {"schedule": "paper"}}) == "CoMERA, schedule paper"
    assert method_label({"comera": {"schedule": "comera", "pace": True}}) == (
        "CoMERA, schedule comera (pace on)")
    assert method_label({"comera": {"method": "fixed"}}) == "fixed-rank TT"
    assert method_label({"model": {"dense": True}}) == "dense baseline"
    # the peers each by its own name (Compare's legend tells them apart by it)
    assert method_label({"comera": {"method": "fixed"}, "model": {"tt_impl": "tltorch"}}) == (
        "fixed-rank TT (tltorch)")
    tt_svd = {"comera": {"method": "tt_svd"}, "train": {"steps": 0}}
    assert method_label(tt_svd) == "TT-SVD of a dense run"
    assert method_label({**tt_svd, "train": {"steps": 150}}) == (
        "TT-SVD of a dense run, fine-tuned")
    assert method_label({"model": {"dense": True, "quantize": "int8"}}) == (
        "int8 weights (torchao) of a trained dense or pruned run")
    assert method_label({"model": {"quantize": "int8"}}) == "int8 TT cores of a trained TT run"
    peer = {"model": {"dense": True, "kwargs": {"peer": "hash", "target": 100.0}}}
    assert method_label(peer) == "hashing-trick embedding tables"
    peer["model"]["kwargs"]["peer"] = "dense"  # the embedding task's baseline
    assert method_label(peer) == "dense baseline"


def test_the_optimizer_owns_the_rates_and_the_gates_follow_the_schedule(capsys) -> None:
    """``param_groups()`` leaves the cores', embeddings' and dense parameters' rate (and
    weight decay) to the optimizer unless set on the controller; the gates learn at
    ``(1 - tau) / (0.1 · steps to the target)`` (the pace's reach step, else the last
    step), a set ``lr_gates`` replaces it (raised to it with ``gate_speed``), and without
    a budget the optimizer's rate applies. What CoMERA set is printed once. Checked on
    the optimizer's groups, against the rule by hand."""
    def rates(**kw) -> dict[str, float]:  # noqa: ANN003
        model = ce.tensorize(PixelNet(), rank=8, exclude=["head"])
        comera = ce.CoMERA(model, target_compression=2.0, tau=0.01, **kw)
        opt = torch.optim.AdamW(comera.param_groups(), lr=7e-4)
        return {g["name"]: g["lr"] for g in opt.param_groups}

    # the pace (the default schedule) has the size at the target by reach_at 0.8 of 800
    assert rates(total_steps=800) == pytest.approx(
        {"cores": 7e-4, "gates": 0.99 / (0.1 * 640), "dense": 7e-4})
    assert "gates 0.0155 (from the schedule); cores, dense at the optimizer's" in (
        capsys.readouterr().err)
    # without the pace, the run's last step
    assert rates(total_steps=1000, schedule="comera")["gates"] == pytest.approx(
        0.99 / (0.1 * 1000))
    # set on the controller: replaced; gate_speed raises a slow lr_gates to the schedule's
    assert rates(total_steps=1000, lr_gates=1e-3, lr_cores=2e-3) == {
        "cores": 2e-3, "gates": 1e-3, "dense": 7e-4}
    assert rates(total_steps=800, lr_gates=1e-3, gate_speed=True)["gates"] == pytest.approx(
        0.99 / (0.1 * 640))
    # no step budget: no schedule to pace the gates by, the optimizer's rate
    assert rates()["gates"] == 7e-4
    assert all(g["weight_decay"] == 0.0 for g in ce.CoMERA(
        ce.tensorize(PixelNet(), rank=4, exclude=["head"]), weight_decay=0.0).param_groups())


@pytest.mark.parametrize("attached", [True, False])
def test_a_scheduler_of_the_users_decays_every_rate_but_the_gates(digits, capsys,
                                                                  attached: bool) -> None:
    """The README's loop with torch's ``CosineAnnealingLR`` over every group, as a user
    writes it for the dense network: each optimizer step runs the cores and the dense
    parameters at the cosine's rate (torch's closed form) and the gates at the schedule's
    own (``lr_gates``), whether the controller is attached or stepped by hand; that the
    gates' rate was set back is said once."""
    model, comera, opt = _setup()
    if attached:
        comera.attach(opt)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=24)
    used = []
    opt.register_step_post_hook(
        lambda o, *_: used.append({g["name"]: g["lr"] for g in o.param_groups}))
    for step in range(12):
        _train(model, comera, opt, digits, step, step + 1, attached=attached)
        sched.step()
    cosine = [LR * 0.5 * (1 + math.cos(math.pi * t / 24)) for t in range(12)]
    assert [u["gates"] for u in used] == [comera.lr_gates()] * 12
    assert [u["cores"] for u in used] == pytest.approx(cosine, rel=1e-6)
    assert [u["dense"] for u in used] == pytest.approx(cosine, rel=1e-6)
    assert cosine[-1] < 0.6 * LR  # the cosine did move the rates
    err = capsys.readouterr().err
    assert err.count("a learning-rate scheduler moved it); it is set to") == 1
    # and that the rates fall long before the pace fixes the ranks (step 288 of 360)
    assert err.count("the learning rates fall (to 0.") == 1 and "before step 288" in err


def test_the_usual_no_decay_groups_with_the_gates_apart_train_them_without_decay(
        digits, capsys) -> None:
    """The usual ``no_decay`` pattern written by hand, the gates in a group of their own
    as the refusal of mixed groups asks: AdamW gives that group its default weight decay
    (0.01), which would pull every gate to 0; the first step sets it to 0 and the rate to
    the gates' own, each said once, naming what the group had."""
    model, comera, _ = _setup()
    gates = [p for n, p in model.named_parameters() if n.endswith("tt.gate")]
    rest = [(n, p) for n, p in model.named_parameters() if not n.endswith("tt.gate")]
    opt = torch.optim.AdamW([
        {"params": gates},
        {"params": [p for n, p in rest if not n.endswith("bias")], "weight_decay": 0.1},
        {"params": [p for n, p in rest if n.endswith("bias")], "weight_decay": 0.0}], lr=LR)
    comera.attach(opt)
    _train(model, comera, opt, digits, 0, 3, attached=True)
    assert opt.param_groups[0]["weight_decay"] == 0.0
    assert opt.param_groups[0]["lr"] == comera.lr_gates()
    assert [g["weight_decay"] for g in opt.param_groups[1:]] == [0.1, 0.0]  # the user's
    err = capsys.readouterr().err
    assert err.count("the rank gates' group had weight_decay 0.01") == 1
    assert err.count(f"the rank gates' learning rate was {LR:.3g} (a group of your own") == 1


def test_ce_lr_scheduler_decays_once_the_ranks_are_fixed(digits, capsys) -> None:
    """``ce.lr_scheduler(opt, "cosine", comera=comera)`` in the README's loop: each step
    runs the cores and the dense parameters at the base rate until ``reach_step`` and on
    a cosine to 0 from there (written out here), the gates at their own rate throughout;
    the run lands at its target, and nothing is said about falling rates."""
    model, comera, opt = _setup()
    comera.attach(opt)
    sched = ce.lr_scheduler(opt, "cosine", comera=comera)
    used = []
    opt.register_step_post_hook(
        lambda o, *_: used.append({g["name"]: g["lr"] for g in o.param_groups}))
    for step in range(STEPS):
        _train(model, comera, opt, digits, step, step + 1, attached=True)
        sched.step()
    hold = comera.reach_step
    want = [LR if t < hold else LR * 0.5 * (1 + math.cos(math.pi * (t - hold) / (STEPS - hold)))
            for t in range(STEPS)]
    assert hold == 288 and [u["cores"] for u in used] == pytest.approx(want, rel=1e-9)
    assert [u["dense"] for u in used] == pytest.approx(want, rel=1e-9)
    assert {u["gates"] for u in used} == {comera.lr_gates()}
    assert abs(comera.report()["compression"] / TARGET - 1) <= 0.05
    assert "learning rates fall" not in capsys.readouterr().err
    with pytest.raises(ValueError, match="steps must be a positive int"):
        ce.lr_scheduler(opt, "cosine")
    with pytest.raises(ValueError, match="schedule must be constant, cosine or linear"):
        ce.lr_scheduler(opt, "step", comera=comera)


def test_reach_step_is_where_the_pace_fixes_the_ranks(trained) -> None:
    """``CoMERA.reach_step``: the pace's ``reach_at`` of the steps (where a decaying
    learning rate can start), ``None`` without the pace; and a run paced to it has fixed
    its ranks by then."""
    def reach(**kw) -> int | None:  # noqa: ANN003
        model = ce.tensorize(PixelNet(), rank=8, exclude=["head"])
        return ce.CoMERA(model, **kw).reach_step

    assert reach(target_compression=2.0, total_steps=800) == 640
    assert reach(target_compression=2.0, total_steps=800, switch_by=0.3, reach_at=0.5) == 400
    assert reach(target_compression=2.0, total_steps=800, schedule="comera") is None
    assert reach(target_compression=2.0) is None and reach(total_steps=800) is None
    _, comera, _ = trained  # the README's loop, paced to its target
    assert comera.reach_step == math.ceil(0.8 * STEPS)
    met = [e.step for e in comera.events if e.kind == "target_met"]
    assert len(met) == 1 and met[0] <= comera.reach_step


def _sgd_setup(seed: int = 0, steps: int = STEPS, double: bool = False) -> tuple:
    """The README's loop with the user's SGD (momentum 0.9) instead of AdamW."""
    torch.manual_seed(seed)
    config = ce.CoMERAConfig(target_compression=TARGET, switch=60)
    model = ce.tensorize(PixelNet(), config, exclude=["head"])
    model = model.double() if double else model
    comera = ce.CoMERA(model, config, total_steps=steps)
    opt = torch.optim.SGD(comera.param_groups(), lr=0.05, momentum=0.9)
    return model, comera, opt


def _gates(model: nn.Module) -> list[torch.Tensor]:
    return [m.tt.gate for _, m in tt_layers(model)]


def test_under_sgd_the_gates_take_adam_steps_and_sgd_passes_them_over(digits, capsys):
    """SGD moves a parameter by its rate times the gradient, so under it the gates take
    their own Adam steps at the schedule's rate, before SGD's (float64): the first moves
    every gate entry by the rate (Adam's first step, ``lr·g/(|g|+eps)``), SGD keeps no
    state for the gates and moves the rest by ``-lr·grad``; said once on stderr. Over 30
    steps the run equals, bit for bit, a hand-written loop with an Adam over the gates
    stepped before an SGD over the other groups."""
    model, comera, opt = _sgd_setup(double=True)
    rate = comera.lr_gates()
    comera.attach(opt)
    assert "SGD steps by its learning rate times the gradient; the gates take their own " \
           f"Adam steps at {rate:.3g}" in capsys.readouterr().err
    gates = _gates(model)
    others = [p for p in model.parameters() if all(p is not g for g in gates)]
    x, y = _batch(digits, 0)
    loss = comera.loss(F.cross_entropy(model(x), y))
    opt.zero_grad()
    loss.backward()
    before = [p.detach().clone() for p in gates + others]
    grads = [p.grad.clone() for p in gates + others]
    opt.step()
    for g, old, grad in zip(gates, before, grads):
        step = rate * grad.abs() / (grad.abs() + 1e-8)  # Adam's first, bias-corrected
        torch.testing.assert_close(old - g.detach(), step * grad.sign(), rtol=1e-9, atol=0)
        assert float(step.min()) > 0.9 * rate  # every entry moved by about the rate
        assert g not in opt.state and g.grad is None
    grads = grads[len(gates):]
    for p, old, grad in zip(others, before[len(gates):], grads):
        torch.testing.assert_close(p.detach(), old - 0.05 * grad, rtol=1e-12, atol=1e-15)
    _train(model, comera, opt, digits, 1, 30, attached=True)
    assert capsys.readouterr().err == ""  # said once

    ref, ref_comera, _ = _sgd_setup(double=True)
    ref_gates = _gates(ref)
    adam = torch.optim.Adam(ref_gates, lr=rate)
    sgd = torch.optim.SGD([{"params": [p for p in g["params"]
                                       if all(p is not q for q in ref_gates)]}
                           for g in ref_comera.param_groups()], lr=0.05, momentum=0.9)
    for step in range(30):
        x, y = _batch(digits, step)
        loss = ref_comera.loss(F.cross_entropy(ref(x), y))
        sgd.zero_grad()
        adam.zero_grad()
        loss.backward()
        adam.step()
        sgd.step()
        ref_comera.step(sgd)
    assert ref_comera.events == comera.events == []  # no gate died yet: nothing truncated
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name


def test_under_sgd_a_resume_in_either_order_goes_on_exactly(digits):
    """With the gates' own Adam: its state is sliced with the gates at each truncation,
    kept in the controller's state as plain values (through JSON here), and a run rebuilt
    from state dicts alone, the controller's loaded before or after ``attach``, goes on as
    the uninterrupted one."""
    whole = _sgd_setup()
    whole[1].attach(whole[2])
    whole_losses = _train(*whole, digits, 0, 200, attached=True)
    model, comera, opt = _sgd_setup()
    comera.attach(opt)
    _train(model, comera, opt, digits, 0, 100, attached=True)
    assert comera.stage == "late" and any(e.kind == "truncate" for e in comera.events)
    adam = comera._gate_adam.adam
    for gate in _gates(model):  # sliced with the gates
        assert {k: v.shape for k, v in adam.state[gate].items() if v.dim()} == {
            "exp_avg": gate.shape, "exp_avg_sq": gate.shape}
    saved = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
             "comera": json.loads(json.dumps(comera.state_dict()))}
    assert set(saved["comera"]["gate_adam"]) == {"0", "1", "2"}
    for order in ("controller, then attach", "attach, then controller"):
        again, resumed, opt2 = _sgd_setup(seed=123)
        if order == "controller, then attach":
            resumed.load_state_dict(copy.deepcopy(saved["comera"]))
            resumed.attach(opt2)
        else:
            resumed.attach(opt2)
            resumed.load_state_dict(copy.deepcopy(saved["comera"]))
        again.load_state_dict(saved["model"])
        opt2.load_state_dict(copy.deepcopy(saved["opt"]))
        losses = _train(again, resumed, opt2, digits, 100, 200, attached=True)
        assert losses == pytest.approx(whole_losses[100:], rel=1e-6, abs=1e-7), order
        assert resumed.report()["ranks"] == whole[1].report()["ranks"], order
        assert resumed.stage == whole[1].stage == "fixed", order


def test_a_diverging_run_is_stopped_before_its_ranks_are_judged(digits) -> None:
    """SGD at a rate the TT layers cannot take: the step whose task loss is not finite
    raises, naming the step and the fix, before any gate entry is made dead by a NaN
    (the optimizer has stepped the NaN into the weights by then; a checkpoint is the way
    back) or the stage moves."""
    model, comera, opt = _sgd_setup()
    for group in opt.param_groups:
        group["lr"] = 5.0
    comera.attach(opt)
    alive = [m.tt.alive.clone() for _, m in tt_layers(model)]
    with pytest.raises(FloatingPointError,
                       match=r"the task loss is nan at step (\d+): training diverged; lower "
                             r"the learning rate") as raised:
        _train(model, comera, opt, digits, 0, 50, attached=True)
    assert isinstance(raised.value, ce.TrainingDiverged) and math.isnan(raised.value.loss)
    at = raised.value.step
    assert f"at step {at}:" in str(raised.value)
    assert 1 < at < 50 and comera.steps_done == at - 1
    assert comera.stage == "early" and comera.removed == {"objective": 0, "pace": 0}
    for (_, m), before in zip(tt_layers(model), alive):
        assert torch.equal(m.tt.alive, before)


def test_attach_runs_the_step_after_the_optimizers_and_a_second_call_is_refused(digits):
    """``attach`` registers the controller's step as the optimizer's post-step hook: the
    same run as calling ``step`` by hand, bit for bit; calling ``step`` while attached is
    refused (it would run twice), and ``remove()`` detaches."""
    by_hand = _setup(steps=80)
    _train(*by_hand, digits, 0, 80)
    model, comera, opt = _setup(steps=80)
    handle = comera.attach(opt)
    with pytest.raises(RuntimeError, match="attached"):
        comera.attach(opt)
    _train(model, comera, opt, digits, 0, 80, attached=True)
    assert comera.steps_done == 80 and comera.events == by_hand[1].events
    for a, b in zip(model.parameters(), by_hand[0].parameters()):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="drop the comera.step call"):
        comera.step(opt)
    # a second controller on the same model (a notebook cell run twice) attached to the
    # same optimizer would add its rank terms and prune the same gates too: refused
    again = ce.CoMERA(model, ce.CoMERAConfig(target_compression=TARGET), total_steps=80)
    with pytest.raises(ConfigError, match="^optimizer: already attached to another CoMERA"):
        again.attach(opt)
    handle.remove()
    opt.step()  # no longer steps the controller
    assert comera.steps_done == 80 and comera.step(opt) is not None
    again.attach(opt).remove()  # once the first is detached, another may attach


def test_a_validation_loss_through_comera_loss_changes_nothing(digits) -> None:
    """``comera.loss`` on a validation batch under ``torch.no_grad()`` every few steps
    (a loop that passes every loss through it): returned as it is and not counted, so
    the run is the one without it, bit for bit (it was taken for a micro-batch of the
    next step, moving the plateau's reference loss 40-fold); a float is refused."""
    plain = _setup(steps=120)
    _train(*plain, digits, 0, 120)
    model, comera, opt = _setup(steps=120)
    x_val, y_val = _batch(digits, 999)
    for start in range(0, 120, 10):  # a validation pass every 10 steps
        _train(model, comera, opt, digits, start, start + 10)
        with torch.no_grad():
            val = F.cross_entropy(model(x_val), y_val)
            assert comera.loss(val) is val
    assert comera.events == plain[1].events
    assert comera.state_dict()["z_f"] == plain[1].state_dict()["z_f"]
    for a, b in zip(model.parameters(), plain[0].parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ConfigError, match="^task_loss: give the loss tensor .* got float"):
        comera.loss(1.0)
    per_sample = F.cross_entropy(model(x_val), y_val, reduction="none")  # not reduced
    with pytest.raises(ConfigError, match=r"^task_loss: give the scalar loss .* got shape "
                                          r"\(64,\)"):
        comera.loss(per_sample)
    assert comera.loss(per_sample.mean().reshape(1)).numel() == 1  # one value: a loss


def test_an_optimizer_over_model_parameters_is_refused_before_its_rate_is_touched(
        capsys) -> None:
    """``torch.optim.AdamW(model.parameters(), lr)``: the gates share the model's group,
    whose rate the controller would overwrite with the gates' (the user's rate lost on
    every core and head, said as if a scheduler had moved it). Refused in one line at
    ``attach`` (and at a hand-called step), the user's rate untouched; an optimizer
    holding no gate is said once (another optimizer may step them)."""
    model, comera, _ = _setup()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for call in (lambda: comera.attach(opt), lambda: comera.step(opt, loss=1.0)):
        with pytest.raises(ConfigError, match=r"^optimizer: a param group holds the rank "
                                              r"gates with other parameters .*"
                                              r"comera\.param_groups\(\)"):
            call()
        assert [g["lr"] for g in opt.param_groups] == [1e-3]
    gates = {id(g) for g in _gates(model)}
    rest = torch.optim.AdamW([p for p in model.parameters() if id(p) not in gates], lr=1e-3)
    comera.attach(rest)
    assert "holds none of the rank gates" in capsys.readouterr().err


def test_the_paper_schedule_lets_a_bond_reach_rank_zero_and_plateaus_at_chance() -> None:
    """Without the rank floor a bond whose every gate falls below the threshold reaches
    rank 0 (the layer is the zero map and counts 0 parameters, as the spec says); with it
    (ours) the strongest entry stays. Without the plateau guard a loss still at its start
    counts as a plateau."""
    for schedule, floor in (("paper", 0), ("paced", 1)):
        torch.manual_seed(0)
        model = PixelNet(dim=16, hidden=64)
        ce.tensorize(model, rank=4, exclude=["head"])
        comera = ce.CoMERA(model, target_compression=2.0, schedule=schedule, switch="never")
        with torch.no_grad():
            model.mid.tt.gates[1].fill_(1e-3)  # below tau = 0.01
        events = comera.step(loss=1.0)
        assert model.mid.effective_ranks()[1] == floor
        assert [e.data["new"] for e in events if e.kind == "rank_change"] == [floor]
        row = next(r for r in size_report(model)["layers"] if r["name"] == "mid")
        assert (row["effective_params"] == model.mid.bias.numel()) == (floor == 0)
    for schedule, fires in (("paper", True), ("paced", False)):
        model = PixelNet()
        ce.tensorize(model, rank=4, exclude=["head"])
        detector = ce.CoMERA(model, schedule=schedule, plateau_patience=5).plateau
        assert any(detector.update(2.3) for _ in range(40)) == fires  # flat at chance


def test_without_the_pace_the_ranks_are_fixed_once_deaths_bring_the_size_to_the_target():
    """Schedule comera: the late stage's size terms are off at the target, and entries on
    their way down stop dying there (a target_met event, ranks fixed); the paper's keeps
    pruning past it."""
    for schedule, stops in (("comera", True), ("paper", False)):
        torch.manual_seed(0)
        model = PixelNet(dim=16, hidden=64)
        ce.tensorize(model, rank=4, exclude=["head"])
        comera = ce.CoMERA(model, target_compression=1.5, total_steps=100, schedule=schedule,
                           switch=1, balance=False)
        comera.step(loss=1.0)  # step 1: the late stage starts
        assert comera.stage == "late"
        target = float(comera.objective.target_size)
        with torch.no_grad():  # one bond's entries fall below tau: the size drops past it
            model.mid.tt.gates[1][1:].fill_(1e-3)
        events = comera.step(loss=1.0)
        assert comera.current_size() <= target
        assert any(e.kind == "target_met" for e in events) == stops
        assert comera.frozen == stops and (comera.stage == "fixed") == stops
        with torch.no_grad():  # later entries at the threshold die only without the stop
            model.up.tt.gates[0][1:].fill_(1e-3)
        comera.step(loss=1.0)
        assert (model.up.effective_ranks()[0] == 4) == stops


def test_a_fixed_rank_method_gets_gate_free_layers_at_the_target_size(digits) -> None:
    """``method="fixed"`` in the user's loop: ``tensorize`` plans each layer's ranks from
    the target as ``comera train`` does (the largest whose model is at most the target
    size; counted here against the dense layers), with frozen gates; trained, the report
    says the target was met, and a miss names the fixed ranks, not a late stage."""
    config = ce.CoMERAConfig(target_compression=TARGET, method="fixed")
    model = ce.tensorize(PixelNet(), config, exclude=["head"])
    rows = size_report(model)["layers"]
    dense = sum(r["dense_params"] for r in rows)
    size = sum(r["effective_params"] for r in rows) + sum(
        m.bias.numel() for _, m in tt_layers(model) if getattr(m, "bias", None) is not None)
    assert TARGET <= dense / sum(r["effective_params"] for r in rows)
    assert dense / size <= TARGET * 1.1  # not far below the size asked either
    gates = [m.tt.gate for _, m in tt_layers(model)]
    assert all(not g.requires_grad and bool((g == 1).all()) for g in gates)
    comera = ce.CoMERA(model, config, total_steps=40)
    opt = torch.optim.AdamW(comera.param_groups(), lr=3e-3)
    _train(model, comera, opt, digits, 0, 40)
    rep = comera.report()
    assert rep["stage"] == "plain" and rep["message"].startswith(f"target {TARGET:g}x · reached")
    assert "missed" not in rep["message"]
    # ranks given by hand below the target's size: the miss names the fixed ranks
    small = ce.tensorize(PixelNet(), ce.CoMERAConfig(method="fixed"), rank=12, exclude=["head"])
    rep = ce.CoMERA(small, config).report()  # no step budget: a verdict now
    assert "missed" in rep["message"] and "fixed keeps the ranks it starts at" in rep["message"]


def test_a_target_without_total_steps_is_said_once_and_named_in_a_miss(digits, capsys) -> None:
    """No step budget: no pace plans the size to the target; said once at the first step,
    and a miss names it rather than the late stage."""
    model = ce.tensorize(PixelNet(), ce.CoMERAConfig(target_compression=TARGET),
                         exclude=["head"])
    comera = ce.CoMERA(model, ce.CoMERAConfig(target_compression=TARGET))
    opt = torch.optim.AdamW(comera.param_groups(), lr=3e-3)
    _train(model, comera, opt, digits, 0, 3)
    err = capsys.readouterr().err
    assert err.count("target without total_steps") == 1, err
    rep = comera.report()
    assert "missed" in rep["message"] and "no total_steps" in rep["message"], rep["message"]


def test_tt_svd_from_pretrained_starts_from_the_weights_at_the_planned_ranks() -> None:
    """``method="tt_svd"`` with ``from_pretrained``: each layer is the TT-SVD of its own
    weight at the ranks planned for the target; a weight of TT rank 2 (made here from
    rank-2 cores) comes back to float rounding."""
    torch.manual_seed(0)
    low = TTLinear(256, 256, rank=2)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    with torch.no_grad():
        model[0].weight.copy_(low.dense_weight())
    weight = model[0].weight.detach().clone()
    ce.tensorize(model, ce.CoMERAConfig(target_compression=20, method="tt_svd"),
                 exclude=["2"], from_pretrained=True)
    assert isinstance(model[0], TTLinear) and min(model[0].effective_ranks()) >= 2
    assert size_report(model)["tensorized"]["compression"] >= 20
    torch.testing.assert_close(model[0].dense_weight(), weight, rtol=1e-4, atol=1e-5)


def test_a_loss_that_starts_below_one_scales_the_size_terms_and_resumes_so(digits, capsys):
    """``loss_scale``: the controller gives the objective where the task loss starts (its
    first value, recorded here), says once that it scales the size terms, and a controller
    resumed from the state dict has the same start."""
    model, comera, opt = _setup()
    seen = []
    for step in range(25):
        x, y = _batch(digits, step)
        task = 0.1 * F.cross_entropy(model(x), y)  # cross-entropy in other units
        seen.append(float(task.detach()))
        loss = comera.loss(task)
        opt.zero_grad()
        loss.backward()
        opt.step()
        comera.step(opt)
    start = seen[0]
    assert comera.objective.loss_start == pytest.approx(start, rel=1e-6)
    assert comera.objective.loss_scale() == pytest.approx(start / math.log(2), rel=1e-6)
    assert start < math.log(2)
    err = capsys.readouterr().err
    assert err.count("the size terms are weighed at") == 1, err
    again, resumed, _ = _setup()
    again.load_state_dict(model.state_dict())
    resumed.load_state_dict(comera.state_dict())
    assert resumed.objective.loss_start == pytest.approx(start, rel=1e-6)
    paper = ce.CoMERA(model, ce.CoMERAConfig(target_compression=TARGET, schedule="paper"))
    paper.objective.loss_start = start
    assert paper.objective.loss_scale() == 1.0  # the spec's objective as written
