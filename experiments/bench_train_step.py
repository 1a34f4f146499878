"""Benchmark: one full training step of the paper's six-encoder transformer, CoMERA vs dense.

A step is what the trainer runs: forward, the CoMERA objective (early stage; plain loss
for the dense baseline), backward, gradient clipping, AdamW (cores / gates / dense
groups) and the gate refresh, on a synthetic batch of token ids (sequence 128, BERT
vocabulary 30522, 3 classes). Each configuration runs in a fresh subprocess so that
peak memory is its own: ``torch.cuda.max_memory_allocated`` on GPU, peak RSS minus the
RSS before the model was built on CPU.

    python experiments/bench_train_step.py                      # defaults for this machine
    python experiments/bench_train_step.py --presets small --batches 1 32 --steps 10
    python experiments/bench_train_step.py --presets paper --batches 32 128 \
        --paths auto reconstructed factorised fused --graphs both   # every path choice

CoMERA runs once per ``--paths`` choice: ``auto`` (the planner, as a run does: the
device profile's fastest path per layer, the Triton kernels off), ``kernels`` (the
planner with the kernels allowed, ``COMERA_KERNELS=1``), ``reconstructed``,
``factorised`` or ``fused`` (every TT op restricted to that family where it has it,
``COMERA_PATHS``); the dense model once, with the same precision (bf16 autocast on a
GPU) and CUDA-graph setting. ``--compile [MODE ...]`` adds both models eagerly with the
step's forward and objective under ``torch.compile`` in each mode (``default``,
``reduce-overhead``: Inductor's own CUDA graphs; ``TrainStep(compile=...)``; the dense
model too with ``--compile-dense``, else its eager row is the reference): the first
step's time, the compile, is its own column, and Dynamo's recompiles are counted.
``--cublas-workspace-mb N [N ...]`` runs every configuration once per cuBLAS workspace
size (``default``: PyTorch's own, 32 MiB a stream on Hopper; a number of MiB: set through
``CUBLAS_WORKSPACE_CONFIG`` and ``CUBLASLT_WORKSPACE_SIZE`` in its process, dense and
CoMERA alike): the workspace is allocated from the caching allocator, so at batch 1 it is
a sizeable part of the peak. Each row records the paths the planner chose. Prints a table and writes
``experiments/results/bench_train_step.json`` after every row (a run cut short keeps
what it measured; ``docs/BENCHMARKS.md`` is generated from committed results by
``experiments/bench_report.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "experiments" / "results" / "bench_train_step.json"
VOCAB, SEQ, CLASSES = 30522, 128, 3
#: --paths choice -> (COMERA_PATHS, COMERA_KERNELS) of its process
PATH_CHOICES = {"auto": ("", "0"), "kernels": ("", "1"), "reconstructed": ("reconstructed", "0"),
                "factorised": ("factorised", "0"), "fused": ("fused", "1")}


# ---------------------------------------------------------------------- one configuration


def build_transformer(preset: str, dense: bool) -> Any:
    """The six-encoder classifier (CoMERA or its dense baseline) for synthetic NLI
    batches: vocabulary 30522, sequence 128, 3 classes."""
    from comera_engine.config import ModelConfig
    from comera_engine.models import build_model

    class Data:  # what build_model needs to know about the dataset
        name, task, meta = "synthetic", "nli", {}
        num_classes, vocab_size, seq_len = CLASSES, VOCAB, SEQ

    return build_model(ModelConfig(name="transformer_cls", preset=preset, dense=dense), Data())


def nli_batch(batch: int, device: Any = "cpu") -> dict[str, Any]:
    """A fixed batch of ``batch`` random sequences (``SEQ`` tokens, seed 0) for the
    transformer's NLI task, on ``device`` (torch imported here, as in :func:`measure`:
    the parent process never imports it)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    data = {"input_ids": torch.randint(1, VOCAB, (batch, SEQ), generator=gen),
            "token_type_ids": torch.zeros(batch, SEQ, dtype=torch.long),
            "attention_mask": torch.ones(batch, SEQ, dtype=torch.long),
            "labels": torch.randint(0, CLASSES, (batch,), generator=gen)}
    return {k: v.to(device) for k, v in data.items()}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Time at least ``spec["steps"]`` training steps of one configuration, and more
    (up to 200) until ``spec["min_seconds"]`` have been timed: a fast step on a shared
    machine needs many samples for a stable median (runs in a child)."""
    import psutil
    import torch
    from benchlib import state_bytes  # (this script's folder: sys.path[0] in its child)

    from comera_engine.models import TaskModel
    from comera_engine.rank import CoMERA
    from comera_engine.tensor.planner import choices_made, describe_choices
    from comera_engine.train.step import GraphedStep, TrainStep

    torch.manual_seed(0)
    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(spec["threads"])
    rss0 = psutil.Process().memory_info().rss

    model = build_transformer(spec["preset"], dense=spec["variant"] == "dense")
    task_model = TaskModel(model, "nli").to(device)
    state = CoMERA(model)
    grouped = bool(spec.get("grouped"))
    optimizer = _grouped_optimizer(state, spec["graph"]) if grouped else state.make_optimizer(
        capturable=spec["graph"])
    refresh = state.refresh_fn() if spec["graph"] else None  # on the device, in the graph
    if grouped and refresh is not None:
        refresh = _grouped_refresh(model)
    step = TrainStep(
        task_model,
        optimizer,
        state.objective_fn(),
        model.parameters(),
        grad_clip=1.0,
        autocast_dtype=torch.bfloat16 if cuda else None,
        refresh=refresh,
        compile=_compile_mode(spec.get("compile")),
        grouped=False if spec.get("ungrouped") else None,
    )
    runner = GraphedStep(step, log=lambda text: None) if spec["graph"] else step
    batch = nli_batch(spec["batch"], device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def after(out: dict) -> None:  # the controller's step: gate refresh, stage, pace
        counts = out["gate_counts"].tolist() if "gate_counts" in out else None
        state.step(optimizer, loss=float(out["loss/task"]), counts=counts, truncate=False)

    if cuda:  # before the warm-up: a CUDA graph's capture allocates what its replays reuse
        torch.cuda.reset_peak_memory_stats()
    t_first = time.perf_counter()
    for i in range(spec["warmup"]):
        after(runner(batch))
        if i == 0:
            sync()
            first_ms = 1e3 * (time.perf_counter() - t_first)  # a compile or lazy set-up
    sync()
    times = []
    while len(times) < spec["steps"] or (
            sum(times) < spec.get("min_seconds", 0.0) and len(times) < 200):
        t0 = time.perf_counter()
        out = runner(batch)
        after(out)
        sync()
        times.append(time.perf_counter() - t0)
    loss = float(out["loss/task"])
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    size = state.size_metrics()
    made = choices_made()
    # what the training state holds (parameters, their gradients, the optimizer's
    # moments): the rest of the peak is activations, workspaces and the graph's pool
    held = state_bytes(model.parameters(), optimizer)
    return {
        **spec,
        "step_ms_median": 1e3 * statistics.median(times),
        "step_ms_min": 1e3 * min(times),
        "first_step_ms": first_ms if spec["warmup"] else None,
        "steps_timed": len(times),
        "seconds_timed": sum(times),
        "peak_mem_mb": peak / 2**20,
        "state_mem_mb": held / 2**20,
        "params": size["params/effective"],
        "loss": loss,
        "graph_reason": getattr(runner, "reason", None),
        "paths_chosen": sorted({f"{c.op}:{ch.path}:{ch.source}" for c, ch in made}),
        "paths_text": describe_choices(made) if made else None,
        "recompiles": _recompiles() if spec.get("compile") else None,
    }


def _grouped_optimizer(state: Any, graph: bool) -> Any:
    """``--grouped-step``'s optimizer: torch's ``fused`` AdamW over the controller's groups
    (one kernel a group and dtype, its step counts on the device; ``capturable`` for a
    CUDA graph, which torch's capture check asks for) instead of the ``foreach`` one
    (``experiments/bench_launches.py``)."""
    import torch

    return torch.optim.AdamW(state.param_groups(), lr=1e-3, fused=True, capturable=graph)


def _grouped_refresh(model: Any) -> Any:
    """``--grouped-step``'s gate refresh: every bond of every layer at once
    (:func:`comera_engine.tensor.size.refresh_entries`, the same result as the
    controller's per-bond one, counts in the same order)."""
    from comera_engine.layers import tt_layers
    from comera_engine.tensor.size import refresh_entries

    trains = [m.tt for _, m in tt_layers(model)]
    return lambda: refresh_entries(trains)


def _compile_mode(value: Any) -> str | None:
    """A row's ``compile``: a mode, ``True`` (rows written before modes: ``default``) or
    nothing."""
    if not value:
        return None
    return value if isinstance(value, str) else "default"


def _recompiles() -> int | None:
    """How many times Dynamo recompiled in this process (None where it cannot say)."""
    try:
        from torch._dynamo.utils import counters

        return int(sum(counters["recompiles"].values()))
    except Exception:  # noqa: BLE001 - a private counter, absent in some torch versions
        return None


def workspace_env(mb: int | None) -> dict[str, str]:
    """The environment that sets cuBLAS's and cuBLASLt's workspace to ``mb`` MiB (one
    workspace a stream; nothing for None, PyTorch's default). Read when a process first
    uses cuBLAS."""
    if mb is None:
        return {}
    return {"CUBLAS_WORKSPACE_CONFIG": f":{mb * 1024}:1", "CUBLASLT_WORKSPACE_SIZE": str(mb * 1024)}


def run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(spec["threads"])}
    family, kernels = PATH_CHOICES[spec.get("paths", "auto")]
    env.update(COMERA_PATHS=family, COMERA_KERNELS=kernels)
    for key in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE"):
        env.pop(key, None)  # the row's own setting, not the caller's
    env.update(workspace_env(spec.get("cublas_workspace_mb")))
    proc = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        return {**spec, "error": proc.stderr.strip().splitlines()[-1:] or ["failed"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- the sweep


def main(argv: list[str] | None = None) -> int:
    import torch

    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["small", "paper"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32, 128] if cuda else [1, 32])
    parser.add_argument("--paths", nargs="+", choices=list(PATH_CHOICES), default=["auto"],
                        help="CoMERA's path choices, one run each (the dense model once)")
    parser.add_argument("--eager-paths", nargs="+", choices=list(PATH_CHOICES), default=None,
                        help="the path choices of the runs without a CUDA graph "
                             "(default: --paths)")
    parser.add_argument("--graphs", choices=("on", "off", "both"),
                        default="both" if cuda else "off", help="CUDA graph (GPU only)")
    parser.add_argument("--compile", nargs="*", default=None, metavar="MODE",
                        choices=["default", "reduce-overhead", "max-autotune"],
                        help="also both models with the step's forward under torch.compile, "
                             "eagerly, in each MODE (none given: default)")
    parser.add_argument("--compile-dense", action="store_true",
                        help="with --compile: the dense model compiled too (else its "
                             "eager row is the reference)")
    parser.add_argument("--grouped-step", action="store_true",
                        help="also CoMERA on the first path choice with the refresh of all "
                             "bonds at once and torch's fused AdamW, per CUDA-graph setting")
    parser.add_argument("--ungrouped", action="store_true",
                        help="every TT linear merges its own halves (TrainStep(grouped="
                             "False)); by default a GPU step merges them per shape at once")
    parser.add_argument("--cublas-workspace-mb", nargs="+", default=["default"],
                        metavar="MIB",
                        help="run every configuration once per cuBLAS workspace size: "
                             "'default' (PyTorch's) or a number of MiB (dense and CoMERA "
                             "alike)")
    parser.add_argument("--steps", type=int, default=20 if cuda else 3)
    parser.add_argument("--warmup", type=int, default=5 if cuda else 1)
    parser.add_argument("--min-seconds", type=float, default=3.0,
                        help="keep timing steps (up to 200) until this many seconds")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--no-docs", action="store_true",
                        help="accepted for old command lines: the docs are never touched")
    parser.add_argument("--render", action="store_true", help="only re-render the last JSON")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default experiments/results/bench_train_step.json)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out_json = args.out or RESULTS
    for name in ("steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: must be a positive integer")
    if args.warmup < 0 or args.min_seconds < 0:
        parser.error("--warmup/--min-seconds: must be >= 0")
    workspaces: list[int | None] = []
    for value in args.cublas_workspace_mb:
        if value == "default":
            workspaces.append(None)
        elif value.isdigit() and int(value) >= 1:
            workspaces.append(int(value))
        else:
            parser.error(f"--cublas-workspace-mb: 'default' or a positive number of MiB, "
                         f"got {value!r}")
    if args.one:
        print(json.dumps(measure(json.loads(args.one))))
        return 0
    if args.render:
        table = markdown(json.loads(out_json.read_text()))
        print(table)
        return 0

    device = "cuda" if cuda else "cpu"
    graphs = {"on": [True], "off": [False], "both": [True, False]}[args.graphs]
    if not cuda and any(graphs):
        parser.error("--graphs on/both: CUDA graphs need a GPU")
    rows: list[dict[str, Any]] = []
    for preset in args.presets:
        for batch in args.batches:
            modes = None if args.compile is None else (args.compile or ["default"])
            for workspace, (graph, compiled, variant, paths, grouped) in (
                    (w, g) for w in workspaces for g in _grid(
                        graphs, args.paths, args.eager_paths, modes, args.grouped_step,
                        args.compile_dense)):
                spec = {
                    "preset": preset, "batch": batch, "variant": variant, "graph": graph,
                    "device": device, "steps": args.steps, "min_seconds": args.min_seconds,
                    "warmup": max(args.warmup, 4 if graph else 1 if compiled else 0),
                    "threads": args.threads, "paths": paths, "compile": compiled,
                    "grouped": grouped, "ungrouped": args.ungrouped,
                    "cublas_workspace_mb": workspace,
                }
                row = run_child(spec, args.timeout)
                rows.append(row)
                print(_row_text(row), flush=True)
                _write(out_json, rows, args, argv, cuda)
    result = _write(out_json, rows, args, argv, cuda)
    print()
    print(markdown(result))
    return 0


