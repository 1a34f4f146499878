"""Tune the planner to this GPU: time every path of every TT op that the paper's model and
the shipped configs run, sweep the Triton kernels' launch configurations, and write the
device profile the planner reads (comera_engine/tensor/profile.py).

    python experiments/tune_gpu.py                          # on a CUDA GPU: writes
        # comera_engine/tensor/profiles/<gpu>.json (commit it: the planner's package data)
    python experiments/tune_gpu.py --out DIR --budget 150   # elsewhere, within 150 s
    python experiments/tune_gpu.py --quick --out DIR \\
        --fake-device '{"name": "Fake GPU", "flops": {"float32": 1e11}, "bandwidth": 2e10}'
        # on a CPU, a fake device (the tests' way: tests/test_tune.py)

The cases come from the configs' own previews (comera_engine.preview: each TT layer's
factors and ranks at the start of its run, the tokens of one batch); the paper
transformer (mnli_transformer_paper) is measured first, at batch 32 (the paper's) and
128, then the other paper-size configs at their batch. Tied MLM decoders run on the
masked 15 % of a batch's tokens. On a GPU every case is timed in bf16 (the trainer's
autocast) eagerly and inside a CUDA graph; on a CPU in fp32, eagerly. The profile is
written after every case, so a run cut off by ``--budget`` (or a timeout) leaves a
valid one with what it measured. On a GPU the fused paths are timed too
(``COMERA_KERNELS=1`` here; a run plans with them only where it is set).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from comera_engine.tensor.costs import Case  # noqa: E402
from comera_engine.tensor.profile import PACKAGE_DIR, slug  # noqa: E402
from comera_engine.tensor.roofline import DeviceSpec, spec_for_name  # noqa: E402

CONFIGS = ROOT / "experiments" / "configs"
#: (config, batch sizes: None for the config's own), most important first
PAPER = [("mnli_transformer_paper", [32, 128]), ("code_mlm_paper", None),
         ("dlrm_criteo_paper", None), ("digits_tt_mlp_paper", None)]
QUICK = [("digits_tt_mlp", [2]), ("snli_transformer_tiny", [2]), ("code_mlm_tiny", [1])]
MASKED = 0.15  # the share of an MLM batch's tokens the tied decoder scores


def config_cases(name: str, batch: int | None, dtype: str, graphs: list[bool]) -> list[Case]:
    """The TT ops of config ``name`` at batch ``batch`` (its own where None): one case
    per distinct (op, factors, ranks, tokens) and graph setting."""
    from comera_engine.config import load_config
    from comera_engine.preview import make_preview

    cfg = load_config(CONFIGS / f"{name}.toml")
    if batch is not None:
        from dataclasses import replace

        cfg = replace(cfg, train=replace(cfg.train, batch_size=batch))
    pv = make_preview(cfg, "cpu")
    tokens = pv.tokens_per_batch
    seen: dict[tuple, None] = {}
    for layer in pv.layers:
        rows, cols = (tuple(f) for f in layer.factors)
        ranks = tuple(layer.ranks)
        if layer.kind == "linear":
            seen[("ttm_linear" if layer.layout == "ttm" else "tt_linear", rows, cols, ranks,
                  tokens)] = None
        else:
            seen[("ttm_lookup", rows, cols, ranks, tokens)] = None
            if cfg.model.name == "transformer_mlm":
                seen[("ttm_decode", rows, cols, ranks, max(1, round(MASKED * tokens)))] = None
    return [Case(op, rows, cols, ranks, t, dtype, graph)
            for graph in graphs for (op, rows, cols, ranks, t) in seen]


def all_cases(plan: list[tuple[str, list[int] | None]], dtype: str, graphs: list[bool]
              ) -> list[Case]:
    out: dict[Case, None] = {}
    for name, batches in plan:
        for batch in batches or [None]:
            for case in config_cases(name, batch, dtype, graphs):
                out[case] = None
    return list(out)


def device_identity(args: argparse.Namespace, cuda: bool) -> tuple[str, DeviceSpec, dict]:
    """``(name, peaks, meta)`` of the device profiled: the fake one given, or this GPU
    (its datasheet peaks, or ``--spec``)."""
    import platform

    meta = {"torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": "python experiments/tune_gpu.py " + " ".join(sys.argv[1:]),
            "host_cpu": platform.processor() or platform.machine()}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    if args.fake_device:
        raw = json.loads(Path(args.fake_device).read_text()
                         if Path(args.fake_device).is_file() else args.fake_device)
        spec = DeviceSpec.from_dict(raw)
        return spec.name, spec, {**meta, "fake": True, "measured_on": "cpu"}
    if not cuda:
        raise SystemExit("tune_gpu.py: no CUDA device here; give --fake-device to profile "
                         "this CPU as a fake GPU (the tests' way)")
    name = torch.cuda.get_device_name()
    spec = DeviceSpec.from_dict(json.loads(args.spec)) if args.spec else spec_for_name(name)
    if spec is None:
        raise SystemExit(f"tune_gpu.py: no datasheet peaks for {name!r} in "
                         "comera_engine/tensor/roofline.py GPU_SPECS; give --spec "
                         '\'{"name": ..., "flops": {"float32": ..., "bfloat16": ...}, '
                         '"bandwidth": ...}\'')
    meta.update(fake=False, capability=list(torch.cuda.get_device_capability()),
                cuda=torch.version.cuda)
    return name, spec, meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for <slug>.json (default: comera_engine/tensor/profiles)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds to spend at most (cases in order, then the kernel sweep)")
    ap.add_argument("--quick", action="store_true",
                    help="three tiny configs at batch 1-2 (the tests' way)")
    ap.add_argument("--configs", nargs="+", default=None,
                    help="config names (experiments/configs/*.toml) at their own batch")
    ap.add_argument("--fake-device", default=None,
                    help="JSON (or a file of it): name, flops {dtype: FLOP/s}, bandwidth")
    ap.add_argument("--spec", default=None, help="this GPU's peaks as JSON (as --fake-device)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                    help="default: bf16 on a GPU (the trainer's autocast), fp32 on a CPU")
    ap.add_argument("--no-graph", action="store_true", help="eager timings only")
    ap.add_argument("--no-kernels", action="store_true", help="skip the kernel sweep")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads for a fake device's timings (default 1: more "
                         "threads on a shared CPU time the machine's load, not the paths)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.fake_device
    name, spec, meta = device_identity(args, cuda)
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:  # the fused paths are measured too (a run takes them only where asked)
        os.environ.setdefault("COMERA_KERNELS", "1")
    else:
        torch.set_num_threads(max(1, args.threads))
    dtype = {"bf16": "bfloat16", "fp32": "float32", None: None}[args.dtype] or (
        "bfloat16" if cuda else "float32")
    graphs = [False, True] if cuda and not args.no_graph else [False]
    plan = QUICK if args.quick else (
        [(c, None) for c in args.configs] if args.configs else PAPER)
    cases = all_cases(plan, dtype, graphs)
    out = (args.out or PACKAGE_DIR) / f"{slug(name)}.json"
    print(f"tuning {name} ({'fake, on this CPU' if meta.get('fake') else device}): "
          f"{len(cases)} cases, {dtype}, graph {graphs} -> {out}", flush=True)
    from comera_engine.tensor.tune import tune

    t0 = time.perf_counter()
    prof = tune(cases, device, name, spec, str(out), meta, args.budget,
                kernels=not args.no_kernels, rounds=args.rounds, reps=args.reps,
                log=lambda s: print(s, flush=True))
    fit = {k: v for k, v in prof.fit.items() if k != "path_factors"}
    print(f"wrote {out}: {len(prof.measurements)} cases in {time.perf_counter() - t0:.0f} s, "
          f"fit {fit}, kernels {sorted(prof.kernels)}")
    sys.path.insert(0, str(ROOT / "experiments"))
    from bench_report import profile_rows, table

    print(table(*profile_rows(prof.to_json())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
