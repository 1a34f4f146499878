"""The TT-linear planner: a cost model per device kind, and the path dispatch.

``Y = X · W``, ``X ∈ R^{B×N}``, ``W ∈ R^{N×M}`` held as cores ``G_1..G_{2d}`` of shapes
``(r_{k-1}, s_k, r_k)`` with ``s = (n_1..n_d, m_1..m_d)``. Three paths compute ``Y``:
``halves`` (:mod:`comera_engine.ops.tt_linear_halves`), ``sweep``
(:mod:`comera_engine.ops.tt_linear_sweep`) and ``dense`` (reconstruct ``W``, one GEMM;
wins only when ``r_d`` is close to full rank). A cost model (MACs and bytes moved,
forward and backward, plus a per-kernel launch cost) estimates each path's time on the
device, from a small table of device models (:data:`DEVICE_MODELS`: the CPU, CUDA by
compute capability, a generic CUDA fallback); :func:`plan` picks the cheapest, caching
the choice per (shapes, ranks, batch, device, dtype, training); :func:`explain` returns
the numbers behind the choice and names the device model used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache

import torch
from torch import Tensor

from ..ops.gates import apply_gates, gate_masks
from ..ops.merges import layout, merge_left, merge_right
from ..ops.tt_linear_halves import tt_linear_halves
from ..ops.tt_linear_sweep import sweep_merges, tt_linear_sweep

__all__ = ["DEVICE_MODELS", "PATHS", "DeviceModel", "PathCost", "estimate", "estimate_ttm",
           "explain", "explain_ttm", "plan", "tt_linear", "tt_linear_dense",
           "ttm_reconstruct_macs"]

PATHS = ("halves", "sweep", "dense")


def tt_linear_dense(x: Tensor, cores: Sequence[Tensor], d: int) -> Tensor:
    """Reconstruct ``W = L·R`` then one GEMM. ``x``: ``(B, N)``; returns ``(B, M)``."""
    W = merge_left(cores[:d])[-1] @ merge_right(cores[d:])[0]
    return x @ W


_IMPL = {"halves": tt_linear_halves, "sweep": tt_linear_sweep, "dense": tt_linear_dense}


# ---------------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class DeviceModel:
    """Roofline-style device constants: MAC rate (MAC/s) for large GEMMs, memory
    bandwidth (B/s), and a fixed cost per kernel/op (s). A GEMM whose smallest dimension
    ``k`` is below ``full_eff_dim`` runs at ``k/full_eff_dim`` of the peak rate (skinny
    GEMMs are bandwidth-limited)."""

    name: str
    mac_rate: float
    bandwidth: float
    op_overhead: float
    full_eff_dim: int = 32

    @staticmethod
    def for_device(device: torch.device | str) -> DeviceModel:
        """The model of ``device``'s kind (:data:`DEVICE_MODELS`): CUDA by compute
        capability (major version), then generic CUDA; anything else the CPU model."""
        dev = torch.device(device)
        if dev.type != "cuda":
            return DEVICE_MODELS["cpu"]
        return DEVICE_MODELS.get(f"cuda-sm{_cuda_major(dev)}", DEVICE_MODELS["cuda"])


DEVICE_MODELS: dict[str, DeviceModel] = {
    # a 2-16 core x86 server CPU, fp32 (MKL/oneDNN)
    "cpu": DeviceModel("cpu", mac_rate=4.0e10, bandwidth=1.2e10, op_overhead=8e-6,
                       full_eff_dim=16),
    # generic CUDA GPU (any compute capability not listed below)
    "cuda": DeviceModel("cuda", mac_rate=2.5e13, bandwidth=2.0e12, op_overhead=6e-6,
                        full_eff_dim=64),
    # Volta/Turing (sm7x): ~15 TFLOP/s-class tensor cores, ~0.9 TB/s
    "cuda-sm7": DeviceModel("cuda-sm7", mac_rate=1.2e13, bandwidth=9.0e11, op_overhead=7e-6,
                            full_eff_dim=64),
    # Ampere/Ada (sm8x): A100-class TF32
    "cuda-sm8": DeviceModel("cuda-sm8", mac_rate=2.5e13, bandwidth=2.0e12, op_overhead=6e-6,
                            full_eff_dim=64),
    # Hopper (sm9x): H100-class TF32, HBM3
    "cuda-sm9": DeviceModel("cuda-sm9", mac_rate=5.0e13, bandwidth=3.3e12, op_overhead=5e-6,
                            full_eff_dim=64),
}
"""The cost model per device kind: ``"cpu"``, ``"cuda-sm<major>"`` by compute capability,
and ``"cuda"`` for GPUs not listed. Rates are order-of-magnitude (the planner compares
paths on one device, so only their ratios matter)."""


@lru_cache(maxsize=16)
def _cuda_major(dev: torch.device) -> int:
    """The compute capability's major version of ``dev`` (0 where CUDA cannot say)."""
    try:
        return int(torch.cuda.get_device_capability(dev)[0])
    except (RuntimeError, AssertionError, ValueError):
        return 0


