"""Benchmark: the AdamW step over every parameter group in one call
(comera_engine/ops/adamw.py) against torch's fused CPU AdamW (the reference), with the
CPU backend on and off, on the parameter shapes of two shipped TT models in their four
groups; prints a table and writes experiments/results/bench_op_adamw.json.

    python experiments/bench_op_adamw.py [--rounds 7] [--threads N]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import bench_op  # noqa: E402

from comera_engine.ops.adamw import AdamW  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CASES = [("digits TT MLP (14 tensors)", "digits_tt_mlp"),
         ("SNLI-tiny transformer (165 tensors)", "snli_transformer_tiny")]


def _groups(config: str) -> list[dict]:
    """The optimizer groups of the config's model at the ranks its run starts from."""
    from comera_engine.config import load_config
    from comera_engine.preview import data_shape
    from comera_engine.rank import CoMERA
    from comera_engine.runplan import plan_initial_ranks
    from comera_engine.train.methods import build_run_model

    cfg = load_config(ROOT / "experiments" / "configs" / f"{config}.toml", base_dir=ROOT)
    shape = data_shape(cfg.data)
    cfg, plan = plan_initial_ranks(cfg, shape)
    torch.manual_seed(0)
    return CoMERA(build_run_model(cfg, shape, plan), config=cfg.comera).param_groups()


def step(make: Callable[[list[dict]], torch.optim.Optimizer], config: str
         ) -> Callable[[], object]:
    groups = _groups(config)
    opt = make(groups)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=g) * 1e-3 for grp in groups for p in grp["params"]]
    params = [p for grp in groups for p in grp["params"]]

    def run() -> object:
        for p, gr in zip(params, grads):
            p.grad = gr
        opt.step()
        return None

    return run


if __name__ == "__main__":
    sys.exit(bench_op("adamw", [(label, step(AdamW, name),
                                 step(lambda gs: torch.optim.AdamW(gs, fused=True), name))
                                for label, name in CASES], what="optimizer step"))
