"""The planner: which path each TT op of a step runs, chosen from measurements.

Every TT op has paths in three families (:mod:`comera_engine.tensor.costs`): the
**reconstructed** one (``W`` or the table made from the gated cores, one GEMM or
gather), the **factorised** PyTorch paths and, where a Triton kernel exists, the
**fused** one. ``Y = X·W`` for a TT linear, ``X ∈ R^{B×N}``, ``W ∈ R^{N×M}`` held as cores
``G_1..G_{2d}`` of shapes ``(r_{k-1}, s_k, r_k)`` with ``s = (n_1..n_d, m_1..m_d)``:
``halves`` (:mod:`comera_engine.ops.tt_linear_halves`), ``sweep``
(:mod:`comera_engine.ops.tt_linear_sweep`), ``dense`` (reconstruct ``W``, one GEMM) and
``fused`` (the Triton chain, :mod:`comera_engine.kernels.tt_linear`).

:func:`choose` picks, per (op, factors, ranks, tokens, dtype, CUDA graph or not), the
path of least time, taking each path's time from, in order:

1. the device's **profile** (:mod:`comera_engine.tensor.profile`): the time measured for
   this case, or for the nearest measured one scaled by the model;
2. the **cost model** (:mod:`comera_engine.tensor.costs`) of the device: calibrated on its
   profile where it has one; else the roofline of its datasheet peaks at the
   efficiencies calibrated on the profiles there are; else a model by device kind
   (:data:`DEVICE_MODELS`).

On the CPU without a profile the TT-matrix ops keep their one established path
(``dense`` for a ``ttm`` linear, ``gather`` for a lookup, the smaller-memory path for the
tied decoder) and the TT linear its CPU cost model. The fused path is a candidate only
where the kernels run (:func:`comera_engine.kernels.runs_on`: CUDA with
``COMERA_KERNELS=1``, opt-in, as Triton compiles on first launch). ``COMERA_PATHS``
(``reconstructed``, ``factorised`` or ``fused``) restricts every choice to one family
where the op has it (the step benchmark's way to time each). Nothing is timed here: a
profile is measured ahead by the tuning script. Choices are cached; :func:`explain` and
:func:`explain_case` return the numbers behind them.

The choice knows it runs in a CUDA graph from :func:`graph_planning` (the trainer's graphed
step sets it for its warm-up and capture) or from a capture in progress.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..ops.gates import apply_gates, gate_masks
from ..ops.merges import layout, merge_left, merge_right
from ..ops.tt_linear_halves import tt_linear_halves, tt_linear_reconstructed
from ..ops.tt_linear_sweep import tt_linear_sweep
from ..ops.ttm_decode import decode_path
from ..ops.ttm_linear import ttm_linear_sweep
from ..ops.ttm_lookup import split_point
from ..ops.ttm_matrix import ttm_matrix
from .costs import (
    DEVICE_MODELS,
    FAMILY,
    OPS,
    Case,
    DeviceModel,
    PathCost,
    case_costs,
    ttm_reconstruct_macs,
)
from .grouped import prepared_halves
from .profile import DeviceProfile, fallback_model, find_profile
from .roofline import dtype_name, spec_for_name

__all__ = ["DEVICE_MODELS", "PATHS", "Choice", "DeviceModel", "PathCost", "choices_made",
           "choose", "clear_caches", "compute_dtype", "describe_choices", "device_model",
           "estimate", "estimate_ttm", "explain", "explain_case", "explain_decode",
           "explain_lookup", "explain_ttm", "fused_available", "graph_planning", "in_graph",
           "plan", "plan_case", "tt_linear", "tt_linear_dense", "ttm_linear",
           "ttm_reconstruct_macs"]

PATHS = OPS["tt_linear"]


def tt_linear_dense(x: Tensor, cores: Sequence[Tensor], d: int,
                    bias: Tensor | None = None, gates: Sequence[Tensor] | Tensor = (),
                    tau: float = 0.0, alive: Sequence[Tensor] | Tensor = ()) -> Tensor:
    """The reconstructed path: ``W = L·R`` from the (gated) cores, then one GEMM
    (:func:`comera_engine.ops.tt_linear_halves.tt_linear_reconstructed`, one Function).
    ``x``: ``(B, N)``; returns ``(B, M)`` (``+ bias``)."""
    return tt_linear_reconstructed(x, cores, d, bias, gates, tau, alive)


_IMPL = {"halves": tt_linear_halves, "sweep": tt_linear_sweep}


# ---------------------------------------------------------------------------- graph or not
_STATE = threading.local()


@contextmanager
def graph_planning(on: bool = True) -> Iterator[None]:
    """Plan as for a step replayed in a CUDA graph (``on``) within this block: the paths
    a graphed step is warmed up with are the ones it is captured with."""
    prev = getattr(_STATE, "graph", False)
    _STATE.graph = on
    try:
        yield
    finally:
        _STATE.graph = prev


def in_graph(t: Tensor) -> bool:
    """Whether ``t``'s op is planned for a CUDA graph: inside :func:`graph_planning`, or
    while a capture is in progress on ``t``'s device."""
    if getattr(_STATE, "graph", False):
        return True
    return bool(t.is_cuda and torch.cuda.is_current_stream_capturing())