@dataclass(frozen=True)
class PathCost:
    """Estimated work of one path. MACs and bytes are totals for the direction(s)."""

    path: str
    macs_fwd: int
    macs_bwd: int
    bytes_fwd: int
    bytes_bwd: int
    ops_fwd: int
    ops_bwd: int
    seconds: float  # estimated (fwd, plus bwd when training)


class _Acc:
    """Accumulates GEMM-like ops: MACs, bytes, op count and modelled time."""

    def __init__(self, dm: DeviceModel, elt: int) -> None:
        self.dm, self.elt = dm, elt
        self.macs = self.bytes = self.ops = 0
        self.t = 0.0

    def gemm(self, a: int, k: int, b: int) -> None:
        """``(a×k)·(k×b)``."""
        macs = a * k * b
        byts = (a * k + k * b + a * b) * self.elt
        eff = min(1.0, max(1, min(a, k, b)) / self.dm.full_eff_dim)
        self.macs += macs
        self.bytes += byts
        self.ops += 1
        self.t += max(macs / (self.dm.mac_rate * eff), byts / self.dm.bandwidth)
        self.t += self.dm.op_overhead

    def copy(self, numel: int) -> None:
        self.bytes += 2 * numel * self.elt
        self.ops += 1
        self.t += 2 * numel * self.elt / self.dm.bandwidth + self.dm.op_overhead


def _merge_costs(acc: _Acc, ins: Sequence[int], outs: Sequence[int], r: Sequence[int]) -> None:
    d = len(ins)
    a = ins[0]
    for k in range(1, d):
        acc.gemm(a, r[k], ins[k] * r[k + 1])
        a *= ins[k]
    b = outs[-1]
    for j in range(d - 2, -1, -1):
        acc.gemm(r[d + j] * outs[j], r[d + j + 1], b)
        b *= outs[j]


