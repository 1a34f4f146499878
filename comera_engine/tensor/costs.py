"""The cost model behind the planner: the kernels each path of each TT op launches, their
MACs and bytes, and the time a device model gives them.

A **case** (:class:`Case`) is one TT op as a training step meets it: the op, its factors
and ranks, the rows it runs on, the compute dtype, and whether it runs inside a CUDA
graph. Each op has paths in three families (:data:`OPS`, :data:`FAMILY`):

===============  ==============================  ======================  ==========
op               reconstructed                   factorised (PyTorch)    fused
===============  ==============================  ======================  ==========
``tt_linear``    ``dense``: ``W = L·R``, 1 GEMM  ``halves``, ``sweep``   ``fused``
``ttm_linear``   ``dense``: ``W`` from the cores ``sweep``               —
``ttm_lookup``   ``dense``: table ``E``, gather  ``gather`` (half tables) ``fused``
``ttm_decode``   ``table``: ``h·Eᵀ``             ``tt`` (half tables)    —
===============  ==============================  ======================  ==========

:func:`path_work` lists each path's kernels (forward and backward) as a :class:`Work`:
``(MACs, bytes, smallest GEMM dimension)`` per kernel. A :class:`DeviceModel` turns a
kernel into seconds, roofline-style::

    t = max(MACs / (rate · eff), bytes / bandwidth) + overhead
    eff = min(1, smallest_dim / full_eff_dim)      (skinny GEMMs are bandwidth-bound)

with ``rate`` the MAC rate of the dtype (fp32, or bf16/fp16), ``overhead`` the cost of
one launch, eager or inside a CUDA graph, and each path's total scaled by the model's
``path_factors`` (what a measured profile says the path really costs against the model:
:mod:`comera_engine.tensor.profile`). :data:`DEVICE_MODELS` are the uncalibrated
models by device kind (the CPU, CUDA by compute capability).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from ..ops.tt_linear_sweep import sweep_merges
from ..ops.ttm_decode import CHUNK_ELEMENTS
from ..ops.ttm_lookup import split_point

__all__ = ["DEVICE_MODELS", "FAMILY", "OPS", "Case", "DeviceModel", "PathCost", "Work",
           "case_costs", "path_work", "ttm_reconstruct_macs"]

#: Each op's paths (the first is the reconstructed one).
OPS: dict[str, tuple[str, ...]] = {
    "tt_linear": ("dense", "halves", "sweep", "fused"),
    "ttm_linear": ("dense", "sweep"),
    "ttm_lookup": ("dense", "gather", "fused"),
    "ttm_decode": ("table", "tt"),
}

#: The family of each path name: what ``COMERA_PATHS`` restricts a choice to.
FAMILY: dict[str, str] = {"dense": "reconstructed", "table": "reconstructed",
                          "halves": "factorised", "sweep": "factorised",
                          "gather": "factorised", "tt": "factorised", "fused": "fused"}

_ELT = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Case:
    """One TT op of a training step, as the planner sees it.

    ``rows``/``cols``: input/output factors of a linear (``n``, ``m``), vocabulary/dim
    factors of a TTM table (``v``, ``e``). ``ranks`` with the boundary ones: ``2d+1`` for
    ``tt_linear``, ``d+1`` for the TTM ops. ``tokens``: rows of ``X`` (ids looked up,
    hidden states decoded). ``dtype``: the products' dtype (autocast's where it is on)."""

    op: str
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    ranks: tuple[int, ...]
    tokens: int
    dtype: str = "float32"
    graph: bool = False
    training: bool = True
    need_dx: bool = True

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op: unknown op {self.op!r}; choose one of {tuple(OPS)}")
        d = len(self.rows)
        want = 2 * d + 1 if self.op == "tt_linear" else d + 1
        if len(self.cols) != d or len(self.ranks) != want:
            raise ValueError(f"ranks: {self.op} with {d} factors a side needs {want} ranks "
                             f"and {d} column factors, got {len(self.ranks)} and "
                             f"{len(self.cols)}")
        if self.dtype not in _ELT:
            raise ValueError(f"dtype: one of {tuple(_ELT)}, got {self.dtype!r}")

    @property
    def elt(self) -> int:
        return _ELT[self.dtype]

    @property
    def shape_key(self) -> tuple:
        """What a measurement must share with this case to stand for it (all but the
        tokens and ranks, which a nearby measurement is scaled across)."""
        return (self.op, self.rows, self.cols, self.dtype, self.graph, self.training)

    def as_dict(self) -> dict:
        return {"op": self.op, "rows": list(self.rows), "cols": list(self.cols),
                "ranks": list(self.ranks), "tokens": self.tokens, "dtype": self.dtype,
                "graph": self.graph, "training": self.training, "need_dx": self.need_dx}

    @staticmethod
    def from_dict(d: dict) -> Case:
        return Case(str(d["op"]), tuple(int(x) for x in d["rows"]),
                    tuple(int(x) for x in d["cols"]), tuple(int(x) for x in d["ranks"]),
                    int(d["tokens"]), str(d.get("dtype", "float32")), bool(d.get("graph")),
                    bool(d.get("training", True)), bool(d.get("need_dx", True)))


# ---------------------------------------------------------------------------- device models
@dataclass(frozen=True)
class DeviceModel:
    """Roofline-style device constants: MAC rate (MAC/s) for large fp32 GEMMs
    (``mac_rate_16`` for bf16/fp16; 0: the fp32 rate), memory bandwidth (B/s), the fixed
    cost of one kernel launch eagerly (``op_overhead``, s) and inside a CUDA graph
    (``graph_op_overhead``; negative: as eager). A GEMM whose smallest dimension ``k``
    is below ``full_eff_dim`` runs at ``k/full_eff_dim`` of the rate. ``path_factors``:
    ``("op/path", factor)`` pairs scaling a path's modelled time (a profile's
    calibration; 1 where absent). ``source``: where the constants come from."""

    name: str
    mac_rate: float
    bandwidth: float
    op_overhead: float
    full_eff_dim: int = 32
    mac_rate_16: float = 0.0
    graph_op_overhead: float = -1.0
    path_factors: tuple[tuple[str, float], ...] = ()
    source: str = "table"

    def rate(self, elt: int) -> float:
        """MAC/s for products of ``elt``-byte elements."""
        return self.mac_rate_16 if elt == 2 and self.mac_rate_16 > 0 else self.mac_rate

    def overhead(self, graph: bool) -> float:
        """Seconds per kernel launch, eagerly or replayed in a CUDA graph."""
        return self.graph_op_overhead if graph and self.graph_op_overhead >= 0 else (
            self.op_overhead)

    def factor(self, op: str, path: str) -> float:
        return dict(self.path_factors).get(f"{op}/{path}", 1.0)

    def with_(self, **changes: object) -> DeviceModel:
        return replace(self, **changes)  # type: ignore[arg-type]


DEVICE_MODELS: dict[str, DeviceModel] = {
    # a 2-16 core x86 server CPU, fp32 (MKL/oneDNN)
    "cpu": DeviceModel("cpu", mac_rate=4.0e10, bandwidth=1.2e10, op_overhead=8e-6,
                       full_eff_dim=16),
    # generic CUDA GPU (any compute capability not listed below)
    "cuda": DeviceModel("cuda", mac_rate=2.5e13, bandwidth=2.0e12, op_overhead=6e-6,
                        full_eff_dim=64, graph_op_overhead=2.5e-6),
    # Volta/Turing (sm7x): ~15 TFLOP/s-class tensor cores, ~0.9 TB/s
    "cuda-sm7": DeviceModel("cuda-sm7", mac_rate=1.2e13, bandwidth=9.0e11, op_overhead=7e-6,
                            full_eff_dim=64, graph_op_overhead=3e-6),
    # Ampere/Ada (sm8x): A100-class TF32
    "cuda-sm8": DeviceModel("cuda-sm8", mac_rate=2.5e13, bandwidth=2.0e12, op_overhead=6e-6,
                            full_eff_dim=64, graph_op_overhead=2.5e-6),
    # Hopper (sm9x): H100-class TF32, HBM3
    "cuda-sm9": DeviceModel("cuda-sm9", mac_rate=5.0e13, bandwidth=3.3e12, op_overhead=5e-6,
                            full_eff_dim=64, graph_op_overhead=2e-6),
}
"""The uncalibrated cost model per device kind: ``"cpu"``, ``"cuda-sm<major>"`` by compute
capability, and ``"cuda"`` for GPUs not listed. Order-of-magnitude rates (the planner
compares paths on one device, so only their ratios matter); a GPU with a measured
profile, or one whose datasheet peaks are known, gets a calibrated model instead
(:func:`comera_engine.tensor.planner.device_model`)."""


# ---------------------------------------------------------------------------- kernels
class Work:
    """The kernels of one direction of a path: per kernel ``(MACs, bytes, dim)``, ``dim``
    the smallest GEMM dimension (0 for a copy or an elementwise kernel)."""

    def __init__(self, elt: int) -> None:
        self.elt = elt
        self.kernels: list[tuple[int, int, int]] = []

    def gemm(self, a: int, k: int, b: int) -> None:
        """``(a×k)·(k×b)``: reads both operands, writes the product."""
        self.kernels.append((a * k * b, (a * k + k * b + a * b) * self.elt, min(a, k, b)))

    def copy(self, numel: int) -> None:
        """A copy, permute or elementwise pass over ``numel`` elements (read and write)."""
        self.kernels.append((0, 2 * numel * self.elt, 0))

    def kernel(self, macs: int, numel: int, dim: int) -> None:
        """One fused kernel: ``macs`` MACs over ``numel`` elements read or written."""
        self.kernels.append((macs, numel * self.elt, dim))

    @property
    def macs(self) -> int:
        return sum(k[0] for k in self.kernels)

    @property
    def bytes(self) -> int:
        return sum(k[1] for k in self.kernels)

    @property
    def ops(self) -> int:
        return len(self.kernels)

    def seconds(self, dm: DeviceModel, graph: bool) -> float:
        """``Σ max(MACs/(rate·eff), bytes/bandwidth) + launches·overhead``."""
        rate, t = dm.rate(self.elt), 0.0
        for macs, nbytes, dim in self.kernels:
            eff = min(1.0, max(1, dim) / dm.full_eff_dim)
            t += max(macs / (rate * eff), nbytes / dm.bandwidth)
        return t + len(self.kernels) * dm.overhead(graph)


@dataclass(frozen=True)
class PathCost:
    """Modelled work of one path. MACs and bytes are totals for the direction(s)."""

    path: str
    macs_fwd: int
    macs_bwd: int
    bytes_fwd: int
    bytes_bwd: int
    ops_fwd: int
    ops_bwd: int
    seconds: float  # modelled (fwd, plus bwd when training)


# ---------------------------------------------------------------------------- tt_linear
def _merge_costs(w: Work, ins: Sequence[int], outs: Sequence[int], r: Sequence[int]) -> None:
    """The merge chains of the halves: ``L`` (left to right) and ``R`` (right to left)."""
    d = len(ins)
    a = ins[0]
    for k in range(1, d):
        w.gemm(a, r[k], ins[k] * r[k + 1])
        a *= ins[k]
    b = outs[-1]
    for j in range(d - 2, -1, -1):
        w.gemm(r[d + j] * outs[j], r[d + j + 1], b)
        b *= outs[j]


def _sweep_work(f: Work, g: Work, B: int, ins: Sequence[int], outs: Sequence[int],
                r: Sequence[int], need_dx: bool) -> None:
    d = len(ins)
    N = math.prod(ins)
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


def _tt_linear_work(path: str, c: Case, f: Work, g: Work) -> None:
    B, ins, outs, r = c.tokens, c.rows, c.cols, c.ranks
    d = len(ins)
    N, M, rd = math.prod(ins), math.prod(outs), r[d]
    for _ in range(len(r) - 2):  # gate scaling of each core (every path pays it)
        f.copy(0)
    if path == "halves":
        _merge_costs(f, ins, outs, r)
        f.gemm(B, N, rd)
        f.gemm(B, rd, M)
        g.gemm(B, M, rd)  # dXL
        g.gemm(rd, B, M)  # dR
        if c.need_dx:
            g.gemm(B, rd, N)
        g.gemm(N, B, rd)  # dL
        _merge_costs(g, ins, outs, r)
        _merge_costs(g, ins, outs, r)
    elif path == "fused":  # the Triton chain: one kernel forward, four backward
        _merge_costs(f, ins, outs, r)
        f.kernel(B * rd * (N + M), B * (N + M + rd) + rd * (N + M), min(B, rd))
        g.kernel(B * rd * (N + M), B * (N + M + rd) + rd * (N + M), min(B, rd))  # dX, dY·Rᵀ
        g.kernel(N * B * rd, B * (N + rd) + N * rd, min(B, rd))  # dL = Xᵀ·(dY·Rᵀ)
        g.kernel(rd * B * M, B * (M + rd) + rd * M, min(B, rd))  # dR = (X·L)ᵀ·dY
        g.kernel(0, B * M + M, 0)  # the bias gradient
        _merge_costs(g, ins, outs, r)
        _merge_costs(g, ins, outs, r)
    elif path == "sweep":
        _sweep_work(f, g, B, ins, outs, r, c.need_dx)
    elif path == "dense":
        _merge_costs(f, ins, outs, r)
        f.gemm(N, rd, M)
        f.gemm(B, N, M)
        g.gemm(N, B, M)  # dW
        if c.need_dx:
            g.gemm(B, M, N)
        g.gemm(N, M, rd)
        g.gemm(rd, N, M)
        _merge_costs(g, ins, outs, r)
        _merge_costs(g, ins, outs, r)
    else:
        raise ValueError(f"path: unknown path {path!r}; choose one of {OPS['tt_linear']}")


# ---------------------------------------------------------------------------- TT matrices
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


def _ttm_matrix_work(f: Work, g: Work, rows: Sequence[int], cols: Sequence[int],
                     ranks: Sequence[int]) -> int:
    """The gated TT matrix ``W`` (``∏rows × ∏cols``) from its cores, left to right, and
    its backward; returns ``W``'s elements."""
    d = len(rows)
    sizes = [n * m for n, m in zip(rows, cols)]
    for _ in range(d - 1):  # gate scaling of each core
        f.copy(0)
    done = sizes[0]
    for k in range(1, d):
        f.gemm(done, ranks[k], sizes[k] * ranks[k + 1])
        g.gemm(done, sizes[k] * ranks[k + 1], ranks[k])
        g.gemm(ranks[k], done, sizes[k] * ranks[k + 1])
        done *= sizes[k]
    f.copy(done)  # (n1, m1, n2, m2, …) -> (N, M)
    g.copy(done)
    return done


