"""Shared by tests/test_kernels*.py: the fused-kernel bench scripts' smoke run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench_smoke_run(script: str, args: list[str], out: Path, device: str,
                    variants: set[str]) -> None:
    """``experiments/<script>.py`` at a tiny shape (``args``; the code path, not a
    timing) on ``device``: interpreted on the CPU, compiled on a GPU. It exits 0 and its
    JSON in ``out`` has a row per way it runs (eager, and in a CUDA graph where there is
    one), each with a positive time for every one of ``variants``."""
    env = {**os.environ, "TRITON_INTERPRET": "1" if device == "cpu" else "0"}
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / f"{script}.py"),
                           "--device", device, *args, "--reps", "1", "--rounds", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / f"{script}_{device}.json").read_text())["rows"]
    assert len(rows) == (2 if device == "cuda" else 1)  # eager, and graphed on a GPU
    assert all(set(r["ms"]) == variants for r in rows)
    assert all(v > 0 for r in rows for v in r["ms"].values())
