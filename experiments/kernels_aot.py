"""Compile the Triton kernels ahead for A100 (sm_80) and H100 (sm_90) with no GPU present,
at the paper's TT-linear shapes, and report registers, spills and shared memory per
kernel: a table on stdout and JSON in experiments/results/kernels_aot.json.

    python experiments/kernels_aot.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results"),
                        help="folder for kernels_aot.json")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 is set: interpreted kernels cannot be compiled")
    try:
        import triton  # noqa: F401
    except ImportError:
        parser.error("triton is not installed (pip install triton; Linux x86-64)")
    from comera_engine.kernels import aot

    rows = []
    for arch in sorted(aot.ARCHS):
        for dtype in ("fp32", "bf16"):
            for fn, pointers, constexprs in aot.paper_cases():
                rows.append(aot.compile_kernel(fn, pointers, dtype, arch, constexprs).as_dict())
    print("| kernel | GPU | dtype | rank tile | registers | spilled B | shared B (limit) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {aot.ARCHS[r['arch']][0]} | {r['dtype']} | "
              f"{r['constexprs'].get('BLOCK_R', '-')} | {r['registers']} | {r['spill_bytes']} | "
              f"{r['shared_bytes']} ({r['shared_limit']}) |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_aot.json").write_text(json.dumps({"rows": rows}, indent=1))
    print(f"wrote {out / 'kernels_aot.json'}")
    bad = [r for r in rows if r["spill_bytes"] or r["shared_bytes"] > r["shared_limit"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