def _ttm_linear_work(path: str, c: Case, f: Work, g: Work) -> None:
    B, ins, outs, r = c.tokens, c.rows, c.cols, c.ranks
    N, M = math.prod(ins), math.prod(outs)
    if path == "dense":
        _ttm_matrix_work(f, g, ins, outs, r)
        f.gemm(B, N, M)
        g.gemm(N, B, M)  # dW
        if c.need_dx:
            g.gemm(B, M, N)
    elif path == "sweep":  # X contracted with one core at a time (ops.ttm_linear)
        for _ in range(len(ins) - 1):
            f.copy(0)
        J, rest = 1, N
        for k, (n, m) in enumerate(zip(ins, outs)):
            rest //= n
            rows = B * J * rest
            f.copy(rows * r[k] * n)  # the state, its contracted modes last
            f.gemm(rows, r[k] * n, m * r[k + 1])
            f.copy(rows * m * r[k + 1])  # the new modes ahead of the rest
            if k > 0 or c.need_dx:
                g.gemm(rows, m * r[k + 1], r[k] * n)
            g.gemm(r[k] * n, rows, m * r[k + 1])
            g.copy(rows * (r[k] * n + m * r[k + 1]))
            J *= m
    else:
        raise ValueError(f"path: unknown path {path!r}; choose one of {OPS['ttm_linear']}")


