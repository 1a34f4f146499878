"""Model size ``S`` and its differentiable surrogate ``Ŝ`` (comera-method.md §1–§2).

For a TT layer with mode sizes ``s_k`` and effective ranks ``R_k`` (``R_0 = R_K = 1``):

    S_layer = Σ_k s_k · R_{k-1} · R_k            (0 if some R_k = 0)
    Ŝ_layer = Σ_k s_k · ‖g_{k-1}‖₁ · ‖g_k‖₁       (active gate entries only, ‖g_0‖₁ = ‖g_K‖₁ = 1)

so each gate entry is weighted by the parameters its bond controls
(``∂Ŝ/∂|g_k[j]| = s_k‖g_{k-1}‖₁ + s_{k+1}‖g_{k+1}‖₁``). With gates at 1, ``Ŝ`` equals
the cores' size.

One size, counted one way (the same as :func:`~comera_engine.layers.size_report`, the
preview and the export card; docs/SIZE_AND_TARGET.md):

- ``tensorized``: every parameter of the TT layers at their effective ranks, i.e. the
  cores plus a TT linear's bias; its dense equivalent is the dense layer with the same
  bias (``in·out + out``; an embedding table ``rows·dim``).
- ``other``: every parameter outside the TT layers (dense linears, norms, heads, their
  biases), counted the same on both sides. Gate vectors count nowhere (training controls,
  absorbed into the cores on export).
- ``model`` = ``tensorized + other``.

The TT biases are a constant in ``S`` (the surrogate ``Ŝ`` is the cores' part only, which
is all the gates can change).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..backends import cpu_backend
from ..layers import TTEmbedding, TTLinear, peer_layers, tt_layers
from ..tensor import structure_generation
from .target import LayerSpec, SizeSpec

if TYPE_CHECKING:
    from ..backends.cpu import CPUBackend

__all__ = ["GateBank", "SurrogateGrad", "dense_size", "effective_core_size", "effective_size",
           "gate_size_pass", "layer_size", "layer_size_surrogate", "min_size", "model_sizes",
           "size_extra", "size_spec", "surrogate_size"]


def layer_size_surrogate(layer: TTLinear | TTEmbedding) -> Tensor:
    """``Ŝ`` of one layer (a differentiable scalar; gates only, cores not involved)."""
    tt = layer.tt
    norms = [g.abs().mul(m.to(g.dtype)).sum() for g, m in zip(tt.gates, tt.masks())]
    one = tt.gates[0].new_ones(()) if len(tt.gates) else tt.cores[0].new_ones(())
    R = [one, *norms, one]
    total = one * 0
    for k, s in enumerate(tt.mode_sizes):
        total = total + s * R[k] * R[k + 1]
    return total


def layer_size(layer: TTLinear | TTEmbedding) -> int:
    """``S`` of the layer's cores at their effective ranks."""
    return layer.tt.num_params(effective=True)


def surrogate_size(model: nn.Module) -> Tensor:
    """``Σ Ŝ_layer`` over the TT layers of ``model`` (as :func:`layer_size_surrogate`
    per layer, summed), in one pass over all gates of the model (:func:`gate_sizes`)."""
    return gate_sizes(model)[0]


