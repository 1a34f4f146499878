"""``ops.adamw.AdamW`` (every group's update in one call of the CPU backend) against
``torch.optim.AdamW`` (the per-tensor loop, float64): parameters, state and
``state_dict`` over several steps of several groups; what it leaves to torch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from comera_engine.ops.adamw import AdamW

SHAPES = [(3, 4), (7,), (2, 3, 5), (1,), (256, 300)]  # the last split over threads


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES]


def _groups(params: list[torch.nn.Parameter]) -> list[dict]:
    """Two groups with their own lr, betas, eps and weight decay, and one of lr only."""
    return [{"params": params[:2], "lr": 3e-3, "weight_decay": 0.1},
            {"params": params[2:3], "lr": 1e-2, "weight_decay": 0.0, "betas": (0.8, 0.99),
             "eps": 1e-6},
            {"params": params[3:], "lr": 5e-2}]


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int,
           seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for k in range(steps):
        for i, p in enumerate(params):
            # one parameter without a gradient on odd steps: its state must not move
            p.grad = None if (i == 1 and k % 2) else torch.randn(p.shape, generator=g,
                                                                  dtype=p.dtype)
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_adamw_matches_torch_over_several_steps_and_groups(op_impl: str,
                                                           dtype: torch.dtype) -> None:
    mine, ref = _params(dtype), _params(dtype)
    opt = AdamW(_groups(mine))
    ref_opt = torch.optim.AdamW(_groups(ref), foreach=False)
    _train(opt, mine, 6)
    _train(ref_opt, ref, 6)
    # float32: the two round their products in another order (a few ulps)
    rtol, atol = (1e-12, 1e-14) if dtype == torch.float64 else (1e-5, 1e-7)
    for p, r in zip(mine, ref):
        torch.testing.assert_close(p, r, rtol=rtol, atol=atol)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[r][key], rtol=rtol,
                                       atol=atol)
        assert float(opt.state[p]["step"]) == float(ref_opt.state[r]["step"])
    # the state dict is torch's: it loads into a torch AdamW, which steps on the same
    again = torch.optim.AdamW(_groups([torch.nn.Parameter(p.detach().clone()) for p in mine]),
                              foreach=False)
    again.load_state_dict(opt.state_dict())
    assert again.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


def test_adamw_takes_the_backend_step_where_built(cpu_backend: object,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  count_calls: Callable) -> None:
    """With the backend the step does not reach torch's per-tensor kernel; without it,
    and with options the backend does not take (amsgrad), it does and agrees."""
    calls = count_calls(torch, "_fused_adamw_")
    params = _params(torch.float32)
    opt = AdamW(_groups(params))
    _train(opt, params, 2)
    assert calls == []
    monkeypatch.setenv("COMERA_NATIVE", "0")
    _train(opt, params, 1)
    assert calls  # torch's fused step, on the state the backend made
    calls.clear()
    monkeypatch.setenv("COMERA_NATIVE", "1")
    amsgrad, ref = _params(torch.float64), _params(torch.float64)
    opt = AdamW(amsgrad, lr=1e-2, amsgrad=True)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, amsgrad=True, foreach=False)
    _train(opt, amsgrad, 3)
    _train(ref_opt, ref, 3)
    for p, r in zip(amsgrad, ref):
        torch.testing.assert_close(p, r, rtol=1e-12, atol=1e-12)


def test_a_cpu_run_trains_checkpoints_and_resumes_without_importing_dynamo(
        cpu_backend_dir: Path, tmp_path: Path) -> None:
    """torch's Optimizer wraps ``add_param_group``, ``zero_grad``, ``state_dict`` and
    ``load_state_dict`` in a Dynamo "disable" whose first call imports Dynamo (about a
    second of every training process's start); this AdamW calls torch's functions
    unwrapped. ``comera train`` of digits on the CPU backend (steps, evaluations,
    checkpoints) and its ``--resume`` (the optimizer's state loaded back) never import
    ``torch._dynamo``. (That the state round-trips: the test above and every resume
    test.)"""
    import os

    from comera_engine.metrics import read_jsonl
    from tests.run_checks import heavy_imports

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "COMERA_CPU_BACKEND_DIR": str(cpu_backend_dir), "COMERA_NATIVE": "1",
           "COMERA_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    code = "import sys\nfrom comera_engine.cli import main\nassert main(sys.argv[1:]) == 0"

    def train(steps: int, *extra: str) -> list[str]:
        return heavy_imports(
            code, "train", "experiments/configs/digits_tt_mlp.toml", "--no-progress",
            "--run-dir", str(tmp_path / "run"), "--set", f"train.steps={steps}",
            "--set", "train.ckpt_every=20", "--set", "train.eval_every=20", *extra,
            env=env, cwd=root)

    assert train(40) == []
    assert train(60, "--resume") == []
    steps = [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")
             if r["type"] == "metrics" and "loss/task" in r["values"]]
    assert steps == list(range(1, 61))  # resumed from its checkpoint at step 40
