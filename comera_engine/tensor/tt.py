"""Gated tensor-train cores: the containers behind every TT layer.

A tensor train of K cores ``G_k ∈ R^{r_{k-1} × (mode_k) × r_k}`` (``r_0 = r_K = 1``) with a
rank-gate vector ``g_k ∈ R^{r_k}`` on each internal bond (initialised to 1):

    T = G_1 · diag(g_1) · G_2 · diag(g_2) · … · diag(g_{K-1}) · G_K

``mode_k`` is ``(s_k,)`` for a TT-linear weight (order 2d: ``s = (n_1..n_d, m_1..m_d)``)
and ``(v_k, e_k)`` for a TTM embedding table. A gate entry is *alive* while ``|g| > tau``
and it has never been pruned (a persistent ``alive`` mask); dead entries act exactly as a
removed rank: they contribute zero and receive zero gradient. ``truncate_()`` then slices
them out physically.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Self

import numpy as np
import torch
from torch import Tensor, nn

from ..ops.gates import absorb_gates
from ..ops.merges import contract_chain
from ..ops.ttm_matrix import ttm_matrix as gated_ttm_matrix
from ..ops.ttm_matrix import ttm_matrix_reference
from .size import tt_size

__all__ = [
    "RankChange",
    "TensorTrain",
    "TTLinearCores",
    "TTMCores",
    "contract_chain",
    "max_tt_ranks",
    "swap_param",
    "ttm_matrix",
    "tt_svd",
]


def ttm_matrix(cores: Sequence[Tensor]) -> Tensor:
    """The matrix ``(∏ n_k, ∏ m_k)`` of TT-matrix cores ``(r_{k-1}, n_k, m_k, r_k)``:
    :func:`contract_chain` gives modes ``(n_1, m_1, n_2, m_2, …)``, permuted to
    ``(n_1..n_d, m_1..m_d)`` (:func:`comera_engine.ops.ttm_matrix.ttm_matrix_reference`,
    the cores as they are: PyTorch ops an ONNX trace records)."""
    return ttm_matrix_reference(cores)


@dataclass(frozen=True)
class RankChange:
    """One bond changing its (effective or allocated) rank."""

    bond: int
    old: int
    new: int


def max_tt_ranks(mode_sizes: Sequence[int]) -> list[int]:
    """Largest meaningful internal ranks: ``r_k <= min(∏_{j<=k} s_j, ∏_{j>k} s_j)``.

    Returns a list of length ``K-1`` for ``K = len(mode_sizes)``.
    """
    out = []
    for k in range(1, len(mode_sizes)):
        out.append(min(math.prod(mode_sizes[:k]), math.prod(mode_sizes[k:])))
    return out


def _resolve_ranks(rank: int | Sequence[int], mode_sizes: Sequence[int]) -> list[int]:
    """Internal ranks (length K-1) from a scalar (clamped to the maximal TT ranks) or a
    list (validated: positive and at most the maximal TT rank of each bond). A list of
    length K+1 with ones at both ends is also accepted."""
    K = len(mode_sizes)
    caps = max_tt_ranks(mode_sizes)
    if isinstance(rank, (int, np.integer)) and not isinstance(rank, bool):
        if rank < 1:
            raise ValueError(f"rank: must be a positive integer, got {rank}")
        return [min(int(rank), c) for c in caps]
    ranks = [int(r) for r in rank]
    if len(ranks) == K + 1:
        if ranks[0] != 1 or ranks[-1] != 1:
            raise ValueError(f"rank: boundary ranks must be 1, got {ranks}")
        ranks = ranks[1:-1]
    if len(ranks) != K - 1:
        raise ValueError(f"rank: expected {K - 1} internal ranks for {K} cores, got {len(ranks)}")
    for k, (r, c) in enumerate(zip(ranks, caps)):
        if r < 1:
            raise ValueError(f"rank: rank of bond {k} must be positive, got {r}")
        if r > c:
            raise ValueError(
                f"rank: rank {r} of bond {k} exceeds the maximal TT rank {c} for modes "
                f"{list(mode_sizes)}"
            )
    return ranks


def tt_svd(
    tensor: np.ndarray | Tensor, max_rank: int | Sequence[int] | None = None,
    tol: float | None = None,
) -> list[np.ndarray]:
    """TT-SVD of an order-K tensor with tensorly (float64).

    Either ``max_rank`` (scalar cap or internal rank list) or ``tol``: the relative
    Frobenius error bound ``||T - T_tt|| <= tol·||T||`` (ranks chosen by the
    Oseledets sweep with per-unfolding threshold ``tol·||T||/sqrt(K-1)``), or both.
    Returns cores of shape ``(r_{k-1}, s_k, r_k)``.
    """
    from tensorly.decomposition import tensor_train

    t = tensor.detach().cpu().double().numpy() if isinstance(tensor, Tensor) else np.asarray(
        tensor, dtype=np.float64
    )
    sizes = list(t.shape)
    K = len(sizes)
    if K == 1:
        return [t.reshape(1, sizes[0], 1)]
    caps = max_tt_ranks(sizes)
    if max_rank is None and tol is None:
        ranks = caps
    elif max_rank is not None:
        ranks = _resolve_ranks(max_rank, sizes) if not isinstance(max_rank, int) else [
            min(max_rank, c) for c in caps
        ]
    else:
        ranks = caps
    if tol is not None:
        if tol < 0:
            raise ValueError(f"tol: must be >= 0, got {tol}")
        delta = tol * np.linalg.norm(t) / math.sqrt(K - 1)
        chosen, c, r_prev = [], t, 1
        for k in range(K - 1):
            c = c.reshape(r_prev * sizes[k], -1)
            u, s, vt = np.linalg.svd(c, full_matrices=False)
            tail = np.sqrt(np.cumsum((s**2)[::-1]))[::-1]  # tail[i] = ||s[i:]||
            r = int(np.sum(tail > delta)) or 1
            r = min(r, ranks[k])
            chosen.append(r)
            c = s[:r, None] * vt[:r]
            r_prev = r
        ranks = chosen
    import tensorly as tl

    # NumPy arrays in, NumPy cores out, whatever tensorly's global backend is (importing
    # tltorch, a peer method's layers, switches it to PyTorch for the whole process)
    with tl.backend_context("numpy"):
        tt = tensor_train(t, [1, *ranks, 1])
        return [np.asarray(f) for f in tt]


def swap_param(p: nn.Parameter, data: Tensor) -> bool:
    """Swap the tensor under ``p`` for a fresh one holding ``data`` (``torch.utils.
    swap_tensors``), keeping the Python object (so optimizer groups and state keyed by it
    stay valid) and dropping its gradient; ``False`` (``p`` untouched) where the autograd
    engine refuses: a graph never backpropagated that saved ``p`` still holds it."""
    new = nn.Parameter(data, requires_grad=p.requires_grad)
    new.__dict__.update(p.__dict__)  # swapped into p with the tensor
    try:
        torch.utils.swap_tensors(p, new)
    except RuntimeError:
        return False
    return True


def _reshape_param(p: nn.Parameter, data: Tensor) -> None:
    """Give ``p`` ``data`` of another shape, keeping the Python object and dropping its
    gradient.

    Where the autograd engine allows, the tensor underneath is swapped for a fresh one
    (:func:`swap_param`): a graph the caller still holds from the last step (``loss`` of a
    training loop, alive until the next assignment) keeps the parameter's gradient
    accumulator, which remembers the old shape, so the next backward would fail against
    it. Otherwise ``p.data`` is replaced."""
    if not swap_param(p, data):
        p.data = data
    p.grad = None


def scaled_isometry(shape: Sequence[int], std: float, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> Tensor:
    """A random core of ``shape`` ``(r_{k-1}, *modes, r_k)`` whose matricisation ``A``
    ``(m, r_k)``, ``m = r_{k-1}·∏ modes``, has orthogonal columns of norm ``std·√m``
    (``AᵀA = std²·m·I``; orthogonal rows of norm ``std·√r_k`` when ``m < r_k``): the
    entry scale ``std`` of an i.i.d. ``N(0, std²)`` core, each entry of variance
    ``std²`` in law, but a train of such cores is a scaled isometry chain, so its
    product is not the heavy-tailed product of independent Gaussians.

    Why: a train of i.i.d. Gaussian cores with 6 cores a layer (``d = 3``) sat on a loss
    plateau that the same network dense leaves at once (a GELU MLP on Friedman #1, 2 of 5
    seeds still there after 2,000 AdamW steps); from these cores every seed left it
    within 750 steps (experiments/own_loop.py). Draws one ``randn`` of the core's size
    (the generator advances as for a Gaussian core) and orthogonalises it by QR."""
    m = math.prod(shape[:-1])
    r = int(shape[-1])
    work = torch.float64 if dtype == torch.float64 else torch.float32
    a = torch.randn(m, r, dtype=work, device=device)
    tall = m >= r
    q, rr = torch.linalg.qr(a if tall else a.T)
    diag = torch.diagonal(rr)
    q = q * torch.sign(diag).where(diag != 0, 1.0)  # the unique Q of a positive diagonal
    core = (q if tall else q.T) * (std * math.sqrt(max(m, r)))
    return core.reshape(*shape).to(dtype or torch.get_default_dtype()).contiguous()


class TensorTrain(nn.Module):
    """Gated tensor train with cores of shape ``(r_{k-1}, *mode_shapes[k], r_k)``.

    The rank gates of all ``K-1`` bonds are one parameter, ``gate`` ``(Σ_k r_k,)``, bond
    by bond; ``alive`` ``(Σ_k r_k,)`` (bool buffer) marks the entries never pruned.
    :attr:`gates` and :meth:`parts` give each bond's vector as a view of them.

    Args:
        mode_shapes: per core, its mode shape: ``(s_k,)`` or ``(v_k, e_k)``.
        rank: scalar (clamped to the maximal TT ranks) or internal ranks (length K-1).
        tau: gate threshold; entries with ``|g| <= tau`` are pruned.
        init_var: variance of the reconstructed tensor's entries at initialisation
            (cores :func:`scaled_isometry` with entry scale ``std = (init_var /
            ∏ r_k)^(1/(2K))``, as i.i.d. normal cores of that std would have).
    """

    def __init__(
        self,
        mode_shapes: Sequence[Sequence[int]],
        rank: int | Sequence[int],
        tau: float = 1e-2,
        init_var: float = 1.0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.mode_shapes = [tuple(int(x) for x in m) for m in mode_shapes]
        if not self.mode_shapes or any(not m or min(m) < 1 for m in self.mode_shapes):
            raise ValueError(f"mode_shapes: need non-empty positive shapes, got {mode_shapes}")
        self._mode_sizes = tuple(math.prod(m) for m in self.mode_shapes)
        if tau < 0:
            raise ValueError(f"tau: must be >= 0, got {tau}")
        self.tau = float(tau)
        ranks = _resolve_ranks(rank, self.mode_sizes)
        full = [1, *ranks, 1]
        K = len(self.mode_shapes)
        self.init_var = float(init_var)
        std = (init_var / max(1, math.prod(ranks))) ** (1.0 / (2 * K))
        #: the cores' entry scale at initialisation (gate balancing keeps their slices at it)
        self.init_std = float(std)
        # a train built on the meta device (to be measured: the run plan, the preview, an
        # export's skeleton) draws nothing: torch's meta randn imports its symbolic-shape
        # machinery (sympy and Dynamo, a second or more of a command's start)
        on_meta = torch.empty(0, device=device).is_meta
        shapes = [(full[k], *self.mode_shapes[k], full[k + 1]) for k in range(K)]
        self.cores = nn.ParameterList(
            nn.Parameter(torch.empty(shape, dtype=dtype, device=device) if on_meta
                         else scaled_isometry(shape, std, dtype, device))
            for shape in shapes
        )
        self.gate = nn.Parameter(torch.ones(sum(ranks), dtype=dtype, device=device))
        self.register_buffer("alive", torch.ones(sum(ranks), dtype=torch.bool, device=device))
        #: the allocated internal ranks: the lengths of the bonds' parts of ``gate``
        self.bond_ranks: tuple[int, ...] = tuple(ranks)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw the cores afresh as a new train at the current ranks is drawn (entry scale
        from ``init_var``), every gate 1 and alive: torch's convention for filling a
        module built on the ``meta`` device after ``to_empty`` (nothing is drawn on
        ``meta``)."""
        ranks = self.bond_ranks
        self.init_std = float((self.init_var / max(1, math.prod(ranks)))
                              ** (1.0 / (2 * self.num_cores)))
        for core in self.cores:
            if not core.is_meta:
                core.copy_(scaled_isometry(core.shape, self.init_std, core.dtype, core.device))
        self.gate.fill_(1.0)
        self.alive.fill_(True)

    @torch.no_grad()
    def rescale_init_(self, init_var: float) -> None:
        """Scale the cores so the reconstructed tensor's entries have variance ``init_var``
        where they had :attr:`init_var` (each core by ``(init_var / old)^(1/(2K))``; the
        draws themselves unchanged), and keep the new scale as the train's (``init_var``,
        ``init_std``, what :meth:`reset_parameters` draws at). For a fresh train only."""
        if not (init_var > 0 and math.isfinite(init_var)):
            raise ValueError(f"init_var: must be positive and finite, got {init_var}")
        factor = (init_var / self.init_var) ** (1.0 / (2 * self.num_cores))
        for core in self.cores:
            if not core.is_meta:
                core.mul_(factor)
        self.init_var = float(init_var)
        self.init_std *= factor

    # ----------------------------------------------------------------- structure
    @property
    def num_cores(self) -> int:
        return len(self.mode_shapes)

    @property
    def mode_sizes(self) -> list[int]:
        """``s_k = ∏ mode_shapes[k]``."""
        return list(self._mode_sizes)

    @property
    def ranks(self) -> list[int]:
        """Allocated ranks ``[1, r_1, …, r_{K-1}, 1]``."""
        return [1, *self.bond_ranks, 1]

    def structure(self) -> tuple[tuple[int, ...], tuple[int, ...], float]:
        """``(internal ranks, mode sizes, tau)``: what an index over the gates is built
        from (:func:`comera_engine.tensor.size.size_form`)."""
        return self.bond_ranks, self._mode_sizes, self.tau

    @property
    def gates(self) -> list[Tensor]:
        """Each bond's gate vector ``(r_k,)``: a view of :attr:`gate`."""
        return list(self.gate.split(self.bond_ranks))

    def bond_alive(self) -> list[Tensor]:
        """Each bond's ``alive`` vector ``(r_k,)``: a view of the buffer."""
        return list(self.alive.split(self.bond_ranks))

    def parts(self) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """The cores, each bond's gates and each bond's ``alive`` vector as plain lists
        (the gates views of :attr:`gate`, differentiable into it)."""
        return (list(self.cores._parameters.values()), self.gates, self.bond_alive())

    def flat_parts(self) -> tuple[list[Tensor], Tensor, Tensor]:
        """The cores, all bonds' gates as one vector (:attr:`gate` itself) and their
        ``alive`` flags as one: what the TT-linear Functions take to leave the gate's
        gradient as one vector (no split views, no concatenation in backward)."""
        return list(self.cores._parameters.values()), self.gate, self.alive

    def active(self) -> Tensor:
        """The active gate entries, all bonds: ``alive & (|gate| > tau)`` (bool)."""
        with torch.no_grad():
            return self.alive & (self.gate.abs() > self.tau)

    def masks(self) -> list[Tensor]:
        """Per bond: boolean mask of active gate entries (alive and ``|g| > tau``)."""
        return list(self.active().split(self.bond_ranks))

    def effective_ranks(self) -> list[int]:
        """Effective internal ranks (length K-1): active gate entries per bond. On the
        ``meta`` device (a network planned before it is allocated, no values) the train
        is as built, every entry alive: the allocated ranks."""
        if not self.bond_ranks:
            return []
        if self.gate.is_meta:
            return list(self.bond_ranks)
        return [int(c) for c in torch.stack([m.sum() for m in self.masks()]).tolist()]

    def num_params(self, effective: bool = True) -> int:
        """Core parameters, :func:`~comera_engine.tensor.size.tt_size` at the effective
        ranks (0 if any bond has rank 0), or allocated (``Σ numel(G_k)``). Gates are
        training-only controls (absorbed into cores on export) and are not counted; see
        ``gate_params``."""
        if not effective:
            return sum(c.numel() for c in self.cores)
        return tt_size(self.mode_sizes, self.effective_ranks())

    @property
    def gate_params(self) -> int:
        return self.gate.numel()

    # ----------------------------------------------------------------- math
    def gated_cores(self) -> list[Tensor]:
        """Cores with the masked gates absorbed into their right bond:
        ``G_k · diag(g_k ⊙ mask_k)`` for ``k < K``, ``G_K`` as is. Differentiable in both
        cores and gates; dead entries contribute (and receive) exactly zero."""
        cores, gates, alive = self.parts()
        return absorb_gates(cores, gates, self.tau, alive)

    def full_tensor(self) -> Tensor:
        """Contract all (gated) cores: shape ``(*mode_shapes[0], *mode_shapes[1], …)``."""
        cores = self.gated_cores()
        shape = [x for m in self.mode_shapes for x in m]
        if min(self.ranks) == 0:  # a bond of rank 0: the zero tensor
            return cores[0].new_zeros(shape)
        return contract_chain(cores).reshape(shape)

    def to_dense(self) -> Tensor:
        """The full tensor (same layout as tensorly's ``tt_to_tensor``)."""
        return self.full_tensor()

    # ----------------------------------------------------------------- pruning
    @torch.no_grad()
    def refresh_(self, floor: bool = True) -> list[RankChange]:
        """Make pruning permanent: entries with ``|g| <= tau`` become dead for good and
        are set to exactly 0; with ``floor`` a bond keeps at least one entry (its
        strongest, held at ``1.5·tau``; without, a bond may reach rank 0 and the train is
        the zero map, as the paper allows). Call after each optimizer step. Returns bonds
        whose effective rank changed."""
        gate = self.gate.detach()
        if not self.bond_ranks or bool(self.active().all()):
            return []  # every entry alive and above tau: nothing to prune or to zero
        changes = []
        for k, (g, alive) in enumerate(zip(gate.split(self.bond_ranks),
                                           self.alive.split(self.bond_ranks))):
            old = int(alive.sum())
            survivors = alive & (g.abs() > self.tau)
            if floor and old > 0 and not bool(survivors.any()):
                # never prune a bond to rank 0 (the layer would become the zero map): keep
                # its strongest entry, held just above the threshold
                j = int(torch.argmax(g.abs().masked_fill(~alive, -1.0)))
                survivors[j] = True
                g[j] = -1.5 * self.tau if bool(g[j] < 0) else 1.5 * self.tau
            alive &= survivors
            g.masked_fill_(~alive, 0.0)
            new = int(alive.sum())
            if new != old:
                changes.append(RankChange(k, old, new))
        return changes

    @torch.no_grad()
    def set_entry_(self, bond: int, entry: int, alive: bool, value: float) -> None:
        """Set one rank entry: its ``alive`` flag and its gate value (a prune: ``False``,
        0; a revival: ``True``, a value above ``tau``)."""
        offset = sum(self.bond_ranks[:bond]) + entry
        self.alive[offset] = alive
        self.gate.detach()[offset] = value

    @torch.no_grad()
    def effective_cores(self) -> tuple[list[Tensor], list[int]]:
        """The cores sliced to the effective ranks with the gates absorbed (detached
        copies), and the internal ranks. With a rank-0 bond the train is the zero map:
        every internal rank is then 0 (no parameters, as ``size_report`` counts it)."""
        keep = self.keep_indices()
        K = self.num_cores
        if any(k.numel() == 0 for k in keep):
            ref = self.cores[0]
            full = [1] + [0] * (K - 1) + [1]
            return ([ref.new_zeros(full[k], *self.mode_shapes[k], full[k + 1])
                     for k in range(K)], [0] * (K - 1))
        out = []
        for k, c in enumerate(self.gated_cores()):
            if k > 0:
                c = c.index_select(0, keep[k - 1])
            if k < K - 1:
                c = c.index_select(c.dim() - 1, keep[k])
            out.append(c.detach().contiguous().clone())
        return out, [int(k.numel()) for k in keep]

    @torch.no_grad()
    def keep_indices(self) -> list[Tensor]:
        """Per bond, the indices of active entries (what ``truncate_`` keeps)."""
        return [torch.nonzero(m, as_tuple=False).flatten() for m in self.masks()]

    @torch.no_grad()
    def truncate_(
        self, on_slice: Callable[[nn.Parameter, int, Tensor], None] | None = None,
    ) -> list[RankChange]:
        """Physically slice cores and gates to the effective ranks, in place.

        The same ``nn.Parameter`` objects are kept (their tensors replaced), so optimizer
        parameter groups stay valid. ``on_slice(param, dim, keep)`` is called before each
        parameter is sliced along ``dim`` to the indices ``keep``: the hook through which
        optimizer state is sliced the same way (see ``comera_engine.rank``). The computed
        tensor is unchanged.
        """
        return self.select_(self.keep_indices(), on_slice)

    @torch.no_grad()
    def select_(
        self, keep: Sequence[Tensor],
        on_slice: Callable[[nn.Parameter, int, Tensor], None] | None = None,
    ) -> list[RankChange]:
        """Keep the entries ``keep[k]`` (indices, in order) of every bond ``k``: the cores'
        bond slices, the gates and ``alive`` (the parameter objects kept; ``on_slice`` as
        in :meth:`truncate_`). Returns the bonds whose allocated rank changed."""
        if len(keep) != len(self.bond_ranks):
            raise ValueError(f"keep: one index vector per bond ({len(self.bond_ranks)}), "
                             f"got {len(keep)}")
        changes = [RankChange(k, r, int(kk.numel()))
                   for k, (r, kk) in enumerate(zip(self.bond_ranks, keep)) if kk.numel() != r]
        if not changes:
            return []
        for ch in changes:
            k = ch.bond
            for p, dim in ((self.cores[k], self.cores[k].dim() - 1), (self.cores[k + 1], 0)):
                if on_slice is not None:
                    on_slice(p, dim, keep[k])
                _reshape_param(p, p.data.index_select(dim, keep[k]).contiguous())
        offsets = [0, *itertools.accumulate(self.bond_ranks)]
        flat = torch.cat([kk.to(self.alive.device) + offsets[k] for k, kk in enumerate(keep)])
        if on_slice is not None:
            on_slice(self.gate, 0, flat)
        _reshape_param(self.gate, self.gate.data.index_select(0, flat).contiguous())
        self.alive = self.alive.index_select(0, flat).contiguous()
        self.bond_ranks = tuple(int(kk.numel()) for kk in keep)
        return changes

    def resize_(self, ranks: Sequence[int]) -> None:
        """Reallocate cores and gates at the given internal ranks (values lost: cores 0,
        gates 1, all alive), keeping the parameter objects: a train is shaped like a
        checkpoint before its values are loaded."""
        ranks = [int(r) for r in ranks]
        if len(ranks) != self.num_cores - 1 or min(ranks, default=1) < 0:
            raise ValueError(f"ranks: need {self.num_cores - 1} non-negative ranks, got {ranks}")
        full = [1, *ranks, 1]
        with torch.no_grad():
            for k, c in enumerate(self.cores):
                _reshape_param(c, c.data.new_zeros(full[k], *self.mode_shapes[k], full[k + 1]))
            _reshape_param(self.gate, self.gate.data.new_ones(sum(ranks)))
            self.alive = torch.ones(sum(ranks), dtype=torch.bool, device=self.gate.device)
        self.bond_ranks = tuple(ranks)

    @torch.no_grad()
    def load_cores_(self, cores: Sequence[Tensor | np.ndarray]) -> None:
        """Replace the cores by the given ones (any ranks); gates reset to 1, all alive."""
        if len(cores) != self.num_cores:
            raise ValueError(f"cores: expected {self.num_cores} cores, got {len(cores)}")
        ref = self.cores[0]
        ts = [torch.as_tensor(np.asarray(c) if not isinstance(c, Tensor) else c) for c in cores]
        for k, t in enumerate(ts):
            want = self.mode_shapes[k]
            if tuple(t.shape[1:-1]) != want and t.shape[1:-1].numel() != math.prod(want):
                raise ValueError(f"cores: core {k} has modes {tuple(t.shape[1:-1])}, want {want}")
            if k and t.shape[0] != ts[k - 1].shape[-1]:
                raise ValueError(f"cores: rank mismatch between cores {k - 1} and {k}")
        self.resize_([int(t.shape[-1]) for t in ts[:-1]])
        for k, t in enumerate(ts):
            self.cores[k].copy_(t.reshape(t.shape[0], *self.mode_shapes[k], t.shape[-1]).to(
                dtype=ref.dtype, device=ref.device))

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        """Load a state dict of any ranks: the train is first reshaped to the saved cores
        (:meth:`resize_`), so a truncated checkpoint loads into a freshly built model
        (before or after a controller's state). State dicts from before the gates were
        one tensor (``gates.<k>``, ``alive_<k>``) are read too."""
        K = self.num_cores
        old = [f"{prefix}gates.{k}" for k in range(K - 1)]
        if K > 1 and f"{prefix}gate" not in state_dict and all(k in state_dict for k in old):
            state_dict[f"{prefix}gate"] = torch.cat([state_dict.pop(k) for k in old])
            alive = [state_dict.pop(f"{prefix}alive_{k}", None) for k in range(K - 1)]
            if all(a is not None for a in alive):
                state_dict[f"{prefix}alive"] = torch.cat(alive)  # type: ignore[arg-type]
        saved = [state_dict.get(f"{prefix}cores.{k}") for k in range(K)]
        if all(isinstance(c, Tensor) for c in saved):
            ranks = [int(c.shape[-1]) for c in saved[:-1]]  # type: ignore[union-attr]
            if ranks != list(self.bond_ranks):
                self.resize_(ranks)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"modes={self.mode_shapes}, ranks={self.ranks}, tau={self.tau}"