class GateBank:
    """The gates of some TT layers laid out for the work done over all of them every
    step (the size surrogate, the gate refresh): the gate and ``alive`` tensors in order,
    the key of their index plan (:func:`_flat_gates`) and the plans themselves per device
    and dtype (:func:`_surrogate_plan`).

    Walking the layers for these costs more than the math itself on a small model, so
    they are kept and built again only when some TT layer's structure changed
    (:func:`comera_engine.tensor.structure_generation`: a truncation, a resize, ``.to()``,
    a new threshold); values changing in place (training, pruning) need nothing."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        self._generation = -1
        self._flat: tuple[list[Tensor], list[Tensor], tuple] = ([], [], ())
        self._plans: dict[tuple[torch.device, torch.dtype], tuple] = {}
        self._layout: tuple[list[int], list[float], list[float], list[int]] | None = None
        self._native: object | None = None
        self._backend: tuple[CPUBackend | None] | None = None  # (the backend or None,)

    def flat(self) -> tuple[list[Tensor], list[Tensor], tuple]:
        """``(gates, alive, key)`` of :func:`_flat_gates`, current."""
        generation = structure_generation()
        if generation != self._generation:
            self._flat = _flat_gates(self.layers)
            self._plans = {}
            self._layout = None
            self._native = None
            self._backend = None
            self._generation = generation
        return self._flat

    def backend(self) -> CPUBackend | None:
        """:func:`~comera_engine.backends.cpu_backend` for these gates, looked up once per
        structure (the gates' device and dtype, ``COMERA_NATIVE`` and the loaded module
        are read then); ``None`` without gates and under CPU autocast, as the hook says.
        Each lookup costs tens of microseconds right after a model's forward, twice a
        step (the objective, the refresh): a few per cent of a small model's step."""
        gates = self.flat()[0]
        if self._backend is None:
            ok = bool(gates) and gates[0].device.type == "cpu" and gates[0].dtype in (
                torch.float32, torch.float64)
            self._backend = (cpu_backend() if ok else None,)
        backend = self._backend[0]
        if backend is not None and torch.is_autocast_enabled("cpu"):
            return None
        return backend

    def layout(self) -> tuple[list[int], list[float], list[float], list[int]]:
        """The CPU backend's view of the layout (``csrc/gate_size.cpp``): per layer its
        number of bonds, every layer's mode sizes in order, per layer its threshold, and
        the length of every gate vector."""
        key = self.flat()[2]
        if self._layout is None:
            self._layout = ([len(gs) for gs, _, _ in key],
                            [float(s) for _, modes, _ in key for s in modes],
                            [float(t) for _, _, t in key],
                            [r for gs, _, _ in key for r in gs])
        return self._layout

    def native(self, ops) -> object:  # noqa: ANN001
        """The CPU backend's ``BankLayout`` of the current gates (``ops``: the backend's
        module): :meth:`layout` handed over once per structure, so a call over all
        gates passes it and the tensors of :meth:`flat` (``csrc/gate_size.cpp``)."""
        self.flat()
        if self._native is None:
            gates, alive, _ = self._flat
            self._native = ops.BankLayout(gates, alive, *self.layout()[:3])
        return self._native

    def plan(self, device: torch.device, dtype: torch.dtype) -> tuple:
        """:func:`_surrogate_plan` of the current layout on ``device`` in ``dtype``."""
        key = self.flat()[2]
        plan = self._plans.get((device, dtype))
        if plan is None:
            plan = self._plans[(device, dtype)] = _surrogate_plan(key, device, dtype)
        return plan


def gate_sizes(model: nn.Module, counts: bool = False,
               layers: list[nn.Module] | None = None, bank: GateBank | None = None
               ) -> tuple[Tensor, Tensor | None]:
    """``Ŝ`` (differentiable in the gates) and, with ``counts``, the cores' effective
    size ``S`` (float64, :func:`effective_core_size`) from the same pass over the gates.

    Called every training step: per layer and bond it would be a few dozen small ops
    for every layer (``experiments/bench_step_overheads.py``). Instead, with ``g`` all
    gate entries concatenated: ``a = |g|`` where active else 0; bond norms ``R`` as row
    sums of ``a`` gathered into a (bonds × largest rank) table padded with zeros; then
    ``Σ s · R[left] · R[right]`` over every core of every layer, the indices (``R[0] = 1``
    for the outer bonds) built once per model structure (:func:`_surrogate_plan`). One
    ``autograd.Function`` (:class:`_GateSize`) with the gradient written out:
    ``∂Ŝ/∂g_j = sign(g_j) · [active_j] · (s_k R_{k-1} + s_{k+1} R_{k+1})`` for the entry's
    bond ``k``, each term multiplied in the order autograd would (the same bits as
    differentiating the expression). No scatter-add: each bond norm receives exactly two
    contributions, so the result and its gradients are the same run to run on GPUs too.
    ``layers``: ``model``'s TT layers when the caller keeps them; ``bank``: their
    :class:`GateBank` when the caller keeps one (called every step, it saves the walk over
    the layers)."""
    if bank is None:
        bank = GateBank([m for _, m in tt_layers(model)] if layers is None else layers)
    if not bank.layers:
        return torch.zeros(()), (torch.zeros((), dtype=torch.float64) if counts else None)
    gates = bank.flat()[0]
    if not gates:  # single-core layers only: no bond, nothing the gates control
        s_hat = torch.stack([layer_size_surrogate(m) for m in bank.layers]).sum()
        return s_hat, (effective_core_size(model) if counts else None)
    s_hat, cores = _GateSize.apply(bank, counts, *gates)
    return s_hat, (cores if counts else None)


