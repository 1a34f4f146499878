"""Two launched runs on one machine (issue 33, item 1): the shipped digits config launched
twice at once with the launcher's thread budget (each run gets cores // runs in flight
threads), against the same two runs one after the other, and (``--unbudgeted``) at once
with every run on all cores (``OMP_NUM_THREADS`` = cores, what a launch did before).
Wall time from the first ``comera launch`` to the last run's final status; a table and
experiments/results/bench_two_launches.json. Target: together <= 1.2x one after the other.

    python experiments/bench_two_launches.py [--steps 2000] [--unbudgeted]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "experiments" / "configs" / "digits_tt_mlp.toml"
FINAL = {"finished", "stopped", "failed", "diverged", "crashed"}


def _launch(home: str, steps: int, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-m", "comera_engine.cli", "launch", str(CONFIG),
                          "--set", f"train.steps={steps}", "--store", home],
                         env=env, capture_output=True, text=True, timeout=300, check=True)
    return out.stdout.strip()


def _wait(home: str, rids: list[str], timeout: float) -> list[dict]:
    from comera_engine.store import RunStore

    st = RunStore(home, create=False)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        runs = [st.get_run(r) for r in rids]
        if all(r is not None and r["status"] in FINAL for r in runs):
            st.close()
            return runs  # type: ignore[return-value]
        time.sleep(0.2)
    raise TimeoutError(f"runs {rids} did not end within {timeout:g} s")


def _idle(limit: float, wait: float) -> float:
    """Wait (at most ``wait`` s) until the 1-minute load average is below ``limit`` (a
    shared machine); returns the load average when the case starts."""
    t0 = time.monotonic()
    while os.getloadavg()[0] >= limit and time.monotonic() - t0 < wait:
        time.sleep(5)
    return os.getloadavg()[0]


def _case(name: str, steps: int, together: bool, env: dict[str, str],
          idle: tuple[float, float]) -> dict:
    load = _idle(*idle)
    with tempfile.TemporaryDirectory() as home:
        t0 = time.perf_counter()
        rids: list[str] = []
        runs: list[dict] = []
        for _ in range(2):
            rids.append(_launch(home, steps, env))
            if not together:
                runs += _wait(home, rids[-1:], 1800)
        if together:
            runs = _wait(home, rids, 1800)
        wall = time.perf_counter() - t0
        threads = []
        for rid in rids:
            launch_env = json.loads((Path(home) / rid / "launch_env.json").read_text())
            threads.append(launch_env.get("OMP_NUM_THREADS", "-"))
    return {"case": name, "wall_s": wall, "statuses": [r["status"] for r in runs],
            "run_s": [r["ended_at"] - r["started_at"] for r in runs],
            "threads_at_start": threads, "load_before": load,
            "load_after": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--unbudgeted", action="store_true",
                   help="also both at once on all cores each (slow on a small machine)")
    p.add_argument("--idle-load", type=float, default=0.5,
                   help="wait for a 1-minute load average below this before each case")
    p.add_argument("--idle-wait", type=float, default=300.0, help="at most this long (s)")
    p.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    args = p.parse_args(argv)
    idle = (args.idle_load, args.idle_wait)
    cores = len(os.sched_getaffinity(0))
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    base["PYTHONPATH"] = str(ROOT)
    rows = [_case("one after the other", args.steps, False, base, idle),
            _case("together, thread budget", args.steps, True, base, idle)]
    if args.unbudgeted:
        rows.append(_case("together, all cores each", args.steps, True,
                          {**base, "OMP_NUM_THREADS": str(cores)}, idle))
    ref = rows[0]["wall_s"]
    print(f"digits TT-MLP, {args.steps} steps per run, 2 runs, {cores} cores "
          f"({platform.processor() or platform.machine()})")
    print("| case | wall s | vs one after the other | threads at start | run s | "
          "load before/after |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        r["ratio"] = r["wall_s"] / ref
        print(f"| {r['case']} | {r['wall_s']:.1f} | {r['ratio']:.2f}x | "
              f"{', '.join(r['threads_at_start'])} | "
              f"{', '.join(f'{s:.1f}' for s in r['run_s'])} | "
              f"{r['load_before']:.2f} / {r['load_after']:.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_two_launches.json").write_text(json.dumps(
        {"steps": args.steps, "cores": cores, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
