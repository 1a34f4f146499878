"""How fast the `comera` command answers: wall time of the light commands (help, runs,
logs, stop, argument errors) in fresh processes, median of several runs; a table and
experiments/results/bench_cli.json. Target (issue 21): under 0.5 s each.

    python experiments/bench_cli.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = [["--help"], ["runs"], ["runs", "--limit", "x"], ["logs", "no-such-run"],
            ["stop", "no-such-run"], ["train", "--help"], ["bogus"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat: must be >= 1")
    rows = []
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "COMERA_HOME": home, "PYTHONPATH": str(ROOT)}
        for cmd in COMMANDS:
            times = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                subprocess.run([sys.executable, "-m", "comera_engine.cli", *cmd], env=env,
                               capture_output=True, timeout=120)
                times.append(time.perf_counter() - t)
            rows.append({"command": "comera " + " ".join(cmd),
                         "median_s": statistics.median(times), "max_s": max(times)})
    print("| command | median s | max s |\n|---|---|---|")
    for r in rows:
        print(f"| `{r['command']}` | {r['median_s']:.3f} | {r['max_s']:.3f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_cli.json").write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