SurrogateGrad = Callable[[Tensor], tuple[Tensor, ...]]
"""``dL/dŜ`` (a 0-d tensor) to ``dL/dg`` per gate vector (:func:`gate_size_pass`)."""


def gate_size_pass(bank: GateBank, counts: bool) -> tuple[Tensor, Tensor, SurrogateGrad]:
    """:func:`gate_sizes` of ``bank``'s gates (at least one) without autograd: ``Ŝ``, the
    cores' effective size ``S`` (float64; 0 without ``counts``) and the function that
    takes ``dL/dŜ`` to the gates' gradients, for a caller that differentiates ``Ŝ``
    inside its own ``autograd.Function`` (:class:`_GateSize`; the CoMERA objective, one
    autograd node for the whole loss). The CPU backend does it in one call
    (``csrc/gate_size.cpp``: ``Ŝ``, ``S`` and ``∂Ŝ/∂g`` together, float64 inside);
    elsewhere the index plans of :func:`_surrogate_plan`, ``∂Ŝ/∂g`` worked out from
    ``dL/dŜ`` as autograd would."""
    gates, alive, _ = bank.flat()
    with torch.no_grad():
        backend = bank.backend()
        if backend is not None:
            bonds, modes, taus, sizes = bank.layout()
            s_hat, cores, grad = backend.ops.gate_size(gates, alive, bonds, modes, taus,
                                                       counts)
            return s_hat, cores, lambda d_s: (grad * d_s).split(sizes)
        plan = bank.plan(gates[0].device, gates[0].dtype)
        table, tau, li, ri, sizes = plan[:5]
        g = torch.cat(gates)
        a = g.abs()
        live = torch.cat(alive) & (a > tau)
        a = torch.where(live, a, 0.0)
        R = torch.cat([g.new_ones(1), torch.cat([a, a.new_zeros(1)])[table].sum(1)])
        left = sizes * R[li]
        s_hat = (left * R[ri]).sum()
        cores = g.new_zeros((), dtype=torch.float64)
        if counts:
            cores = _core_size(live, bank.plan(g.device, torch.float64), len(bank.layers))
    lengths = [int(v.shape[0]) for v in gates]

    def grads(d_s: Tensor) -> tuple[Tensor, ...]:
        # autograd's own products for Σ (s·R[li])·R[ri]: into R[li] (d·R[ri])·s, into
        # R[ri] d·(s·R[li]); bond b is the left bond of core rc[b], the right of lc[b]
        _, _, li, ri, sizes, _, _, lc, rc, entry_bond = plan
        via_left = (d_s * R[ri]) * sizes
        via_right = d_s * left
        d_bond = via_left[rc] + via_right[lc]
        return (torch.where(live, d_bond[entry_bond], 0.0) * g.sgn()).split(lengths)

    return s_hat, cores, grads


class _GateSize(torch.autograd.Function):
    """``(Ŝ, S)`` of :func:`gate_sizes` (:func:`gate_size_pass`): inputs the
    :class:`GateBank`, whether ``S`` is wanted, then its gates."""

    @staticmethod
    def forward(ctx, bank: GateBank, counts: bool,  # noqa: ANN001
                *gates: Tensor) -> tuple[Tensor, Tensor]:
        s_hat, cores, ctx.grads = gate_size_pass(bank, counts)
        ctx.mark_non_differentiable(cores)
        return s_hat, cores

    @staticmethod
    def backward(ctx, d_s: Tensor, _d_cores: Tensor):  # type: ignore[override]  # noqa: ANN205
        return (None, None, *ctx.grads(d_s))


