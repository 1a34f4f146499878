"""The trainer's learning-rate schedule (comera_engine/train/lr_schedule.py) against
torch's own schedulers, and its rates held as tensors (the CUDA-graph path) against
plain float rates."""

from __future__ import annotations

import pytest
import torch

from comera_engine.config import config_from_dict
from comera_engine.errors import ConfigError
from comera_engine.train.lr_schedule import lr_factor, rates_text, set_rates, tensor_rates


def _torch_factors(schedule: str, steps: int, warmup: int, hold: int = 0) -> list[float]:
    """The same curve from torch.optim.lr_scheduler (LinearLR warm-up, ConstantLR at 1
    until ``hold``, then CosineAnnealingLR or LinearLR to 0), read off an optimizer at
    rate 1."""
    from torch.optim import lr_scheduler as ls

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    start = max(warmup, hold)
    decay = steps - start
    tail = {"cosine": lambda: ls.CosineAnnealingLR(opt, T_max=decay, eta_min=0.0),
            "linear": lambda: ls.LinearLR(opt, 1.0, 0.0, total_iters=decay),
            "constant": lambda: ls.ConstantLR(opt, 1.0, total_iters=0)}[schedule]
    parts, milestones = [], []
    if warmup:
        parts.append(ls.LinearLR(opt, 1.0 / warmup, 1.0, total_iters=warmup - 1))
        milestones.append(warmup)
    if start > warmup and schedule != "constant":
        parts.append(ls.ConstantLR(opt, 1.0, total_iters=0))
        milestones.append(start)
    parts.append(tail())
    sched = ls.SequentialLR(opt, parts, milestones=milestones) if milestones else parts[0]
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
@pytest.mark.parametrize("warmup, hold", [(0, 0), (1, 0), (7, 0), (7, 30), (0, 12)])
def test_the_factor_follows_torchs_schedulers(schedule: str, warmup: int, hold: int) -> None:
    steps = 40
    ours = [lr_factor(i, steps, schedule, warmup, hold) for i in range(steps)]
    assert ours == pytest.approx(_torch_factors(schedule, steps, warmup, hold), rel=1e-9,
                                 abs=1e-12)
    assert min(ours) > 0  # no step at rate 0: the decay reaches 0 one step after the last
    if warmup:
        assert ours[0] == pytest.approx(1 / warmup) and ours[warmup] == pytest.approx(1.0)
    start = max(warmup, hold)
    if start:  # the last step before the decay runs at the full rate
        assert ours[start - 1] == pytest.approx(1.0)


def test_the_run_says_its_schedule_in_one_line() -> None:
    said = rates_text(600, "cosine", warmup=50, hold=480)
    assert said == ("learning rates: warm-up over 50 steps, held until step 480 (the pace "
                    "fixes the ranks by then), cosine decay to 0 at step 600; the rank "
                    "gates' rate is kept")
    assert rates_text(600, "linear") == ("learning rates: linear decay to 0 at step 600; "
                                         "the rank gates' rate is kept")
    assert "then constant" in rates_text(600, "constant", warmup=10, hold=480)


def test_rates_scale_every_group_but_the_gates() -> None:
    p = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    opt = torch.optim.AdamW([{"params": [p[0]], "name": "cores", "lr": 3e-3},
                             {"params": [p[1]], "name": "gates", "lr": 1e-2},
                             {"params": [p[2]], "name": "dense", "lr": 1e-3}])
    set_rates(opt, [3e-3, 1e-2, 1e-3], 0.5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1.5e-3, 1e-2, 5e-4])


def test_a_rate_held_as_a_tensor_steps_as_the_float_rate_does() -> None:
    """The graph path holds the rates as tensors and fills them in place (a captured step
    reads the new value): each step of the fused AdamW (the CUDA step's; capturable
    wants a GPU) moves the weights as the same optimizer given the rate as a float does."""
    torch.manual_seed(0)
    w0 = torch.randn(6)
    grads = [torch.randn(6) for _ in range(5)]

    def trained(as_tensor: bool) -> torch.Tensor:
        w = torch.nn.Parameter(w0.clone())
        opt = torch.optim.AdamW([{"params": [w], "name": "dense", "lr": 2e-2}],
                                fused=True)  # the CUDA step's implementation
        if as_tensor:
            tensor_rates(opt, torch.device("cpu"))
            assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
        for i, g in enumerate(grads):
            set_rates(opt, [2e-2], lr_factor(i, len(grads), "cosine", 2))
            w.grad = g.clone()
            opt.step()
        return w.detach()

    assert torch.allclose(trained(True), trained(False), rtol=1e-6, atol=1e-7)
    assert not torch.equal(trained(False), w0)


@pytest.mark.parametrize("key, value, says", [
    ("lr_schedule", "exponential", "train.lr_schedule"),
    ("warmup_steps", 50, "train.warmup_steps: must be below train.steps (50)"),
    ("warmup_steps", -1, "train.warmup_steps"),
])
def test_a_bad_schedule_is_one_line_naming_the_field(key: str, value: object,
                                                     says: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"data": {"name": "digits"}, "train": {"steps": 50, key: value}})
    assert says in str(err.value) and "\n" not in str(err.value)