def _path_cost(path: str, B: int, ins: Sequence[int], outs: Sequence[int], r: Sequence[int],
               dm: DeviceModel, elt: int, training: bool, need_dx: bool) -> PathCost:
    d = len(ins)
    N, M, rd = math.prod(ins), math.prod(outs), r[d]
    f, g = _Acc(dm, elt), _Acc(dm, elt)
    for _ in range(len(r) - 2):  # gate scaling of each core (both paths pay it)
        f.copy(0)
    if path == "halves":
        _merge_costs(f, ins, outs, r)
        f.gemm(B, N, rd)
        f.gemm(B, rd, M)
        g.gemm(B, M, rd)  # dXL
        g.gemm(rd, B, M)  # dR
        if need_dx:
            g.gemm(B, rd, N)
        g.gemm(N, B, rd)  # dL
        _merge_costs(g, ins, outs, r)
        _merge_costs(g, ins, outs, r)
    elif path == "sweep":
        head, tail = sweep_merges(B, ins, outs, r)
        # the swept cores as (r_in, mode, r_out), after the merges of the outer ones
        left = [(r[k], ins[k], r[k + 1]) for k in range(d)]
        right = [(r[d + j], outs[j], r[d + j + 1]) for j in range(d)]
        for on, side, a in ((head, left, 0), (tail, right, d - 2)):
            if not on:
                continue
            b = a + 1
            (ra, na, rm), (_, nb, rb) = side[a], side[b]
            f.gemm(ra * na, rm, nb * rb)  # the merge, and its two backward GEMMs
            g.gemm(ra * na, nb * rb, rm)
            g.gemm(rm, ra * na, nb * rb)
            side[a:b + 1] = [(ra, na * nb, rb)]
        f.copy(B * N)  # Xᵀ
        rest = N
        for k, (r0, n, r1) in enumerate(left):
            rest //= n
            # the batch folded into the columns: (r_k × r_{k-1}n_k) · (r_{k-1}n_k × rest·B)
            f.gemm(r1, r0 * n, rest * B)
            if k > 0 or need_dx:
                g.gemm(r0 * n, r1, rest * B)  # dT
            g.gemm(r0 * n, rest * B, r1)  # dG
        done = 1
        for r0, m, r1 in right:
            f.gemm(B * done, r0, m * r1)
            g.gemm(B * done, m * r1, r0)
            g.gemm(r0, B * done, m * r1)
            done *= m
    elif path == "dense":
        _merge_costs(f, ins, outs, r)
        f.gemm(N, rd, M)
        f.gemm(B, N, M)
        g.gemm(N, B, M)  # dW
        if need_dx:
            g.gemm(B, M, N)
        g.gemm(N, M, rd)
        g.gemm(rd, N, M)
        _merge_costs(g, ins, outs, r)
        _merge_costs(g, ins, outs, r)
    else:
        raise ValueError(f"path: unknown path {path!r}; choose one of {PATHS}")
    secs = f.t + (g.t if training else 0.0)
    return PathCost(path, f.macs, g.macs, f.bytes, g.bytes, f.ops, g.ops, secs)


@lru_cache(maxsize=8192)
def _estimate_cached(B: int, ins: tuple[int, ...], outs: tuple[int, ...], r: tuple[int, ...],
                     dm: DeviceModel, elt: int, training: bool, need_dx: bool
                     ) -> tuple[PathCost, ...]:
    return tuple(_path_cost(p, B, ins, outs, r, dm, elt, training, need_dx) for p in PATHS)


def estimate(B: int, in_factors: Sequence[int], out_factors: Sequence[int],
             ranks: Sequence[int], device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32, training: bool = True,
             need_dx: bool = True) -> dict[str, PathCost]:
    """Cost of every path for batch ``B``; ``ranks`` is ``[1, r_1, …, r_{2d-1}, 1]``."""
    if len(in_factors) != len(out_factors) or len(ranks) != 2 * len(in_factors) + 1:
        raise ValueError(
            f"ranks: need 2d+1 = {2 * len(in_factors) + 1} ranks for d = {len(in_factors)}, "
            f"got {len(ranks)}"
        )
    dm = DeviceModel.for_device(device)
    elt = torch.empty((), dtype=dtype).element_size()
    costs = _estimate_cached(int(B), tuple(in_factors), tuple(out_factors), tuple(ranks), dm,
                             elt, bool(training), bool(need_dx))
    return {c.path: c for c in costs}


@lru_cache(maxsize=8192)
def _plan_cached(B: int, ins: tuple[int, ...], outs: tuple[int, ...], r: tuple[int, ...],
                 dev: torch.device, dtype: torch.dtype, training: bool, need_dx: bool) -> str:
    costs = estimate(B, ins, outs, r, dev, dtype, training, need_dx)
    if min(r) == 0:
        return "halves"
    return min(costs.values(), key=lambda c: c.seconds).path


def plan(B: int, in_factors: Sequence[int], out_factors: Sequence[int], ranks: Sequence[int],
         device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
         training: bool = True, need_dx: bool = True) -> str:
    """The cheapest path name for these shapes (cached)."""
    dev = torch.device(device)
    return _plan_cached(int(B), tuple(in_factors), tuple(out_factors), tuple(ranks), dev,
                        dtype, bool(training), bool(need_dx))