def _core_size(live: Tensor, plan64: tuple, n_layers: int) -> Tensor:
    """The cores' effective size (float64) from the active-entry mask ``live``."""
    table, _, li, ri, sizes, core_layer, bond_layer, _, _, _ = plan64
    on = live.to(torch.float64)
    counts = torch.cat([on, on.new_zeros(1)])[table].sum(1)
    R = torch.cat([counts.new_ones(1), counts])
    per_layer = counts.new_zeros(n_layers).index_add_(0, core_layer, sizes * R[li] * R[ri])
    dead = counts.new_zeros(n_layers).index_add_(0, bond_layer, (counts == 0).double())
    return torch.where(dead > 0, 0.0, per_layer).sum()


def _flat_gates(layers: list[nn.Module]) -> tuple[list[Tensor], list[Tensor], tuple]:
    """Every gate vector of the TT ``layers`` and its ``alive`` vector, in order, and the
    key of their index plan (:func:`_surrogate_plan`): per layer its gate sizes, mode
    sizes and threshold."""
    parts = [m.tt.parts() for m in layers]
    key = tuple((tuple(int(v.shape[0]) for v in gs), tuple(m.tt.mode_sizes), m.tt.tau)
                for m, (_, gs, _) in zip(layers, parts))
    return ([g for _, gs, _ in parts for g in gs], [a for _, _, al in parts for a in al],
            key)


@lru_cache(maxsize=64)
def _surrogate_plan(key: tuple, device: torch.device, dtype: torch.dtype) -> tuple:
    """Index tensors for :func:`gate_sizes`. ``key``: per layer (gate sizes, mode sizes,
    tau). Returns the (bonds × largest rank) table of each bond's entry positions in the
    concatenated gates (padded with the position one past the end, a zero); per gate
    entry its tau (``dtype``); per core the indices of its left and right bond norms in
    ``[1, R_1, …]`` (0: an outer bond, norm 1) and its mode size (``dtype``); per core
    and per bond the index of its layer; per bond the core on its left and the core on
    its right; per gate entry its bond."""
    rows: list[list[int]] = []
    tau, li, ri, sizes, core_layer, bond_layer, lc, rc, entry_bond = ([] for _ in range(9))
    bond = pos = core = 0
    for layer, (gsizes, modes, t) in enumerate(key):
        first = bond + 1  # position of this layer's first bond norm in [1, R...]
        for k, r in enumerate(gsizes):
            rows.append(list(range(pos, pos + r)))
            pos += r
            tau += [t] * r
            entry_bond += [bond + k] * r
            bond_layer.append(layer)
            lc.append(core + k)  # bond k of a layer sits between its cores k and k+1
            rc.append(core + k + 1)
        K = len(modes)
        for k, s in enumerate(modes):
            li.append(first + k - 1 if k > 0 else 0)
            ri.append(first + k if k < K - 1 else 0)
            sizes.append(float(s))
            core_layer.append(layer)
        bond += len(gsizes)
        core += K
    width = max([1, *(len(r) for r in rows)])
    table = [r + [pos] * (width - len(r)) for r in rows]
    long = torch.long
    return tuple(torch.tensor(v, dtype=dt, device=device)
                 for v, dt in ((table, long), (tau, dtype), (li, long), (ri, long),
                               (sizes, dtype), (core_layer, long), (bond_layer, long),
                               (lc, long), (rc, long), (entry_bond, long)))


def effective_core_size(model: nn.Module, bank: GateBank | None = None) -> Tensor:
    """``Σ_layers Σ_k s_k R_{k-1} R_k`` over the TT layers' cores at their effective ranks
    (the gate-mask counts; a layer with a rank-0 bond counts 0), a float64 device scalar,
    in one pass over all gates of the model (``bank``: their :class:`GateBank`, kept by
    the caller)."""
    if bank is None:
        bank = GateBank([m for _, m in tt_layers(model)])
    gates, alive, _ = bank.flat()
    if not gates:  # no TT layer, or only single-core ones (no bond): their full size
        return torch.tensor(float(sum(m.tt.num_params(True) for m in bank.layers)),
                            dtype=torch.float64)
    g = torch.cat(gates)
    live = torch.cat(alive) & (g.abs() > bank.plan(g.device, g.dtype)[1])
    return _core_size(live, bank.plan(g.device, torch.float64), len(bank.layers))


