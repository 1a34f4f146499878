"""Shared by tests that train a short real run through the CLI and check what it logged
(tests/test_export_raw.py, tests/test_shrink_peers.py)."""

from __future__ import annotations

import json
from pathlib import Path


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
