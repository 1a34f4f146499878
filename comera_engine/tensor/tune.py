"""Measure a device profile: every path of every case, timed on this device, ahead of any
run (``experiments/tune_gpu.py`` is the command; nothing here runs inside a training step).

For each :class:`~comera_engine.tensor.costs.Case`, :func:`measure_case` times one forward
+ backward of every path the op has (and of the dense layer it replaces: ``nn.Linear``,
``nn.Embedding``, the dense decoder), through the same functions the layers call
(:func:`~comera_engine.tensor.planner.tt_linear`, :func:`~comera_engine.tensor.planner.ttm_linear`,
:func:`~comera_engine.tensor.lookup.lookup_rows`, :func:`~comera_engine.ops.ttm_decode.ttm_decode`),
with fp32 parameters and, for a bf16/fp16 case, the forward under autocast (as the
trainer runs it); a graphed case is captured in a CUDA graph and replayed
(:func:`time_ms`). :func:`sweep_kernels` times each Triton kernel's candidate launch
configurations (:data:`comera_engine.kernels.configs.CANDIDATES`) at the shapes those
cases launch. :func:`tune` does both within a time budget, calibrates the cost model
(:func:`~comera_engine.tensor.profile.calibrate`) and writes the profile after every case,
so a run cut short still leaves a valid file.

On a CPU the same code runs for a *fake* device (peaks given by hand,
:class:`~comera_engine.tensor.roofline.DeviceSpec`): the tests' way to check the whole
chain without a GPU.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext

import torch
from torch import Tensor

from ..ops.gates import absorb_gates
from ..ops.ttm_decode import ttm_decode
from ..ops.ttm_lookup import merge_tables, split_point
from .costs import DEVICE_MODELS, OPS, Case
from .lookup import lookup_rows
from .planner import clear_caches, fused_available, tt_linear, ttm_linear
from .profile import DeviceProfile, Measurement, calibrate
from .roofline import DeviceSpec
from .tt import TTLinearCores, TTMCores

__all__ = ["case_steps", "measure_case", "sweep_kernels", "time_ms", "tune"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graphed(step: Callable[[], object], warmup: int = 3) -> Callable[[], object]:
    """``step`` captured into a CUDA graph (after ``warmup`` calls on a side stream, where
    lazy initialisation and Triton's compiles happen), returned as the graph's replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g.replay


def time_ms(step: Callable[[], object], device: torch.device, graph: bool = False,
            rounds: int = 5, reps: int = 10, warmup: int = 3) -> float:
    """Median over ``rounds`` of the mean milliseconds of ``reps`` calls of ``step``,
    eagerly or replayed from a CUDA graph (``graph``), after ``warmup`` calls."""
    run = graphed(step, warmup) if graph else step
    for _ in range(warmup):
        run()
    _sync(device)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        _sync(device)
        times.append((time.perf_counter() - t0) / reps * 1e3)
    return statistics.median(times)


def _leaf(t: Tensor) -> Tensor:
    return t.detach().requires_grad_()


def _gates(cores: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """Gates of 1 on every bond, all alive (what a step before any pruning runs)."""
    gates = [torch.ones(c.shape[-1], device=c.device, requires_grad=True) for c in cores[:-1]]
    return gates, [torch.ones(g.shape, dtype=torch.bool, device=g.device) for g in gates]


def case_steps(case: Case, device: torch.device, tau: float = 1e-2
               ) -> dict[str, Callable[[], object]]:
    """One forward + backward per path of ``case`` (and ``nn.*``, the dense layer it
    replaces), as closures over inputs made here: random fp32 cores at the case's ranks,
    gates of 1, ``tokens`` rows (or ids), the forward under autocast for a bf16/fp16
    case. Paths that cannot run here (``fused`` without the kernels) are left out."""
    g = torch.Generator(device="cpu").manual_seed(0)
    inner = list(case.ranks[1:-1])
    # no cast cache, as in the trainer's step: a cast cached outside a CUDA graph's
    # capture would be read inside it
    amp = (torch.autocast(device.type, dtype=_DTYPES[case.dtype], cache_enabled=False)
           if case.dtype != "float32" else nullcontext())
    T = case.tokens

    def fwd_bwd(forward: Callable[[], Tensor], dy: Tensor) -> Callable[[], object]:
        def step() -> None:
            with amp:
                y = forward()
            y.backward(dy.to(y.dtype))
        return step

    steps: dict[str, Callable[[], object]] = {}
    if case.op in ("tt_linear", "ttm_linear"):
        N, M = math.prod(case.rows), math.prod(case.cols)
        cls = TTLinearCores if case.op == "tt_linear" else TTMCores
        cores = [_leaf(c.data) for c in cls(case.rows, case.cols, inner, init_var=1.0 / N,
                                            device=device).cores]
        gates, alive = _gates(cores)
        # the TT linear's gates as its layer passes them: one vector, its alive flags one
        gate = torch.cat([v.detach() for v in gates]).requires_grad_()
        alive_flat = torch.cat(alive)
        x = torch.randn(T, N, generator=g).to(device).requires_grad_(case.need_dx)
        bias = torch.zeros(M, device=device, requires_grad=True)
        dy = torch.randn(T, M, generator=g).to(device)
        for p in OPS[case.op]:
            if p == "fused" and not fused_available(device, case.ranks[len(case.rows)]):
                continue
            if case.op == "tt_linear":
                steps[p] = fwd_bwd(lambda p=p: tt_linear(x, cores, len(case.rows), p, bias,
                                                         gate, tau, alive_flat), dy)
            else:
                steps[p] = fwd_bwd(lambda p=p: ttm_linear(x, cores, p, bias, gates, alive,
                                                          tau), dy)
        dense = torch.nn.Linear(N, M, device=device)
        steps["nn.Linear"] = fwd_bwd(lambda: dense(x), dy)
        return steps
    cores = [_leaf(c.data) for c in TTMCores(case.rows, case.cols, inner, init_var=1.0,
                                             device=device).cores]
    gates, alive = _gates(cores)
    V, D = math.prod(case.rows), math.prod(case.cols)
    h = split_point(case.rows, case.cols, case.ranks)
    if case.op == "ttm_lookup":
        ids = torch.randint(0, V, (T,), generator=g).to(device)
        dy = torch.randn(T, D, generator=g).to(device)
        for p in OPS["ttm_lookup"]:
            if p == "fused" and not fused_available(device, case.ranks[h]):
                continue
            steps[p] = fwd_bwd(lambda p=p: lookup_rows(ids, cores, gates, alive, tau, p, h), dy)
        table = torch.nn.Embedding(V, D, device=device)
        steps["nn.Embedding"] = fwd_bwd(lambda: table(ids), dy)
        return steps
    hid = torch.randn(T, D, generator=g).to(device).requires_grad_()
    dy = torch.randn(T, V, generator=g).to(device)
    for p in OPS["ttm_decode"]:
        steps[p] = fwd_bwd(lambda p=p: ttm_decode(hid, absorb_gates(cores, gates, tau, alive),
                                                  h, V, None, path=p), dy)
    weight = torch.randn(V, D, generator=g).to(device).requires_grad_()
    steps["nn.Linear"] = fwd_bwd(lambda: hid @ weight.t(), dy)
    return steps


def measure_case(case: Case, device: torch.device, rounds: int = 5, reps: int = 10,
                 log: Callable[[str], None] = print) -> Measurement | None:
    """Milliseconds of every path of ``case`` here (module doc); a path that fails is
    left out and said in ``log``; None where nothing ran."""
    ms = {}
    for name, step in case_steps(case, device).items():
        try:
            ms[name] = time_ms(step, device, case.graph, rounds, reps)
        except Exception as exc:  # noqa: BLE001 - a path that cannot run here is skipped
            _sync(device)
            log(f"  {name}: failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
    return Measurement(case, ms) if any(p in OPS[case.op] for p in ms) else None


# ---------------------------------------------------------------------------- kernels
Maker = Callable[[dict], Callable[[], object]]


def _kernel_jobs(cases: Iterable[Case], device: torch.device
                 ) -> list[tuple[str, tuple[int, ...], str, Maker]]:
    """Per distinct (kernel, shape, dtype) the fused paths of ``cases`` launch: a maker
    of the launch under a given configuration."""
    from ..kernels import configs
    from ..kernels import tt_linear as K
    from ..kernels import ttm_lookup as KL

    jobs: dict[tuple, tuple] = {}
    for c in cases:
        if c.op not in ("tt_linear", "ttm_lookup") or c.dtype not in _DTYPES:
            continue
        dt = _DTYPES[c.dtype]
        B = c.tokens

        def rnd(*shape: int, dt: torch.dtype = dt) -> Tensor:
            return torch.randn(*shape, device=device).to(dt)

        if c.op == "tt_linear":
            N, M, r = math.prod(c.rows), math.prod(c.cols), c.ranks[len(c.rows)]
            if not fused_available(device, r):
                continue
            for k, n in ((N, M), (M, N)):  # forward X·L·R, and dX = dY·Rᵀ·Lᵀ
                a, p, q = rnd(B, k), rnd(k, r), rnd(r, n)
                jobs[("chain", (B, k, r, n), c.dtype)] = (
                    lambda cfg, a=a, p=p, q=q: (lambda: K.chain(a, p, q, None, True, cfg)))
            for i, j in ((N, r), (r, M)):  # dL = Xᵀ·(dY·Rᵀ), dR = (X·L)ᵀ·dY
                a, gg = rnd(B, i), rnd(B, j)
                jobs[("matmul_tn", (B, i, j), c.dtype)] = (
                    lambda cfg, a=a, gg=gg: (lambda: K.matmul_tn(a, gg, None, cfg)))
            gy = rnd(B, M)
            jobs[("colsum", (B, M), c.dtype)] = (
                lambda cfg, gy=gy: (lambda: K.colsum(gy, None, cfg)))
        else:
            h = split_point(c.rows, c.cols, c.ranks)
            if not fused_available(device, c.ranks[h]):
                continue
            cores = [t.data.to(device) for t in TTMCores(c.rows, c.cols,
                                                         list(c.ranks[1:-1])).cores]
            A, Bt = (t.to(dt).contiguous() for t in merge_tables(cores, h))
            ids = torch.randint(0, A.shape[0] * Bt.shape[0], (B,), device=device)
            grad = rnd(B, A.shape[1], Bt.shape[2])
            shape = (B, A.shape[1], A.shape[2], Bt.shape[2])

            def forced(kernel: str, fn: Callable[[], object]) -> Maker:
                def make(cfg: dict) -> Callable[[], object]:
                    def run() -> object:
                        with configs.forced(kernel, cfg):
                            return fn()
                    return run
                return make

            jobs[("lookup", shape, c.dtype)] = forced(
                "lookup", lambda A=A, Bt=Bt, ids=ids: KL.lookup(ids, A, Bt))
            jobs[("segment_grad", shape, c.dtype)] = forced(
                "segment_grad",
                lambda A=A, Bt=Bt, ids=ids, grad=grad: KL.lookup_backward(ids, grad, A, Bt))
    return [(k, s, d, make) for (k, s, d), make in jobs.items()]


def sweep_kernels(cases: Iterable[Case], device: torch.device, rounds: int = 3,
                  reps: int = 10, deadline: float | None = None,
                  log: Callable[[str], None] = print) -> dict[str, list[dict]]:
    """Time every candidate configuration of each Triton kernel at the shapes the fused
    paths of ``cases`` launch; per kernel the best per shape (a profile's ``kernels``
    table: ``shape``, ``dtype``, ``config``, ``ms``, ``default_ms``). Configurations that
    fail to compile or run are skipped; the sweep stops at ``deadline``
    (``time.monotonic()``)."""
    from ..kernels import configs

    table: dict[str, list[dict]] = {}
    for kernel, shape, dtype, make in _kernel_jobs(cases, device):
        best, default_ms = None, None
        for cfg in configs.CANDIDATES[kernel]:
            if deadline is not None and time.monotonic() > deadline:
                break
            try:
                ms = time_ms(make(cfg), device, False, rounds, reps, warmup=1)
            except Exception as exc:  # noqa: BLE001 - a configuration that cannot run
                _sync(device)
                log(f"  {kernel} {shape} {cfg}: failed ({type(exc).__name__})")
                continue
            if cfg == configs.DEFAULTS[kernel]:
                default_ms = ms
            if best is None or ms < best[1]:
                best = (cfg, ms)
        if best is not None:
            table.setdefault(kernel, []).append(
                {"shape": list(shape), "dtype": dtype, "config": best[0], "ms": best[1],
                 "default_ms": default_ms})
            log(f"  {kernel} {shape} {dtype}: {best[0]} {best[1]:.4f} ms "
                f"(default {default_ms if default_ms is None else round(default_ms, 4)} ms)")
    return table


# ---------------------------------------------------------------------------- the profile
def tune(cases: list[Case], device: torch.device, name: str, spec: DeviceSpec, out: str,
         meta: dict | None = None, budget_s: float | None = None, kernels: bool = True,
         rounds: int = 5, reps: int = 10, log: Callable[[str], None] = print
         ) -> DeviceProfile:
    """Measure ``cases`` on ``device`` (in order, within 70 % of ``budget_s`` seconds:
    list the important ones first), sweep the kernels' launch configurations (within the
    rest), calibrate the model and write the profile of the device ``name`` of peaks
    ``spec`` to ``out`` after every case. Returns the profile."""
    start = time.monotonic()
    deadline = None if budget_s is None else start + 0.7 * budget_s
    sweep_end = None if budget_s is None else start + budget_s
    base = DEVICE_MODELS["cuda" if device.type == "cuda" else "cpu"]
    prof = DeviceProfile(name, spec, [], calibrate(spec, [], base),
                         meta={**(meta or {}), "complete": False})
    skipped = 0
    for i, case in enumerate(cases):
        if deadline is not None and time.monotonic() > deadline:
            skipped = len(cases) - i
            log(f"budget spent: {skipped} case(s) not measured")
            break
        t0 = time.perf_counter()
        m = measure_case(case, device, rounds, reps, log)
        if m is not None:
            prof.measurements.append(m)
            prof.fit = calibrate(spec, prof.measurements, base)
            prof.write(out)
        times = ", ".join(f"{k} {v:.3f}" for k, v in (m.ms.items() if m else ()))
        log(f"[{i + 1}/{len(cases)}] {case.op} {list(case.rows)}|{list(case.cols)} r"
            f"{max(case.ranks)} x{case.tokens} {case.dtype}{' graph' if case.graph else ''}: "
            f"{times} ms ({time.perf_counter() - t0:.1f} s)")
    if kernels:
        prof.kernels = sweep_kernels([m.case for m in prof.measurements], device,
                                     deadline=sweep_end, log=log)
    prof.meta.update(complete=skipped == 0, skipped_cases=skipped)
    prof.write(out)
    clear_caches()
    return prof