def _other_params(model: nn.Module) -> int:
    tt_ids = set()
    for _, m in tt_layers(model) + peer_layers(model):
        tt_ids.update(id(p) for p in m.parameters())
    return sum(p.numel() for p in model.parameters() if id(p) not in tt_ids)


def _bias(layer: nn.Module) -> int:
    """Parameters of a TT layer outside its cores and gates (a TT linear's bias)."""
    b = getattr(layer, "bias", None)
    return int(b.numel()) if isinstance(b, Tensor) else 0


def model_sizes(model: nn.Module) -> dict[str, int]:
    """Effective sizes: ``tensorized`` (TT layers: cores at the effective ranks + bias),
    ``other`` (every parameter outside the TT layers) and ``model`` (their sum)."""
    tt = sum(layer_size(m) + _bias(m) for _, m in tt_layers(model))
    other = _other_params(model)
    return {"tensorized": tt, "other": other, "model": tt + other}


def dense_size(model: nn.Module) -> dict[str, int]:
    """Sizes of the dense equivalent: TT layers as dense matrices/tables (with the bias)."""
    tt = 0
    for _, m in tt_layers(model):
        tt += (m.in_features * m.out_features if isinstance(m, TTLinear)
               else m.num_embeddings * m.embedding_dim) + _bias(m)
    other = _other_params(model)
    return {"tensorized": tt, "other": other, "model": tt + other}


def min_size(model: nn.Module) -> dict[str, int]:
    """Smallest reachable size: every bond at rank 1 (``Σ s_k`` + bias per layer)."""
    tt = sum(sum(m.tt.mode_sizes) + _bias(m) for _, m in tt_layers(model))
    other = _other_params(model)
    return {"tensorized": tt, "other": other, "model": tt + other}


def effective_size(model: nn.Module, scope: str) -> Tensor:
    """Effective size ``S`` (``"tensorized"`` or ``"model"``; ``"cores"``: the TT cores
    alone, no bias) as a float64 device tensor: :func:`effective_core_size` plus the TT
    biases, plus every other parameter for ``"model"``."""
    return effective_core_size(model) + size_extra(model, scope)


def size_extra(model: nn.Module, scope: str) -> float:
    """What ``scope`` counts beyond the TT cores, constant through training: the TT
    biases (``"tensorized"``), plus every parameter outside the TT layers (``"model"``);
    0 for ``"cores"``."""
    if scope == "cores":
        return 0.0
    extra = sum(_bias(m) for _, m in tt_layers(model))
    return float(extra + (_other_params(model) if scope == "model" else 0))


def size_spec(model: nn.Module) -> SizeSpec:
    """The shapes :func:`comera_engine.rank.target.plan_target` needs, read off ``model``
    (a meta-device model is enough: only shapes and allocated ranks are read).

    The engine's TT layers first, then the peer (tltorch) layers, each in model order
    (a model has one kind or the other; the fixed-rank plans list ranks in this order)."""
    peers = tuple(
        LayerSpec(
            kind="linear" if hasattr(m, "in_features") else "embedding",
            mode_sizes=tuple(m.mode_sizes),
            ranks=tuple(m.effective_ranks()),
            bias=_bias(m),
            dense=m.dense_num_params(),
        )
        for _, m in peer_layers(model)
    )
    layers = tuple(
        LayerSpec(
            kind="linear" if isinstance(m, TTLinear) else "embedding",
            mode_sizes=tuple(int(s) for s in m.tt.mode_sizes),
            ranks=tuple(int(r) for r in m.tt.ranks[1:-1]),
            bias=_bias(m),
            dense=(m.in_features * m.out_features if isinstance(m, TTLinear)
                   else m.num_embeddings * m.embedding_dim) + _bias(m),
        )
        for _, m in tt_layers(model)
    )
    return SizeSpec(layers + peers, _other_params(model))
