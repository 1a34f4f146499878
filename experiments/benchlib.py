"""Shared helpers for the benchmark scripts: timing, memory, machine info, output."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from comera_engine.backends import keep_freed_memory

RESULTS = Path(__file__).resolve().parent / "results"
_KEPT: int | None = None  # what keep_freed_memory_as_training_does() set


def keep_freed_memory_as_training_does() -> int:
    """What ``train`` does for CPU runs where the CPU backend is in use
    (:func:`comera_engine.backends.keep_freed_memory`): freed heap memory stays with the
    process, so a step's tensors reuse pages instead of
    faulting in new ones, and timings do not depend on what glibc happened to hand back
    before. ``COMERA_KEEP_FREED_MEMORY=0`` measures without. Returns the mmap threshold
    set (0: unchanged); :func:`machine` reports it."""
    global _KEPT
    _KEPT = keep_freed_memory()
    return _KEPT


def machine() -> dict:
    """What the numbers were measured on."""
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    if _KEPT is not None:
        info["malloc_mmap_threshold"] = _KEPT
    return info


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, min_time: float = 0.3,
            warmup: int = 3, max_iters: int = 200) -> float:
    """Median seconds per call over repeated runs (at least ``min_time`` in total)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < min_time and len(times) < max_iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass(frozen=True)
class PairTiming:
    """Seconds per call of two functions timed in alternating rounds: the median round
    and the best round of each (noise on a shared machine only ever adds time, so the
    best round is what the code itself costs; the median is what a run sees)."""

    a_median: float
    b_median: float
    a_best: float
    b_best: float


def time_pair(fn_a: Callable[[], object], fn_b: Callable[[], object], device: torch.device,
              rounds: int = 9, min_time: float = 0.05, warmup: int = 3) -> PairTiming:
    """Time two functions in alternating rounds (a, b, a, b…), so drifting machine load
    hits both alike: the ratio is measured side by side."""
    for _ in range(warmup):
        fn_a()
        fn_b()
    sync(device)
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(rounds):
        for fn, out in ((fn_a, ta), (fn_b, tb)):
            n, start = 0, time.perf_counter()
            while True:
                fn()
                n += 1
                sync(device)
                el = time.perf_counter() - start
                if el >= min_time and n >= 3:
                    break
            out.append(el / n)
    return PairTiming(statistics.median(ta), statistics.median(tb), min(ta), min(tb))


