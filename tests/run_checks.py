"""Shared by tests that train a short real run through the CLI and check what it logged
(tests/test_export_raw.py, tests/test_shrink_peers.py), or what a fresh process imports
(tests/test_tensor.py, tests/test_models.py, tests/test_op_adamw.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: What building a model or training on the CPU should not import: Dynamo (with sympy,
#: FSDP and Triton, a second or more of a process's start) and sympy.
HEAVY = ("sympy", "torch._dynamo")


def heavy_imports(code: str, *args: str, env: dict[str, str] | None = None,
                  cwd: Path | None = None) -> list[str]:
    """Run ``code`` (with ``args`` as ``sys.argv[1:]``) in a fresh Python; the modules of
    :data:`HEAVY` it left imported, sorted. The code must run to its end."""
    tail = ("\nimport json as _j, sys as _s\n"
            f"print('HEAVY', _j.dumps(sorted(m for m in {HEAVY!r} if m in _s.modules)))")
    out = subprocess.run([sys.executable, "-c", code + tail, *args], capture_output=True,
                         text=True, timeout=300, env=env, cwd=cwd)
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("HEAVY ")]
    return json.loads(line.removeprefix("HEAVY "))


def train_final_eval(config: str | Path, run_dir: Path, *sets: str) -> dict[str, float]:
    """``comera train CONFIG --no-store`` into ``run_dir`` with ``--set`` of each of
    ``sets``; the metrics of the run's last evaluation as it logged them (its
    ``metrics.jsonl``; empty where it logged none)."""
    from comera_engine.cli import main

    argv = ["train", str(config), "--no-store", "--no-progress", "--run-dir", str(run_dir)]
    for item in sets:
        argv += ["--set", item]
    assert main(argv) == 0
    final: dict[str, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "metrics" and "eval/acc" in rec["values"]:
            final = rec["values"]
    return final


def readme_loop(model: Any, config: Any, steps: int, loss_of: Callable[[Any], Any],
                lr: float = 3e-3, seed: int = 2) -> Any:
    """The README's loop over a tensorized ``model``: ``CoMERA(model, config)``, AdamW at
    ``lr`` over its parameter groups, ``attach``, then ``steps`` steps of
    ``comera.loss(loss_of(generator))`` (a seeded ``torch.Generator`` for the batches).
    Returns the controller."""
    import torch

    import comera_engine as ce

    comera = ce.CoMERA(model, config, total_steps=steps)
    opt = torch.optim.AdamW(comera.param_groups(), lr=lr)
    comera.attach(opt)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = comera.loss(loss_of(g))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return comera