def compute_dtype(t: Tensor, like: Tensor | None = None) -> torch.dtype:
    """The dtype ``t``'s products run in: autocast's where it is on for ``t``'s device,
    else ``t``'s (``like``'s for integer ``t``, such as ids)."""
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return like.dtype if like is not None and not t.is_floating_point() else t.dtype


# ---------------------------------------------------------------------------- the device
@lru_cache(maxsize=16)
def _cuda_major(dev: torch.device) -> int:
    """The compute capability's major version of ``dev`` (0 where CUDA cannot say)."""
    try:
        return int(torch.cuda.get_device_capability(dev)[0])
    except (RuntimeError, AssertionError, ValueError):
        return 0


@lru_cache(maxsize=16)
def _cuda_name(dev: torch.device) -> str | None:
    """The name CUDA gives ``dev`` (None where CUDA cannot say)."""
    try:
        return str(torch.cuda.get_device_name(dev))
    except (RuntimeError, AssertionError, ValueError):
        return None


def _env() -> tuple[str | None, ...]:
    """The settings a choice depends on besides the case (part of the cache keys)."""
    return tuple(os.environ.get(k) for k in ("COMERA_PATHS", "COMERA_KERNELS",
                                             "COMERA_DEVICE_PROFILE", "COMERA_PROFILE_DIR",
                                             "TRITON_INTERPRET"))


@lru_cache(maxsize=32)
def _device_state(dev: torch.device, env: tuple, major: int, name: str | None
                  ) -> tuple[DeviceModel, DeviceProfile | None]:
    if os.environ.get("COMERA_DEVICE_PROFILE"):
        base = DEVICE_MODELS["cpu" if dev.type != "cuda" else "cuda"]
        prof = find_profile("")
        if prof is not None:
            _install_kernel_configs(prof)
        return (prof.model(base) if prof else base), prof
    if dev.type != "cuda":
        return DEVICE_MODELS["cpu"], None
    base = DEVICE_MODELS.get(f"cuda-sm{major}", DEVICE_MODELS["cuda"])
    if name is None:
        return base, None
    prof = find_profile(name)
    if prof is not None:
        _install_kernel_configs(prof)
        return prof.model(base), prof
    spec = spec_for_name(name)
    return (fallback_model(spec, base) if spec else base), None


def _install_kernel_configs(prof: DeviceProfile) -> None:
    """The Triton kernels launch with the profile's tuned configurations from now on."""
    from ..kernels import configs

    configs.install(prof.kernels)


