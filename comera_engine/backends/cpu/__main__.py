"""``python -m comera_engine.backends.cpu build|status [--dir DIR] [--no-tune]``.

``build``: compile the CPU backend into this environment's folder (or ``--dir``) and
choose the GEMM ways by timing them (about a minute); exit 0 also where it cannot be
built (no compiler): runs then use the PyTorch path. ``--strict`` exits 1 then.
``status``: say whether a complete build is there and which ways it takes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import BackendUnavailable, backend_dir, load


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m comera_engine.backends.cpu",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["build", "status"])
    ap.add_argument("--dir", type=Path, default=None,
                    help="backend folder (default $COMERA_CPU_BACKEND_DIR, else "
                    "<sys.prefix>/share/comera_engine/cpu_backend)")
    ap.add_argument("--no-tune", action="store_true",
                    help="skip timing the GEMM ways (the fixed rule everywhere)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when the build fails")
    ap.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = ap.parse_args(argv)
    folder = args.dir or backend_dir()
    if args.command == "build":
        from .build import build

        print(f"CPU backend: building in {folder} (about a minute)", file=sys.stderr,
              flush=True)
        try:
            build(folder, tune=not args.no_tune, verbose=args.verbose)
        except Exception as exc:  # noqa: BLE001 (no compiler, build error: PyTorch path)
            first = str(exc).strip().splitlines()[:1]
            print(f"CPU backend: build failed ({type(exc).__name__}: "
                  f"{first[0] if first else ''}); runs use the PyTorch path",
                  file=sys.stderr)
            return 1 if args.strict else 0
    try:
        backend = load(folder)
    except BackendUnavailable as exc:
        print(f"CPU backend: not in use ({exc})", file=sys.stderr)
        return 1 if args.strict or args.command == "status" else 0
    ways = ", ".join(f"{r} {w}" for r, w in backend.ways.names().items())
    print(f"CPU backend: ready in {backend.folder}; GEMM ways: {ways}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