def _factor_pair(first: Sequence[int], second: Sequence[int], names: tuple[str, str]
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two factor lists of one TT matrix (its row and column modes) as int tuples of equal
    length; ValueError naming the second list otherwise."""
    a, b = tuple(int(x) for x in first), tuple(int(x) for x in second)
    if len(a) != len(b):
        raise ValueError(f"{names[1]}: need as many factors as {names[0]} ({len(a)}), "
                         f"got {len(b)}")
    return a, b


def _zero_padded(A: Tensor, rows: Sequence[int], cols: Sequence[int], name: str,
                 pad_cols: bool) -> Tensor:
    """``A`` ``(a, b)`` zero-padded to ``(∏ rows, ∏ cols)`` (``b`` must equal ``∏ cols``
    unless ``pad_cols``); ValueError naming ``name`` where it does not fit."""
    R, C = math.prod(rows), math.prod(cols)
    if A.dim() != 2 or A.shape[0] > R or A.shape[1] > C or (not pad_cols and A.shape[1] != C):
        raise ValueError(f"{name}: shape {tuple(A.shape)} does not fit factors {R}×{C}")
    out = A.new_zeros(R, C)
    out[: A.shape[0], : A.shape[1]] = A
    return out


class _TTMatrix(TensorTrain):
    """A TT matrix (:class:`TTLinearCores`, :class:`TTMCores`): its matrix, and TT-SVD
    from one (each subclass gives ``_svd_cores`` and the ``shape``)."""

    shape: tuple[int, int]

    def to_matrix(self) -> Tensor:
        """The matrix ``(∏ row factors, ∏ column factors)``, padding included: ``W``
        ``(N, M)`` (inputs × outputs) or ``E`` ``(∏ v, ∏ e)``."""
        return self.to_dense().reshape(self.shape)

    @classmethod
    def from_matrix(cls, A: Tensor, row_factors: Sequence[int], col_factors: Sequence[int],
                    max_rank: int | Sequence[int] | None = None, tol: float | None = None,
                    tau: float = 1e-2) -> Self:
        """TT-SVD of the matrix ``A`` (zero-padded to the factor products) into a new
        TT matrix of the ranks found."""
        cores = cls._svd_cores(A, row_factors, col_factors, max_rank, tol)
        obj = cls(row_factors, col_factors, [c.shape[-1] for c in cores[:-1]], tau=tau,
                  dtype=A.dtype, device=A.device)
        obj.load_cores_(cores)
        return obj

    from_dense = from_matrix  # ``TTLinearCores.from_dense(W, in_factors, out_factors, …)``


class TTLinearCores(_TTMatrix):
    """Order-2d TT of a weight ``W ∈ R^{N×M}`` (``N = ∏ n_i`` inputs, ``M = ∏ m_i`` outputs):
    cores ``(r_{k-1}, s_k, r_k)`` with ``s = (n_1..n_d, m_1..m_d)``, row-major unfolding."""

    def __init__(self, in_factors: Sequence[int], out_factors: Sequence[int],
                 rank: int | Sequence[int], tau: float = 1e-2, init_var: float = 1.0,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None
                 ) -> None:
        self.in_factors, self.out_factors = _factor_pair(in_factors, out_factors,
                                                         ("in_factors", "out_factors"))
        modes = [(n,) for n in self.in_factors] + [(m,) for m in self.out_factors]
        super().__init__(modes, rank, tau=tau, init_var=init_var, dtype=dtype, device=device)
        self._shape = (math.prod(self.in_factors), math.prod(self.out_factors))

    @property
    def d(self) -> int:
        return len(self.in_factors)

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, M)`` including padding (fixed by the factors)."""
        return self._shape

    @staticmethod
    def _svd_cores(W: Tensor, in_factors: Sequence[int], out_factors: Sequence[int],
                   max_rank: int | Sequence[int] | None, tol: float | None) -> list[Tensor]:
        """TT-SVD of ``W (N×M)`` zero-padded to the factor products: the 2d cores."""
        Wp = _zero_padded(W, in_factors, out_factors, "W", pad_cols=True)
        return tt_svd(Wp.reshape(*in_factors, *out_factors), max_rank=max_rank, tol=tol)



class TTMCores(_TTMatrix):
    """TT-matrix of a table ``E ∈ R^{V×D}``: cores ``(r_{k-1}, v_k, e_k, r_k)``,
    ``V <= ∏ v_k``, ``D = ∏ e_k``. Row ``i`` unravels to ``(i_1..i_d)`` (row-major)."""

    def __init__(self, row_factors: Sequence[int], col_factors: Sequence[int],
                 rank: int | Sequence[int], tau: float = 1e-2, init_var: float = 1.0,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None
                 ) -> None:
        self.row_factors, self.col_factors = _factor_pair(row_factors, col_factors,
                                                          ("row_factors", "col_factors"))
        modes = list(zip(self.row_factors, self.col_factors))
        super().__init__(modes, rank, tau=tau, init_var=init_var, dtype=dtype, device=device)

    @property
    def d(self) -> int:
        return len(self.row_factors)

    @property
    def shape(self) -> tuple[int, int]:
        return math.prod(self.row_factors), math.prod(self.col_factors)

    def to_matrix(self) -> Tensor:
        """The matrix ``(∏ v_k, ∏ e_k)`` of the gated cores, padding included
        (:func:`comera_engine.ops.ttm_matrix.ttm_matrix`: one autograd node on the CPU
        backend)."""
        cores, gates, alive = self.parts()
        return gated_ttm_matrix(cores, gates, alive, self.tau)

    def to_dense(self) -> Tensor:
        """Full tensor ``(v_1..v_d, e_1..e_d)`` (tensorly's ``tt_matrix_to_tensor`` layout)."""
        d = self.d
        t = self.full_tensor()  # (v1, e1, v2, e2, ...)
        perm = [2 * k for k in range(d)] + [2 * k + 1 for k in range(d)]
        return t.permute(perm)

    @staticmethod
    def _svd_cores(E: Tensor, row_factors: Sequence[int], col_factors: Sequence[int],
                   max_rank: int | Sequence[int] | None, tol: float | None) -> list[Tensor]:
        """TT-SVD of ``E (V×D)`` in TTM format (rows zero-padded to ``∏ v``): the d cores
        ``(r, v_k, e_k, r')``."""
        d = len(row_factors)
        Ep = _zero_padded(E, row_factors, col_factors, "E", pad_cols=False)
        t = Ep.reshape(*row_factors, *col_factors)
        perm = [x for k in range(d) for x in (k, d + k)]
        t = t.permute(perm).reshape([v * e for v, e in zip(row_factors, col_factors)])
        cores = tt_svd(t, max_rank=max_rank, tol=tol)
        return [c.reshape(c.shape[0], v, e, c.shape[-1])
                for c, v, e in zip(cores, row_factors, col_factors)]