def device_model(device: torch.device | str) -> tuple[DeviceModel, DeviceProfile | None]:
    """The cost model of ``device`` and its profile (None without one): the profile's
    calibrated model; a GPU of known datasheet peaks without one, the roofline model
    calibrated on the profiles there are; otherwise the model of its kind
    (:data:`DEVICE_MODELS`: the CPU, CUDA by compute capability, generic CUDA)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return _device_state(dev, _env(), 0, None)
    return _device_state(dev, _env(), _cuda_major(dev), _cuda_name(dev))


def clear_caches() -> None:
    """Forget cached devices, profiles and choices (after a profile was written)."""
    for fn in (_cuda_major, _cuda_name, _device_state, _choose_cached, case_costs):
        getattr(fn, "cache_clear", lambda: None)()  # (a test may have replaced one)
    from . import profile

    profile._read_cached.cache_clear()


# ---------------------------------------------------------------------------- the choice
@dataclass(frozen=True)
class Choice:
    """A planner's choice: the path, where its times came from (``"measured"``,
    ``"nearest"``: a measured case scaled, ``"model"``, ``"cpu default"``), the
    candidates it chose among, per path the seconds it compared (measured or modelled)
    and the model and profile used."""

    path: str
    source: str
    candidates: tuple[str, ...]
    seconds: tuple[tuple[str, float], ...]
    measured: tuple[str, ...]
    device_model: str
    model_source: str
    profile: str | None


def fused_available(dev: torch.device, rank: int) -> bool:
    """The fused kernels take tensors on ``dev`` (:func:`comera_engine.kernels.runs_on`)
    and a middle rank of ``rank`` fits their tile."""
    from ..kernels import runs_on_device

    if not runs_on_device(dev.type):
        return False
    from ..kernels.tt_linear import MAX_RANK

    return 1 <= rank <= MAX_RANK


def _middle_rank(case: Case) -> int:
    if case.op == "tt_linear":
        return case.ranks[len(case.rows)]
    return case.ranks[split_point(case.rows, case.cols, case.ranks)]


def _candidates(case: Case, dev: torch.device) -> tuple[str, ...]:
    """The op's paths that can run here, within ``COMERA_PATHS``'s family where the op
    has a path of it."""
    paths = [p for p in OPS[case.op]
             if p != "fused" or fused_available(dev, _middle_rank(case))]
    family = (os.environ.get("COMERA_PATHS") or "auto").strip().lower()
    if family not in ("", "auto"):
        picked = [p for p in paths if FAMILY[p] == family]
        paths = picked or paths
    return tuple(paths)


def _cpu_default(case: Case) -> str | None:
    """The CPU's established path of a TT-matrix op (module doc), None for a TT linear."""
    if case.op == "ttm_linear":
        return "dense"
    if case.op == "ttm_lookup":
        return "gather"
    if case.op == "ttm_decode":
        h = split_point(case.rows, case.cols, case.ranks)
        return decode_path(case.tokens, math.prod(case.rows[:h]), math.prod(case.cols[:h]),
                           case.ranks[h], math.prod(case.rows[h:]), math.prod(case.cols[h:]))
    return None


def _choose(case: Case, dev: torch.device) -> Choice:
    dm, prof = device_model(dev)
    cands = _candidates(case, dev)
    costs = {c.path: c.seconds for c in case_costs(case, dm)}
    measured, how = prof.times(case, dm) if prof is not None else ({}, "")
    seconds = {p: measured.get(p, costs[p]) for p in cands}
    got = tuple(p for p in cands if p in measured)
    source = how if got else "model"
    if min(case.ranks) == 0:  # the zero map: nothing to run
        path = "halves" if case.op == "tt_linear" else cands[0]
    elif prof is None and dev.type != "cuda" and (fixed := _cpu_default(case)) in cands:
        path, source = fixed, "cpu default"
    else:
        path = min(cands, key=lambda p: seconds[p])
    return Choice(path, source, cands, tuple(seconds.items()), got, dm.name, dm.source,
                  prof.source if prof is not None else None)


@lru_cache(maxsize=8192)
def _choose_cached(op: str, rows: tuple, cols: tuple, ranks: tuple, tokens: int,
                   dev: torch.device, dtype: str, graph: bool, training: bool,
                   need_dx: bool, env: tuple) -> Choice:
    return _choose(Case(op, rows, cols, ranks, tokens, dtype, graph, training, need_dx), dev)


_plan_cached = _choose_cached  # the name the planner's cache had


def choose(case: Case, device: torch.device | str = "cpu") -> Choice:
    """The path of least time for ``case`` on ``device`` (module doc; cached)."""
    return _choose_cached(case.op, case.rows, case.cols, case.ranks, case.tokens,
                          torch.device(device), case.dtype, case.graph, case.training,
                          case.need_dx, _env())