def _grid(graphs: list[bool], paths: list[str], eager_paths: list[str] | None,
          compile_modes: list[str] | bool | None, grouped: bool = False,
          compile_dense: bool = False) -> list[tuple[bool, Any, str, str, bool]]:
    """``(graph, compiled, variant, paths, grouped)`` of every configuration: per
    CUDA-graph setting the dense model, then CoMERA per path choice (``eager_paths``
    without a graph, where given), then (``grouped``, graphed only) CoMERA on the first of
    them with the grouped step ops; compiled ones eagerly (CoMERA, and the dense model
    with ``compile_dense``)."""
    out = []
    for graph in graphs:
        out.append((graph, False, "dense", "auto", False))
        chosen = paths if graph or eager_paths is None else eager_paths
        out += [(graph, False, "comera", p, False) for p in chosen]
        if grouped and graph:  # (eagerly the refresh is the host's: only the optimizer)
            out.append((graph, False, "comera", chosen[0], True))
    if compile_modes is True:  # the old flag: the default mode
        compile_modes = ["default"]
    for mode in compile_modes or ():  # CoMERA (the dense model with compile_dense)
        out += [*([(False, mode, "dense", "auto", False)] if compile_dense else []),
                (False, mode, "comera", "auto", False)]
    return out


def _write(out_json: Path, rows: list[dict[str, Any]], args: argparse.Namespace,
           argv: list[str] | None, cuda: bool) -> dict[str, Any]:
    import torch

    result = {
        "benchmark": "train_step",
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "cpu_threads": args.threads,
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": "python experiments/bench_train_step.py " + " ".join(argv or sys.argv[1:]),
        "peak_from": "before warm-up",  # a CUDA graph's capture counts (see measure)
        "rows": rows,
        "ratios": ratios(rows),
    }
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=2))
    return result


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Dense / CoMERA step time and peak memory for each (preset, batch, graph, compiled)
    and CoMERA path choice, against the dense row of the same settings."""
    out = []
    ok = [r for r in rows if "error" not in r]

    def key(r: dict[str, Any]) -> tuple:
        return (r["preset"], r["batch"], r["graph"], r.get("cublas_workspace_mb"),
                r.get("compile") or False)

    dense_of = {key(r): r for r in ok if r["variant"] == "dense"}
    for tt in ok:  # a compiled CoMERA row without a compiled dense one: the eager dense
        dense = dense_of.get(key(tt)) or dense_of.get((*key(tt)[:4], False))
        if tt["variant"] != "comera" or dense is None:
            continue
        out.append(
            {
                "preset": tt["preset"],
                "batch": tt["batch"],
                "graph": tt["graph"],
                "paths": tt.get("paths", "auto"),
                "compile": _compile_mode(tt.get("compile")) or False,
                "first_step_ms": tt.get("first_step_ms"),
                "recompiles": tt.get("recompiles"),
                "grouped": bool(tt.get("grouped")),
                "ungrouped": bool(tt.get("ungrouped")),
                "cublas_workspace_mb": tt.get("cublas_workspace_mb"),
                "dense_ms": dense["step_ms_median"],
                "comera_ms": tt["step_ms_median"],
                "speedup": dense["step_ms_median"] / tt["step_ms_median"],
                "dense_mem_mb": dense["peak_mem_mb"],
                "dense_state_mb": dense.get("state_mem_mb"),
                "comera_state_mb": tt.get("state_mem_mb"),
                "comera_mem_mb": tt["peak_mem_mb"],
                "mem_ratio": dense["peak_mem_mb"] / max(tt["peak_mem_mb"], 1e-9),
                "params_ratio": dense["params"] / tt["params"],
            }
        )
    return out


def markdown(result: dict[str, Any]) -> str:
    on_gpu = "cuda" in str(result["rows"][0].get("device"))
    threads = "" if on_gpu else f", {result['cpu_threads']} CPU threads"
    lines = [
        f"Training step of the six-encoder transformer (seq 128, vocab 30522), CoMERA (TT, "
        f"early stage) vs the dense baseline. Device: {result['device']}{threads}"
        f"; torch {result['torch']}; {result['time']}. Command: `{result['command'].strip()}`.",
        "",
        "| preset | batch | CUDA graph | CoMERA paths | dense ms/step | CoMERA ms/step | "
        "speed-up | dense peak MB | CoMERA peak MB | memory ratio | params ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["ratios"]:
        paths = (r.get("paths", "auto") + (f", compiled ({_compile_mode(r['compile'])}, "
                                            f"first step {r.get('first_step_ms') or 0:.0f} ms)"
                                            if r.get("compile") else "")
                 + (", grouped step" if r.get("grouped") else "")
                 + _workspace_text(r))
        lines.append(
            f"| {r['preset']} | {r['batch']} | {'yes' if r['graph'] else 'no'} | {paths} | "
            f"{r['dense_ms']:.1f} | {r['comera_ms']:.1f} | {r['speedup']:.2f}x | "
            f"{r['dense_mem_mb']:.0f} | {r['comera_mem_mb']:.0f} | {r['mem_ratio']:.2f}x | "
            f"{r['params_ratio']:.1f}x |"
        )
    lines += [
        "",
        "Median of the timed steps after warm-up (at least `--steps`, more until "
        "`--min-seconds` of steps were timed, at most 200); speed-up and memory ratio are "
        "dense / "
        "CoMERA. Peak memory: `torch.cuda.max_memory_allocated` on GPU from before the "
        "warm-up (so a CUDA graph's capture, whose memory its replays reuse, counts); on "
        "CPU the "
        "process's peak RSS minus its RSS before the model was built (each configuration "
        "runs in its own process). Params ratio: dense / CoMERA effective parameters.",
    ]
    if not on_gpu:
        lines.append(
            "CPU timings come from a shared machine and move with its load; "
            "the GPU rows (with and without CUDA Graph) need a GPU run of this script."
        )
    errors = [r for r in result["rows"] if "error" in r]
    for r in errors:
        lines.append(f"\nFailed: {r['preset']} batch {r['batch']} {r['variant']}: {r['error']}")
    return "\n".join(lines)


def _workspace_text(r: dict[str, Any]) -> str:
    """``, cuBLAS workspace N MiB`` for a row run with ``--cublas-workspace-mb N``."""
    mb = r.get("cublas_workspace_mb")
    return "" if mb is None else f", cuBLAS workspace {mb} MiB"


def _row_text(r: dict[str, Any]) -> str:
    paths = (f" {r.get('paths', 'auto')}" if r["variant"] == "comera" else "") + (
        f" compiled {_compile_mode(r['compile'])} (first step "
        f"{r.get('first_step_ms') or 0:.0f} ms, {r.get('recompiles')} recompiles)"
        if r.get("compile") else "") + (" grouped" if r.get("grouped") else "") + (
        _workspace_text(r))
    head = (f"{r['preset']:>5} b={r['batch']:<4} {r['variant']:>6} graph={r['graph']!s:<5}"
            f"{paths}")
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    extra = f" ({r['graph_reason']})" if r.get("graph_reason") else ""
    return (
        f"{head} {r['step_ms_median']:9.1f} ms  peak {r['peak_mem_mb']:8.0f} MB  "
        f"params {r['params']:,.0f}{extra}"
    )


if __name__ == "__main__":
    sys.exit(main())