def _merge_tables_work(f: Work, g: Work, rows: Sequence[int], cols: Sequence[int],
                       ranks: Sequence[int], h: int) -> None:
    """The two half tables ``A`` (cores ``1..h``) and ``Bt`` (the rest), and back."""
    for lo, hi in ((0, h), (h, len(rows))):
        acc = ranks[lo] * rows[lo] * cols[lo]
        for k in range(lo + 1, hi):
            f.gemm(acc, ranks[k], rows[k] * cols[k] * ranks[k + 1])
            f.copy(acc * rows[k] * cols[k] * ranks[k + 1])  # the permute to (V, E)
            g.gemm(acc, rows[k] * cols[k] * ranks[k + 1], ranks[k])
            g.gemm(ranks[k], acc, rows[k] * cols[k] * ranks[k + 1])
            acc *= rows[k] * cols[k]


def _lookup_work(path: str, c: Case, f: Work, g: Work) -> None:
    T, rows, cols, r = c.tokens, c.rows, c.cols, c.ranks
    V, D = math.prod(rows), math.prod(cols)
    U = T if c.graph else min(T, V)  # unique ids (a captured step keeps every id)
    if not c.graph:  # torch.unique: a sort, its inverse, a read-back of the count
        f.copy(T)
        f.copy(T)
        f.copy(T)
    if path == "dense":  # E from the cores, then its rows
        _ttm_matrix_work(f, g, rows, cols, r)
        f.copy(U * D)
        g.copy(V * D)  # zero dE
        g.copy(2 * U * D)  # scatter the rows' gradient
        if not c.graph:
            f.copy(T * D)
            g.copy(T * D)
        return
    h = split_point(rows, cols, r)
    Ea, Eb = math.prod(cols[:h]), math.prod(cols[h:])
    rh = r[h]
    _merge_tables_work(f, g, rows, cols, r, h)
    if path == "gather":
        f.copy(U * Ea * rh)  # A[a]
        f.copy(U * rh * Eb)  # Bt[b]
        f.gemm(U * Ea, rh, Eb)  # batched: U products (E_a × r)·(r × E_b)
        g.gemm(U * Ea, Eb, rh)
        g.gemm(U * rh, Ea, Eb)
        g.copy(U * Ea * rh + math.prod(rows[:h]) * Ea * rh)  # index_add into A
        g.copy(U * rh * Eb + math.prod(rows[h:]) * rh * Eb)  # and into Bt
    elif path == "fused":
        f.kernel(U * Ea * rh * Eb, U * (Ea * rh + rh * Eb + Ea * Eb), min(Ea, rh, Eb))
        for _ in range(2):  # per half: sort, counts, starts, then the segment kernel
            g.copy(U)
            g.copy(U)
            g.copy(U)
            g.kernel(U * Ea * rh * Eb, U * (Ea * Eb + rh * max(Ea, Eb)), min(Ea, rh, Eb))
    else:
        raise ValueError(f"path: unknown path {path!r}; choose one of {OPS['ttm_lookup']}")
    if not c.graph:
        f.copy(T * D)  # rows back to every id
        g.copy(T * D)