def explain(B: int, in_factors: Sequence[int], out_factors: Sequence[int],
            ranks: Sequence[int], device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32, training: bool = True) -> dict:
    """What the planner sees: the chosen path and, per path, MACs, bytes and modelled
    seconds; plus the dense ``nn.Linear`` reference MACs (``B·N·M`` forward)."""
    costs = estimate(B, in_factors, out_factors, ranks, device, dtype, training)
    N, M = math.prod(in_factors), math.prod(out_factors)
    return {
        "path": plan(B, in_factors, out_factors, ranks, device, dtype, training),
        "device_model": DeviceModel.for_device(device).name,
        "batch": int(B),
        "ranks": list(ranks),
        "dense_linear_macs_fwd": B * N * M,
        "dense_linear_macs_fwd_bwd": 3 * B * N * M,
        "paths": {p: asdict(c) for p, c in costs.items()},
    }



# ---------------------------------------------------------------------------- TTM layout
def ttm_reconstruct_macs(in_factors: Sequence[int], out_factors: Sequence[int],
                         ranks: Sequence[int]) -> int:
    """MACs that materialise a TT-matrix weight ``W`` (``N×M``) from its ``d`` cores
    ``(r_{k-1}, n_k, m_k, r_k)``, left to right: ``Σ_k (∏_{j<=k} n_j m_j)·r_k·n_{k+1}
    m_{k+1}·r_{k+1}`` (the last product alone is ``N·M·r_{d-1}``). ``ranks``:
    ``[1, r_1, …, r_{d-1}, 1]``."""
    sizes = [n * m for n, m in zip(in_factors, out_factors)]
    done, macs = sizes[0], 0
    for k in range(1, len(sizes)):
        macs += done * ranks[k] * sizes[k] * ranks[k + 1]
        done *= sizes[k]
    return macs


def estimate_ttm(B: int, in_factors: Sequence[int], out_factors: Sequence[int],
                 ranks: Sequence[int], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, training: bool = True,
                 need_dx: bool = True) -> PathCost:
    """Cost of a ``"ttm"`` TT linear's one path (``dense``): materialise ``W`` from the
    gated cores (:func:`ttm_reconstruct_macs`, batch independent), then ``X·W``; its
    backward ``dW``, ``dX`` and the reconstruction's backward (twice its MACs)."""
    d = len(in_factors)
    if len(out_factors) != d:
        raise ValueError(f"out_factors: a TT matrix pairs them with the {d} in_factors, "
                         f"got {len(out_factors)}")
    if len(ranks) != d + 1:
        raise ValueError(f"ranks: need d+1 = {d + 1} ranks for d = {d} TTM cores, "
                         f"got {len(ranks)}")
    N, M = math.prod(in_factors), math.prod(out_factors)
    sizes = [n * m for n, m in zip(in_factors, out_factors)]
    f, g = (_Acc(DeviceModel.for_device(device), torch.empty((), dtype=dtype).element_size())
            for _ in range(2))
    for _ in range(d - 1):  # gate scaling of each core
        f.copy(0)
    done = sizes[0]
    for k in range(1, d):
        f.gemm(done, ranks[k], sizes[k] * ranks[k + 1])
        g.gemm(done, sizes[k] * ranks[k + 1], ranks[k])
        g.gemm(ranks[k], done, sizes[k] * ranks[k + 1])
        done *= sizes[k]
    f.copy(N * M)  # (n1, m1, n2, m2, …) -> (N, M)
    f.gemm(B, N, M)
    g.gemm(N, B, M)  # dW
    if need_dx:
        g.gemm(B, M, N)
    secs = f.t + (g.t if training else 0.0)
    return PathCost("dense", f.macs, g.macs, f.bytes, g.bytes, f.ops, g.ops, secs)


def explain_ttm(B: int, in_factors: Sequence[int], out_factors: Sequence[int],
                ranks: Sequence[int], device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, training: bool = True) -> dict:
    """:func:`explain` for a ``"ttm"`` TT linear: one path, ``dense`` (materialise ``W``
    from the cores, one GEMM); ``ranks`` is ``[1, r_1, …, r_{d-1}, 1]``. Same keys as
    :func:`explain`, plus ``layout`` and ``reconstruct_macs``."""
    cost = estimate_ttm(B, in_factors, out_factors, ranks, device, dtype, training)
    N, M = math.prod(in_factors), math.prod(out_factors)
    return {
        "path": "dense",
        "layout": "ttm",
        "device_model": DeviceModel.for_device(device).name,
        "batch": int(B),
        "ranks": list(ranks),
        "dense_linear_macs_fwd": B * N * M,
        "dense_linear_macs_fwd_bwd": 3 * B * N * M,
        "reconstruct_macs": ttm_reconstruct_macs(in_factors, out_factors, ranks),
        "paths": {"dense": asdict(cost)},
    }