def graph_constant(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` marked as ``torch.compiler.assume_constant_result`` marks it (Dynamo calls
    it while tracing and puts its result in the graph as a constant) without importing
    Dynamo, which that call does: an eager run never imports it (seconds). For functions
    of shapes and devices only; a torch whose Dynamo ignores the mark traces ``fn``
    instead (the same result)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


#: :func:`layout` as a constant of a traced graph (see :func:`plan_case`)
_layout_constant = graph_constant(layout.__wrapped__)

#: what :func:`plan_case` answered in this process: its arguments -> the choice
_SEEN: dict[tuple, Choice] = {}


@graph_constant  # traced by Dynamo: a constant of the graph (shapes and device, no data)
def plan_case(op: str, rows: Sequence[int], cols: Sequence[int], ranks: Sequence[int],
              tokens: int, device: torch.device | str, dtype: torch.dtype | str,
              graph: bool = False, training: bool = True, need_dx: bool = True) -> str:
    """:func:`choose`'s path name for an op given by its parts (cached; kept for
    :func:`choices_made`). Under ``torch.compile`` Dynamo calls it while tracing and puts
    the answer in the graph as a constant: it neither traces the cost model nor warns
    about the caches."""
    key = (op, tuple(rows), tuple(cols), tuple(ranks), int(tokens), torch.device(device),
           dtype_name(dtype), bool(graph), bool(training), bool(need_dx))
    ch = _choose_cached(*key, _env())
    _SEEN[key] = ch
    return ch.path


def choices_made(clear: bool = False) -> list[tuple[Case, Choice]]:
    """The cases the layers planned in this process (since the last ``clear``) and what
    was chosen for each: what a run reports it runs."""
    out = [(Case(*k[:5], *k[6:]), ch) for k, ch in _SEEN.items()]
    if clear:
        _SEEN.clear()
    return out


def describe_choices(pairs: Sequence[tuple[Case, Choice]]) -> str:
    """One line for :func:`choices_made`: per case the op, ``N×M`` (rows × dim for a
    table), largest rank, rows, dtype, graph or not, the path and where its time came
    from; then the cost model and profile used."""
    if not pairs:
        return "no TT op planned"
    parts = []
    for c, ch in pairs:
        shape = f"{math.prod(c.rows)}×{math.prod(c.cols)}"
        parts.append(f"{c.op} {shape} r{max(c.ranks)} ×{c.tokens} "
                     f"{c.dtype}{', graph' if c.graph else ''}: {ch.path} ({ch.source})")
    ch = pairs[-1][1]
    where = f"profile {Path(ch.profile).name}" if ch.profile else ch.model_source
    return "; ".join(parts) + f". Cost model: {ch.device_model} ({where})."


def plan(B: int, in_factors: Sequence[int], out_factors: Sequence[int], ranks: Sequence[int],
         device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
         training: bool = True, need_dx: bool = True, graph: bool = False) -> str:
    """The path of least time for a TT linear (``ranks``: ``[1, r_1, …, r_{2d-1}, 1]``)."""
    return plan_case("tt_linear", in_factors, out_factors, ranks, B, device, dtype, graph,
                     training, need_dx)


# ---------------------------------------------------------------------------- explaining it
def _case(op: str, rows: Sequence[int], cols: Sequence[int], ranks: Sequence[int],
          tokens: int, dtype: torch.dtype | str, graph: bool, training: bool,
          need_dx: bool = True) -> Case:
    return Case(op, tuple(int(v) for v in rows), tuple(int(v) for v in cols),
                tuple(int(v) for v in ranks), int(tokens), dtype_name(dtype), bool(graph),
                bool(training), bool(need_dx))


def explain_case(case: Case, device: torch.device | str = "cpu") -> dict:
    """What the planner sees for ``case``: the chosen ``path``, its ``source``
    (measured, nearest, model, cpu default), the ``candidates``, per path the modelled
    MACs, bytes, kernels and seconds (``paths``) and the seconds compared
    (``seconds``: measured where ``measured`` lists the path), and the cost model and
    profile used."""
    ch = choose(case, device)
    dm, _ = device_model(device)
    return {
        "path": ch.path, "source": ch.source, "op": case.op,
        "device_model": ch.device_model, "model_source": ch.model_source,
        "profile": ch.profile, "batch": case.tokens, "ranks": list(case.ranks),
        "dtype": case.dtype, "graph": case.graph, "candidates": list(ch.candidates),
        "seconds": dict(ch.seconds), "measured": list(ch.measured),
        "paths": {c.path: asdict(c) for c in case_costs(case, dm)},
    }


def _dense_macs(B: int, N: int, M: int) -> dict:
    return {"dense_linear_macs_fwd": B * N * M, "dense_linear_macs_fwd_bwd": 3 * B * N * M}


def estimate(B: int, in_factors: Sequence[int], out_factors: Sequence[int],
             ranks: Sequence[int], device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32, training: bool = True,
             need_dx: bool = True, graph: bool = False) -> dict[str, PathCost]:
    """Modelled cost of every TT-linear path for batch ``B``; ``ranks`` is
    ``[1, r_1, …, r_{2d-1}, 1]``."""
    if len(in_factors) != len(out_factors) or len(ranks) != 2 * len(in_factors) + 1:
        raise ValueError(
            f"ranks: need 2d+1 = {2 * len(in_factors) + 1} ranks for d = {len(in_factors)}, "
            f"got {len(ranks)}"
        )
    case = _case("tt_linear", in_factors, out_factors, ranks, B, dtype, graph, training,
                 need_dx)
    return {c.path: c for c in case_costs(case, device_model(device)[0])}


def explain(B: int, in_factors: Sequence[int], out_factors: Sequence[int],
            ranks: Sequence[int], device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32, training: bool = True,
            graph: bool = False) -> dict:
    """:func:`explain_case` for a TT linear (``ranks``: ``[1, r_1, …, r_{2d-1}, 1]``),
    plus the dense ``nn.Linear`` reference MACs (``B·N·M`` forward)."""
    case = _case("tt_linear", in_factors, out_factors, ranks, B, dtype, graph, training)
    return {**explain_case(case, device),
            **_dense_macs(B, math.prod(in_factors), math.prod(out_factors))}


def _ttm_case(B: int, in_factors: Sequence[int], out_factors: Sequence[int],
              ranks: Sequence[int], dtype: torch.dtype | str, training: bool,
              need_dx: bool, graph: bool) -> Case:
    d = len(in_factors)
    if len(out_factors) != d:
        raise ValueError(f"out_factors: a TT matrix pairs them with the {d} in_factors, "
                         f"got {len(out_factors)}")
    if len(ranks) != d + 1:
        raise ValueError(f"ranks: need d+1 = {d + 1} ranks for d = {d} TTM cores, "
                         f"got {len(ranks)}")
    return _case("ttm_linear", in_factors, out_factors, ranks, B, dtype, graph, training,
                 need_dx)


def estimate_ttm(B: int, in_factors: Sequence[int], out_factors: Sequence[int],
                 ranks: Sequence[int], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, training: bool = True,
                 need_dx: bool = True, graph: bool = False) -> PathCost:
    """Modelled cost of a ``"ttm"`` TT linear's reconstructed path (``dense``):
    materialise ``W`` from the gated cores (:func:`ttm_reconstruct_macs`, batch
    independent), then ``X·W``; backward ``dW``, ``dX`` and the reconstruction's."""
    case = _ttm_case(B, in_factors, out_factors, ranks, dtype, training, need_dx, graph)
    return {c.path: c for c in case_costs(case, device_model(device)[0])}["dense"]


def explain_ttm(B: int, in_factors: Sequence[int], out_factors: Sequence[int],
                ranks: Sequence[int], device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, training: bool = True,
                graph: bool = False) -> dict:
    """:func:`explain` for a ``"ttm"`` TT linear (paths ``dense``: ``W`` from the cores
    and one GEMM, and ``sweep``: ``X`` through the cores one at a time); ``ranks`` is
    ``[1, r_1, …, r_{d-1}, 1]``. Plus ``layout`` and ``reconstruct_macs``."""
    case = _ttm_case(B, in_factors, out_factors, ranks, dtype, training, True, graph)
    return {**explain_case(case, device), "layout": "ttm",
            **_dense_macs(B, math.prod(in_factors), math.prod(out_factors)),
            "reconstruct_macs": ttm_reconstruct_macs(in_factors, out_factors, ranks)}


def explain_lookup(tokens: int, vocab_factors: Sequence[int], dim_factors: Sequence[int],
                   ranks: Sequence[int], device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32, training: bool = True,
                   graph: bool = False) -> dict:
    """:func:`explain_case` for a TTM embedding lookup of ``tokens`` ids (paths
    ``dense``: the table from the cores, then its rows; ``gather``: rows from the two
    half tables; ``fused``: the Triton lookup). ``ranks``: ``[1, r_1, …, r_{d-1}, 1]``."""
    return explain_case(_case("ttm_lookup", vocab_factors, dim_factors, ranks, tokens,
                              dtype, graph, training), device)


def explain_decode(tokens: int, vocab_factors: Sequence[int], dim_factors: Sequence[int],
                   ranks: Sequence[int], device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32, training: bool = True,
                   graph: bool = False) -> dict:
    """:func:`explain_case` for the tied decoder ``h·Eᵀ`` on ``tokens`` hidden states
    (paths ``table``: build ``E``; ``tt``: through the half tables)."""
    return explain_case(_case("ttm_decode", vocab_factors, dim_factors, ranks, tokens,
                              dtype, graph, training), device)


# ---------------------------------------------------------------------------- running it
def tt_linear(x: Tensor, cores: Sequence[Tensor], d: int, path: str | None = None,
              bias: Tensor | None = None, gates: Sequence[Tensor] | Tensor | None = None,
              tau: float = 0.0, alive: Sequence[Tensor] | Tensor | None = None) -> Tensor:
    """``Y = X·W (+ bias)`` for the TT weight given by ``cores``.

    ``x``: ``(..., N)``; ``bias``: ``(M,)`` (the padded output width) or None; returns
    ``(..., M)``. ``path=None`` lets the planner choose (:func:`choose`); ``"fused"``
    runs the Triton chain where the kernels take ``x`` and the halves path otherwise
    (the same math). ``gates``: the ``2d-1`` rank gates, or all of them as one vector (a
    train's ``gate``, with ``alive`` its flags as one vector: what a layer passes, so the
    gradient reaches the parameter without split views); entry ``i`` of bond ``k`` is
    active where ``alive[k][i]`` (bool, default all True) and ``|g_k[i]| > tau``, and
    inactive entries act as removed ranks (:func:`gate_masks`, :func:`apply_gates`).
    Pass the raw gates rather than pre-gated cores: every path's Function absorbs them
    inside, masks included, with no autograd node per gate.
    """
    if len(cores) != 2 * d:
        raise ValueError(f"cores: expected 2d = {2 * d} cores, got {len(cores)}")
    shapes = tuple(tuple(c.shape) for c in cores)
    ins, outs, ranks = (_layout_constant(shapes, d) if torch.compiler.is_compiling()
                        else layout(shapes, d))
    N = math.prod(ins)
    if x.shape[-1] != N:
        raise ValueError(f"x: last dimension {x.shape[-1]} != N = {N}")
    lead = x.shape[:-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, N)  # a no-op view is still an autograd node
    if min(ranks) == 0:  # a bond of rank 0: the zero map
        y0 = x.new_zeros(*lead, math.prod(outs))
        return y0 + bias if bias is not None else y0
    if path is None:
        training = torch.is_grad_enabled() and (
            x.requires_grad or any(c.requires_grad for c in cores))
        path = plan_case("tt_linear", ins, outs, ranks, x2.shape[0], x.device,
                         compute_dtype(x), in_graph(x), training, x.requires_grad)
    if path not in PATHS:
        raise ValueError(f"path: unknown path {path!r}; choose one of {PATHS}")
    if path == "sweep" and x2.shape[0] == 0:  # no rows: the sweep's shapes are ambiguous
        path = "halves"
    flat = isinstance(gates, Tensor)
    if flat and gates.shape[0] != sum(ranks[1:-1]):
        raise ValueError(f"gates: one vector of {sum(ranks[1:-1])} entries (all bonds), got "
                         f"{tuple(gates.shape)}")
    if gates is not None and not flat and len(gates) != 2 * d - 1:
        raise ValueError(f"gates: expected 2d-1 = {2 * d - 1} gate vectors, got {len(gates)}")
    halves = prepared_halves(cores[0]) if path in ("halves", "dense") else None
    if halves is not None:  # made with the other trains of its shape (tensor.grouped)
        L, R = halves
        a, b = (x2, L @ R) if path == "dense" else (x2 @ L, R)
        y = torch.addmm(bias, a, b) if bias is not None else a @ b
    elif path == "fused" and _fused_runs(x2, ranks[d]):
        if flat:  # the chain merges autograd-tracked cores: per-bond views
            sizes = list(ranks[1:-1])
            gates = list(gates.split(sizes))
            alive = list(alive.split(sizes)) if isinstance(alive, Tensor) else alive
        y = _fused_halves(x2, cores, d, bias, gates, tau, alive)
    else:  # (the reconstructed path by its module name: what a test counts)
        impl = tt_linear_dense if path == "dense" else _IMPL["halves" if path == "fused"
                                                            else path]
        y = impl(x2, cores, d, bias, () if gates is None else gates, tau,
                 () if alive is None else alive)
    return y if x.dim() == 2 else y.reshape(*lead, y.shape[-1])  # (…, 0, M) for no rows


def ttm_linear(x: Tensor, cores: Sequence[Tensor], path: str, bias: Tensor | None = None,
               gates: Sequence[Tensor] = (), alive: Sequence[Tensor] = (), tau: float = 0.0,
               out_features: int | None = None) -> Tensor:
    """``Y = X·W (+ bias)`` for the TT-matrix weight ``W`` (``∏ n_k × ∏ m_k``) of the raw
    ``cores`` ``(r_{k-1}, n_k, m_k, r_k)`` gated by ``gates`` (``alive``, ``tau``), on
    ``path``: ``"dense"`` (``W`` from the gated cores,
    :func:`comera_engine.ops.ttm_matrix.ttm_matrix`, one GEMM) or ``"sweep"`` (``X``
    through one core at a time, :func:`comera_engine.ops.ttm_linear.ttm_linear_sweep`).
    ``x``: ``(..., N')`` with ``N' <= ∏ n_k`` (the rest of the inputs read as zeros);
    returns ``(..., out_features)`` (default ``∏ m_k``; the other outputs dropped)."""
    N = math.prod(int(c.shape[1]) for c in cores)
    M = math.prod(int(c.shape[2]) for c in cores)
    n_in, n_out = x.shape[-1], out_features or M
    lead = x.shape[:-1]
    if path == "dense":
        W = ttm_matrix(cores, gates, alive, tau)[:n_in, :n_out]
        return torch.nn.functional.linear(x, W.t(), bias)
    if path != "sweep":
        raise ValueError(f"path: a ttm linear's paths are dense, sweep; got {path!r}")
    if min(int(c.shape[-1]) for c in cores) == 0:  # a bond of rank 0: the zero map
        y = x.new_zeros(*lead, n_out)
        return y + bias if bias is not None else y
    if n_in != N:
        x = torch.nn.functional.pad(x, (0, N - n_in))
    y = ttm_linear_sweep(x.reshape(-1, N), cores, gates, alive, tau)
    y = y[:, :n_out].reshape(*lead, n_out)
    return y + bias.to(y.dtype) if bias is not None else y


def _fused_runs(x: Tensor, rank: int) -> bool:
    """The fused Triton chain takes ``x`` (:func:`comera_engine.kernels.runs_on`: CUDA
    with ``COMERA_KERNELS=1``, opt-in) and the middle rank fits the kernel's tile."""
    return fused_available(x.device, rank)


def _fused_halves(x: Tensor, cores: Sequence[Tensor], d: int, bias: Tensor | None,
                  gates: Sequence[Tensor] | None, tau: float,
                  alive: Sequence[Tensor] | None) -> Tensor:
    """``(X·L)·R + b`` on the fused kernels, ``L``/``R`` merged from the gated cores by
    autograd-tracked products (batch independent, so small)."""
    from ..kernels.tt_linear import tt_linear_chain

    device_model(x.device)  # its profile's kernel configurations, where it has one
    if gates:
        cores = apply_gates(cores, gates, gate_masks(gates, tau, alive))
    dtype = compute_dtype(x)
    L = merge_left(cores[:d])[-1].to(dtype)
    R = merge_right(cores[d:])[0].to(dtype)
    b = bias.to(dtype) if bias is not None else None
    return tt_linear_chain(x.to(dtype).contiguous(), L, R, b)