def _decode_work(path: str, c: Case, f: Work, g: Work) -> None:
    T, rows, cols, r = c.tokens, c.rows, c.cols, c.ranks
    V, D = math.prod(rows), math.prod(cols)
    h = split_point(rows, cols, r)
    Va, Vb = math.prod(rows[:h]), math.prod(rows[h:])
    Ea, Eb = math.prod(cols[:h]), math.prod(cols[h:])
    rh = r[h]
    _merge_tables_work(f, g, rows, cols, r, h)
    if path == "table":  # E = A·Bt, then h·Eᵀ
        f.gemm(Va * Ea, rh, Vb * Eb)
        f.copy(V * D)
        f.gemm(T, D, V)
        g.gemm(T, V, D)  # dh
        g.gemm(V, T, D)  # dE
        g.gemm(Va * Ea, Vb * Eb, rh)
        g.gemm(rh, Va * Ea, Vb * Eb)
        g.copy(V * D)
    elif path == "tt":  # T chunk by chunk, recomputed in backward
        chunk = max(1, CHUNK_ELEMENTS // max(1, Ea * rh * Vb))
        K = Ea * rh
        for s in range(0, T, chunk):
            n = min(chunk, T - s)
            f.gemm(n * Ea, Eb, rh * Vb)
            f.gemm(n * Vb, K, Va)
            f.copy(n * V)
            g.gemm(n * Ea, Eb, rh * Vb)  # T again
            g.gemm(K, n * Vb, Va)  # dA
            g.gemm(n * Vb, Va, K)  # dT
            g.gemm(n * Ea, rh * Vb, Eb)  # dh
            g.gemm(Eb, n * Ea, rh * Vb)  # dBt
        g.copy(T * V)  # the padded gradient
    else:
        raise ValueError(f"path: unknown path {path!r}; choose one of {OPS['ttm_decode']}")


def _reference_work(path: str, c: Case, f: Work, g: Work) -> None:
    """The dense layer a case's op replaces (what the tuning script times beside it):
    ``nn.Linear`` (``X·W + b``; for the decoder ``h·Eᵀ``) or ``nn.Embedding``."""
    T, A, Bd = c.tokens, math.prod(c.rows), math.prod(c.cols)
    if c.op == "ttm_lookup":  # rows gathered; backward zeroes dE and scatters into it
        f.copy(T * Bd)
        g.copy(A * Bd)
        g.copy(2 * T * Bd)
        return
    if c.op == "ttm_decode":  # h (T × D) · Eᵀ (D × V)
        A, Bd = Bd, A
    f.gemm(T, A, Bd)
    g.gemm(T, Bd, A)  # dX
    g.gemm(A, T, Bd)  # dW
    if c.op != "ttm_decode":
        f.copy(T * Bd)  # the bias
        g.copy(T * Bd)


_WORK = {"tt_linear": _tt_linear_work, "ttm_linear": _ttm_linear_work,
         "ttm_lookup": _lookup_work, "ttm_decode": _decode_work}


@lru_cache(maxsize=8192)
def path_work(case: Case, path: str) -> tuple[Work, Work]:
    """The kernels of ``path`` for ``case``: (forward, backward) :class:`Work`. A name
    starting ``nn.`` is the dense layer the op replaces (``nn.Linear``, ``nn.Embedding``)."""
    f, g = Work(case.elt), Work(case.elt)
    (_reference_work if path.startswith("nn.") else _WORK[case.op])(path, case, f, g)
    return f, g


def path_seconds(case: Case, path: str, dm: DeviceModel) -> float:
    """Modelled seconds of ``path`` (forward, plus backward when training), scaled by
    the model's factor for it."""
    f, g = path_work(case, path)
    t = f.seconds(dm, case.graph) + (g.seconds(dm, case.graph) if case.training else 0.0)
    return t * dm.factor(case.op, path)


@lru_cache(maxsize=8192)
def case_costs(case: Case, dm: DeviceModel) -> tuple[PathCost, ...]:
    """Every path of ``case``'s op, modelled on ``dm``."""
    out = []
    for p in OPS[case.op]:
        f, g = path_work(case, p)
        out.append(PathCost(p, f.macs, g.macs, f.bytes, g.bytes, f.ops, g.ops,
                            path_seconds(case, p, dm)))
    return tuple(out)