def tt_linear(x: Tensor, cores: Sequence[Tensor], d: int, path: str | None = None,
              bias: Tensor | None = None, gates: Sequence[Tensor] | None = None,
              tau: float = 0.0, alive: Sequence[Tensor] | None = None) -> Tensor:
    """``Y = X·W (+ bias)`` for the TT weight given by ``cores``.

    ``x``: ``(..., N)``; ``bias``: ``(M,)`` (the padded output width) or None; returns
    ``(..., M)``. ``path=None`` lets the planner choose. ``gates``: the ``2d-1`` rank
    gates; entry ``i`` of bond ``k`` is active where ``alive[k][i]`` (bool vectors,
    default all True) and ``|g_k[i]| > tau``, and inactive entries act as removed ranks
    (:func:`gate_masks`, :func:`apply_gates`). Pass the raw gates rather than pre-gated
    cores: the halves and sweep Functions absorb them inside, masks included, with no
    autograd node per gate.
    """
    if len(cores) != 2 * d:
        raise ValueError(f"cores: expected 2d = {2 * d} cores, got {len(cores)}")
    ins, outs, ranks = layout(tuple(c.shape for c in cores), d)
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
        path = plan(x2.shape[0], ins, outs, ranks, x.device, x.dtype, training,
                    x.requires_grad)
    try:
        impl = _IMPL[path]
    except KeyError:
        raise ValueError(f"path: unknown path {path!r}; choose one of {PATHS}") from None
    if gates is not None and len(gates) != 2 * d - 1:
        raise ValueError(f"gates: expected 2d-1 = {2 * d - 1} gate vectors, got {len(gates)}")
    if path == "halves" and _fused_ok(x2, ranks[d]):
        y = _fused_halves(x2, cores, d, bias, gates, tau, alive)
    elif path in ("halves", "sweep"):
        y = impl(x2, cores, d, bias, gates or (), tau, alive or ())
    else:
        if gates is not None:
            cores = apply_gates(cores, gates, gate_masks(gates, tau, alive))
        y = impl(x2, cores, d)
        if bias is not None:
            y = y + bias.to(y.dtype)  # keeps autocast's dtype, as nn.Linear does
    return y if x.dim() == 2 else y.reshape(*lead, -1)


def _fused_ok(x: Tensor, rank: int) -> bool:
    """The halves path runs as the fused Triton chain (``kernels/tt_linear.py``) where
    the kernels take ``x`` (:func:`comera_engine.kernels.runs_on`: CUDA with
    ``COMERA_KERNELS=1``, opt-in) and the middle rank fits the kernel's tile. Same math
    as the halves op: the planner's choice of path stands, and no timing happens in a
    run."""
    from ..kernels import runs_on

    if not runs_on(x):
        return False
    from ..kernels.tt_linear import MAX_RANK

    return 1 <= rank <= MAX_RANK


def _fused_halves(x: Tensor, cores: Sequence[Tensor], d: int, bias: Tensor | None,
                  gates: Sequence[Tensor] | None, tau: float,
                  alive: Sequence[Tensor] | None) -> Tensor:
    """``(X·L)·R + b`` on the fused kernels, ``L``/``R`` merged from the gated cores by
    autograd-tracked products (batch independent, so small)."""
    from ..kernels.tt_linear import tt_linear_chain

    if gates:
        cores = apply_gates(cores, gates, gate_masks(gates, tau, alive))
    dtype = x.dtype
    L = merge_left(cores[:d])[-1].to(dtype)
    R = merge_right(cores[d:])[0].to(dtype)
    b = bias.to(dtype) if bias is not None else None
    return tt_linear_chain(x.contiguous(), L, R, b)