def time_rounds(fns: dict[str, Callable[[], object]], device: torch.device, rounds: int,
                reps: int, warmup: int = 1, cpu: dict[str, list[float]] | None = None,
                reset: dict[str, Callable[[], object]] | None = None
                ) -> dict[str, list[float]]:
    """Seconds per call of each function, one entry per round of ``reps`` calls, the
    functions in a new (seeded) random order each round: what ran just before a function
    changes its caches and clocks (measured: the same TT step timed right after
    ``nn.Linear`` ran ~10% slower at 4096 tokens than after another TT variant), so none
    always follows another. ``cpu``: filled with the calling thread's CPU seconds per call
    the same way (``time.thread_time``: what other processes on a shared machine take
    does not count, the cache misses they cause do). ``reset``: per function, called
    (untimed) before each of its rounds, e.g. to put a training step back at its starting
    state so that every round times the same steps."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    if cpu is not None:
        cpu.update({k: [] for k in fns})
    order, shuffle = list(fns), random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for k in order:
            if reset is not None and k in reset:
                reset[k]()
            sync(device)
            c0, t0 = time.thread_time(), time.perf_counter()
            for _ in range(reps):
                fns[k]()
            sync(device)
            times[k].append((time.perf_counter() - t0) / reps)
            if cpu is not None:
                cpu[k].append((time.thread_time() - c0) / reps)
    return times


def tensor_bytes(tensors: Iterable[object]) -> int:
    """The bytes of the tensors among ``tensors`` (anything else, None included, counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def state_bytes(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """What a training state holds: the parameters, their gradients where set, and every
    tensor of the optimizer's state (moments, step counters)."""
    params = list(params)
    return (tensor_bytes(params) + tensor_bytes(p.grad for p in params)
            + tensor_bytes(v for st in optimizer.state.values() for v in st.values()))


def training_bytes(fn: Callable[[], torch.Tensor], params: list[torch.Tensor],
                   device: torch.device) -> int:
    """Peak training memory of one forward+backward.

    CUDA: ``max_memory_allocated`` over the step. CPU (no allocator statistics): bytes
    of the tensors autograd saves for backward + the output + parameters and their
    gradients (what a step must hold at its peak).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        y = fn()
        y.sum().backward()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base + sum(
            p.numel() * p.element_size() for p in params)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn()
    out = y.numel() * y.element_size()
    y.sum().backward()
    pbytes = sum(p.numel() * p.element_size() for p in params)
    return sum(seen.values()) + out + 2 * pbytes


def backend_ways() -> dict[str, str]:
    """The CPU backend's way per role (``comera_engine.backends.cpu.gemm.ROLES``) on this
    install; {} where the backend is not in use."""
    from comera_engine.backends import cpu_backend

    backend = cpu_backend()
    return backend.ways.names() if backend is not None else {}


def add_threads_arg(ap: argparse.ArgumentParser) -> None:
    """``--threads N``: torch CPU threads (0, the default: torch's own choice)."""
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads (default 0: torch's default)")


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace,
               positive: tuple[str, ...]) -> None:
    """Exit with a one-line usage error naming the flag when one of ``positive`` is below
    1 or ``--threads`` is negative; then apply ``--threads``."""
    for name in positive:
        if getattr(args, name) < 1:
            ap.error(f"--{name}: must be a positive integer")
    if args.threads < 0:
        ap.error("--threads: must be 0 (torch's default) or a positive integer")
    if args.threads:
        torch.set_num_threads(args.threads)


def write_json(name: str, payload: dict, folder: Path | None = None) -> Path:
    """Write ``payload`` to ``<folder or experiments/results>/<name>.json``."""
    folder = RESULTS if folder is None else Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def print_table(rows: list[dict], cols: list[tuple[str, str, str]]) -> None:
    """``cols``: (key, header, format)."""
    heads = [h for _, h, _ in cols]
    cells = [[format(r[k], f) if f else str(r[k]) for k, _, f in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(heads, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for c in cells:
        print("| " + " | ".join(x.ljust(w) for x, w in zip(c, widths)) + " |")


def print_and_write(rows: list[dict], cols: list[tuple[str, str, str]], name: str,
                    payload: dict, folder: Path | str | None = None) -> Path:
    """:func:`print_table` of ``rows``, then :func:`write_json` of ``payload`` (said on
    stdout); returns the JSON's path."""
    print_table(rows, cols)
    path = write_json(name, payload, None if folder is None else Path(folder))
    print(f"wrote {path}")
    return path


def add_rounds_args(ap: argparse.ArgumentParser, rounds: int, reps: int, reps_help: str
                    ) -> None:
    """``--threads`` (default 1), ``--rounds``, ``--reps`` and ``--out`` of a CPU bench
    timed in rounds (:func:`median_rounds_ms`); :func:`apply_rounds_args` checks them."""
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--rounds", type=int, default=rounds, help="alternating timing rounds")
    ap.add_argument("--reps", type=int, default=reps, help=reps_help)
    ap.add_argument("--out", type=Path, default=None, help="JSON folder (experiments/results)")


def apply_rounds_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error where ``--threads``, ``--rounds`` or ``--reps`` is below 1;
    else keep freed memory as training does and set the torch threads."""
    for name in ("threads", "rounds", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: must be a positive integer")
    keep_freed_memory_as_training_does()
    torch.set_num_threads(args.threads)


def median_rounds_ms(fns: dict[str, Callable[[], object]], rounds: int, reps: int,
                     warmup: int = 1) -> dict[str, float]:
    """Median milliseconds per call of each function on the CPU (:func:`time_rounds`)."""
    times = time_rounds(fns, torch.device("cpu"), rounds, reps, warmup)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def bench_op(name: str, cases: list[tuple[str, Callable[[], object], Callable[[], object]]],
             argv: list[str] | None = None, what: str = "forward+backward") -> int:
    """The body of ``experiments/bench_op_<name>.py``: per case ``(label, op step,
    reference step)`` (each a closure running forward and backward, or ``what`` it runs),
    the op with the CPU
    backend, the op on the pure PyTorch path and the reference, in alternating rounds;
    prints a table and writes ``bench_op_<name>.json``."""
    ap = argparse.ArgumentParser(description=f"Benchmark of the {name} op against its "
                                 "reference, with the CPU backend on and off")
    ap.add_argument("--rounds", type=int, default=7, help="alternating timing rounds")
    ap.add_argument("--out", type=Path, default=None, help="JSON folder (experiments/results)")
    add_threads_arg(ap)
    args = ap.parse_args(argv)
    check_args(ap, args, ("rounds",))
    cpu = torch.device("cpu")
    rows = []
    for label, op, ref in cases:
        def switched(on: bool, fn: Callable[[], object] = op) -> Callable[[], object]:
            def run() -> object:
                os.environ["COMERA_NATIVE"] = "1" if on else "0"
                return fn()
            return run

        on = time_pair(ref, switched(True), cpu, rounds=args.rounds)
        off = time_pair(ref, switched(False), cpu, rounds=args.rounds)
        rows.append({"case": label, "reference_ms": on.a_median * 1e3,
                     "op_backend_ms": on.b_median * 1e3, "op_pytorch_ms": off.b_median * 1e3,
                     "speedup_backend": on.a_median / on.b_median,
                     "speedup_pytorch": off.a_median / off.b_median})
        os.environ["COMERA_NATIVE"] = "1"
    print(f"\n{name}: {what}, fp32, {torch.get_num_threads()} threads "
          "(backend: the CPU backend where built, else the same as pytorch)")
    print_table(rows, [("case", "case", ""), ("reference_ms", "reference ms", ".3f"),
                       ("op_pytorch_ms", "op ms (pytorch)", ".3f"),
                       ("op_backend_ms", "op ms (backend)", ".3f"),
                       ("speedup_pytorch", "speed-up (pytorch)", ".2f"),
                       ("speedup_backend", "speed-up (backend)", ".2f")])
    out = write_json(f"bench_op_{name}", {"machine": machine(), "rows": rows}, args.out)
    print(f"wrote {out}")
    return 0


def tt_linear_step(op: Callable, ins: list[int], outs: list[int], rank: int, rows: int
                   ) -> Callable[[], object]:
    """A forward+backward closure of a TT-linear op (signature ``x, cores, d, bias,
    gates, tau, alive``) on ``rows`` fp32 rows of random input, rank ``rank``, gated."""
    from comera_engine.tensor import TTLinearCores

    cores = [c.detach().requires_grad_() for c in TTLinearCores(ins, outs, rank).cores]
    gates = [torch.ones(c.shape[-1], requires_grad=True) for c in cores[:-1]]
    x = torch.randn(rows, math.prod(ins), requires_grad=True)
    bias = torch.zeros(math.prod(outs), requires_grad=True)
    dy = torch.randn(rows, math.prod(outs))

    def step() -> object:
        for t in (x, bias, *cores, *gates):
            t.grad = None
        y = op(x, cores, len(ins), bias, gates, 0.0, ())
        y.backward(dy)
        return y

    return step


def bench_tt_linear_op(path: str, cases: list[tuple[str, list[int], list[int], int, int]]
                       ) -> int:
    """:func:`bench_op` for ``comera_engine.ops.tt_linear_<path>`` against its reference;
    ``cases``: ``(label, in factors, out factors, rank, rows)``."""
    import importlib

    mod = importlib.import_module(f"comera_engine.ops.tt_linear_{path}")
    op, ref = getattr(mod, f"tt_linear_{path}"), getattr(mod, f"tt_linear_{path}_reference")
    return bench_op(f"tt_linear_{path}", [
        (label, tt_linear_step(op, ins, outs, r, B), tt_linear_step(ref, ins, outs, r, B))
        for label, ins, outs, r, B in cases])


def graph_or_eager(step: Callable[[], None], graph: bool) -> Callable[[], object]:
    """``step`` as is, or captured into a CUDA graph (after three warm-up calls on a side
    stream) and returned as the graph's ``replay`` (:func:`comera_engine.tensor.tune.graphed`)."""
    from comera_engine.tensor.tune import graphed

    return graphed(step) if graph else step


def median_ms(steps: dict[str, Callable[[], object]], rounds: int, reps: int,
              cuda: bool) -> dict[str, float]:
    """Median milliseconds per call of each step, timed in alternating rounds of ``reps``
    calls (so drifting load hits every variant alike)."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for k, step in steps.items():
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(reps):
                step()
            if cuda:
                torch.cuda.synchronize()
            times[k].append((time.perf_counter() - t) / reps * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def fused_bench_parser(description: str, rank: int) -> argparse.ArgumentParser:
    """The flags every fused-kernel bench (``experiments/bench_kernels*.py``) takes:
    ``--device``, ``--rank``, ``--tokens``, ``--dtype``, ``--rounds``, ``--reps``,
    ``--out``; the script adds its shape flags."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="cuda")
    p.add_argument("--rank", type=int, default=rank)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=str(RESULTS))
    return p


def allow_kernels(device: str) -> None:
    """Let the planner's fused paths run here: the kernels on a GPU
    (``COMERA_KERNELS=1``), interpreted on a CPU (``interpret``, with ``TRITON_INTERPRET=1``)."""
    os.environ["COMERA_KERNELS"] = "1" if device.startswith("cuda") else "interpret"


def fused_bench_dtype(p: argparse.ArgumentParser, args: argparse.Namespace
                      ) -> tuple[bool, torch.dtype]:
    """``(cuda, dtype)`` of a fused-kernel bench: a usage error where ``--device cuda``
    has no device or the fused kernels do not run here; bf16 only on CUDA (the
    interpreter on the CPU runs fp32). The planner's fused paths run from here on
    (:func:`allow_kernels`)."""
    from comera_engine.tensor.planner import fused_available

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu with TRITON_INTERPRET=1)")
    allow_kernels(args.device)
    if not fused_available(torch.device(args.device), args.rank):
        p.error("the fused kernels do not run here (Triton missing, or on a CPU without "
                "TRITON_INTERPRET=1)")
    return cuda, torch.bfloat16 if args.dtype == "bf16" and cuda else torch.float32


def median_fwd_bwd_ms(variants: dict[str, Callable[[torch.Tensor], torch.Tensor]],
                      x: torch.Tensor, dy: torch.Tensor, graph: bool, rounds: int,
                      reps: int, cuda: bool) -> dict[str, float]:
    """Median milliseconds of one forward + backward (output gradient ``dy``) of each
    variant on ``x``, eager or captured in a CUDA graph (:func:`graph_or_eager`), timed by
    :func:`median_ms`."""
    def fwd_bwd(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], object]:
        def step() -> None:
            fn(x).backward(dy)

        return graph_or_eager(step, graph)

    return median_ms({k: fwd_bwd(f) for k, f in variants.items()}, rounds, reps, cuda)


def device_spec(device: str | torch.device):  # noqa: ANN201 - DeviceSpec | None
    """The datasheet peaks of ``device`` where it is a GPU this project knows
    (:data:`comera_engine.tensor.roofline.GPU_SPECS`), else None (a CPU: no roofline)."""
    from comera_engine.tensor.roofline import spec_for_name

    dev = torch.device(device)
    return spec_for_name(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else None


def roofline_cells(ms: dict[str, float], work: dict[str, tuple[float, float]],
                   device: str | torch.device, dtype: torch.dtype) -> dict[str, dict]:
    """Per variant (``ms``: its milliseconds, ``work``: its ``(FLOPs, bytes)``) what it
    achieved against the device's peaks: ``tflops``, ``gbps``, ``pct_roofline`` (None
    where the peaks are not known: :func:`comera_engine.tensor.roofline.roofline_report`)."""
    from comera_engine.tensor.roofline import dtype_name, roofline_report

    spec = device_spec(device)
    return {k: {key: rep[key] for key in ("tflops", "gbps", "pct_roofline", "roofline_ms")}
            for k, t in ms.items() if k in work
            for rep in [roofline_report(t * 1e-3, *work[k], spec, dtype_name(dtype))]}


def report_fused(name: str, rows: list[dict], lead: list[str], ratios: dict[str, str],
                 out: str) -> None:
    """Print a fused-kernel bench's table (per row the ``lead`` columns, each variant's
    median ms from ``row["ms"]``, its % of the roofline from ``row["roofline"]`` where
    the device's peaks are known, and the speed-ups ``ratios``: row key -> header) and
    write the rows, with the machine and the command, to ``<out>/<name>.json``."""
    variants = list(rows[0]["ms"])

    def pct(r: dict, k: str) -> str:
        v = (r.get("roofline") or {}).get(k, {}).get("pct_roofline")
        return "–" if v is None else f"{v:.0f} %"

    flat = [{**{k: r[k] for k in lead}, **{f"{k} ms": v for k, v in r["ms"].items()},
             **{f"{k} roof": pct(r, k) for k in variants},
             **{head: r[k] for k, head in ratios.items()}} for r in rows]
    print_and_write(flat, [(k, k, "") for k in lead]
                    + [(f"{k} ms", f"{k} ms", ".3f") for k in variants]
                    + [(f"{k} roof", f"{k} % roofline", "") for k in variants]
                    + [(head, head, ".2f") for head in ratios.values()], name,
                    {"machine": machine(), "command": " ".join(["python", *sys.argv]),
                     "rows": rows}, out)
