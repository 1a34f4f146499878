"""Compressed embedding tables a recommender engineer uses instead of TT, and the dense
table with sparse-gradient Adam, behind one interface (:func:`build_peer`: a table of
``num_embeddings`` rows of width ``dim`` in at most ``budget`` bytes as stored).

=========  ==========================================================================
kind       ``forward(ids) -> E(ids)`` (ids any shape, output ``ids.shape + (dim,)``)
=========  ==========================================================================
dense      ``W[i]``, ``W`` (N × D) fp32 (no budget: 4·N·D bytes)
hash       ``W[i mod m]``, ``m = ⌊budget / 4D⌋`` rows (the hashing trick; the ids of a
           Criteo field are already hashes, so the modulus is the hash)
qr         ``Q[i div m] ⊙ R[i mod m]`` (Shi et al. 2020, compositional embeddings by the
           quotient–remainder trick, elementwise product), ``Q`` (⌈N/m⌉ × D) initialised
           to ones, ``R`` (m × D), ``m`` the largest with ``⌈N/m⌉ + m ≤ budget / 4D``
mixed      mixed dimensions by popularity (Ginart et al. 2021): the ``K`` most frequent ids
           (``counts``) in a full-width block ``H`` (K × D); every other id in a narrow
           block ``C`` (m × d, ``d = D/4``) at ``i mod m``, projected by ``P`` (d × D):
           ``E(i) = H[rank(i)]`` for a hot id, else ``C[i mod m] P``; half the budget
           each (the cold block hashed to fit: a 10^7-row field cannot hold even one
           float a row at 30×)
int8       row-wise int8 storage: ``E(i) = s_j · q_j`` with ``q`` int8 (m × D),
           ``s_j = max|row_j| / 127`` fp32 (m), ``j = i mod m`` and
           ``m = min(N, ⌊budget / (D + 4)⌋)``; trained by quantisation-aware training:
           the forward reads the quantised rows of an fp32 master copy (straight-through
           gradient), and after each update the touched rows are re-quantised into
           ``q, s`` (the stored bytes; the master and the Adam state are training
           memory only)
tt         the engine's :class:`~comera_engine.layers.TTEmbedding` at the largest
           uniform rank whose cores fit the budget, gates frozen (fixed ranks)
=========  ==========================================================================

Training: every row table here is a ``Parameter`` with ``requires_grad=False`` (so it is
counted as stored bytes, and no dense optimizer touches it) updated by
:class:`RowSparseAdam` *inside the backward pass*, on the rows the batch looked up only:
exactly ``torch.optim.SparseAdam``'s update (the moments of rows not looked up are left
alone), at the table's own learning rate, as TorchRec / FBGEMM fuse the embedding
optimizer into the backward (so, as there, the trainer's gradient clipping does not
reach these rows: the trainer has no learning-rate schedule for it to miss). A dense
``N × D`` Adam would update every row every step. Other parameters (the mixed-dimension
projection, the TT cores) are ordinary parameters for the model's optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["PEER_KINDS", "DenseTable", "HashTable", "Int8Table", "MixedDimTable", "QRTable",
           "RowSparseAdam", "build_peer", "peer_tables", "qr_split", "tt_rank_for_budget"]

PEER_KINDS = ("dense", "hash", "qr", "mixed", "int8", "tt")
_F32 = 4


class RowSparseAdam(nn.Module):
    """One fp32 table (``weight``, N × D, not a trainable parameter) updated in the
    backward pass by ``torch.optim.SparseAdam``'s rule on the rows looked up.

    For the unique rows ``u`` with summed gradient ``g`` at step ``t``:
    ``m_u ← β1 m_u + (1-β1) g``, ``v_u ← β2 v_u + (1-β2) g²``,
    ``W_u ← W_u - lr · √(1-β2^t)/(1-β1^t) · m_u / (√v_u + ε)``.
    """

    def __init__(self, rows: int, dim: int, init: Tensor | None = None, lr: float = 1e-2,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 stored: bool = True) -> None:
        super().__init__()
        w = init if init is not None else torch.empty(rows, dim).uniform_(
            -1.0 / math.sqrt(rows), 1.0 / math.sqrt(rows))
        w = w.float().contiguous()
        if stored:  # a parameter (counted as stored bytes) no optimizer sees
            self.weight = nn.Parameter(w, requires_grad=False)
        else:  # training state only (the int8 table's master)
            self.register_buffer("weight", w)
        self.register_buffer("exp_avg", torch.zeros(rows, dim))
        self.register_buffer("exp_avg_sq", torch.zeros(rows, dim))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.lr, self.betas, self.eps = float(lr), betas, float(eps)

    def lookup(self, idx: Tensor) -> Tensor:
        """``weight[idx]``; when gradients are on, its gradient updates the looked-up
        rows (:meth:`update`) as the backward reaches it."""
        rows = F.embedding(idx, self.weight)
        if not (self.training and torch.is_grad_enabled()):
            return rows
        rows = rows.detach().requires_grad_()
        rows.register_hook(lambda g, idx=idx: self.update(idx, g))
        return rows

    @torch.no_grad()
    def update(self, idx: Tensor, grad: Tensor) -> None:
        """Apply one SparseAdam step for the gradient ``grad`` (``idx.shape + (D,)``) of
        the rows ``idx`` (duplicates summed)."""
        flat = idx.reshape(-1)
        uniq, inverse = torch.unique(flat, return_inverse=True)
        g = torch.zeros(len(uniq), grad.shape[-1], dtype=torch.float32, device=grad.device)
        g.index_add_(0, inverse, grad.reshape(-1, grad.shape[-1]).float())
        self.step += 1
        t = int(self.step)
        b1, b2 = self.betas
        m = self.exp_avg[uniq].mul_(b1).add_(g, alpha=1 - b1)
        v = self.exp_avg_sq[uniq].mul_(b2).addcmul_(g, g, value=1 - b2)
        self.exp_avg[uniq] = m
        self.exp_avg_sq[uniq] = v
        step_size = self.lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        self.weight[uniq] = self.weight[uniq] - step_size * m / (v.sqrt() + self.eps)
        self.after_update(uniq)

    def after_update(self, rows: Tensor) -> None:
        """Called with the rows just updated (the int8 table re-quantises them)."""

    def stored_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class _Peer(nn.Module):
    """What every peer has: its shape and its stored bytes."""

    num_embeddings: int
    embedding_dim: int

    def stored_bytes(self) -> int:
        """Bytes of the table as stored (tables, scales, projections; no optimizer state)."""
        raise NotImplementedError

    def dense_bytes(self) -> int:
        """Bytes of the dense fp32 table it stands for: ``4 · N · D``."""
        return self.num_embeddings * self.embedding_dim * _F32

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, stored={self.stored_bytes():,} B"


class DenseTable(_Peer):
    """``W[i]``: the full table, row-sparse Adam."""

    def __init__(self, num_embeddings: int, dim: int, lr: float = 1e-2) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, dim
        self.table = RowSparseAdam(num_embeddings, dim, lr=lr)

    def forward(self, ids: Tensor) -> Tensor:
        return self.table.lookup(ids.long())

    def stored_bytes(self) -> int:
        return self.table.stored_bytes()


class HashTable(_Peer):
    """``W[i mod m]`` with ``m`` rows."""

    def __init__(self, num_embeddings: int, dim: int, rows: int, lr: float = 1e-2) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, dim
        self.rows = max(1, min(int(rows), num_embeddings))
        self.table = RowSparseAdam(self.rows, dim, lr=lr)

    def forward(self, ids: Tensor) -> Tensor:
        return self.table.lookup(ids.long() % self.rows)

    def stored_bytes(self) -> int:
        return self.table.stored_bytes()


def qr_split(num_embeddings: int, rows: int) -> tuple[int, int]:
    """``(m, q)``: the remainder and quotient table rows within ``rows`` in all: the
    largest ``m`` with ``⌈N/m⌉ + m ≤ rows`` and ``q = ⌈N/m⌉`` (``(N, 1)`` when the
    budget holds the whole table plus one quotient row); below ``2√N`` rows, where no
    such ``m`` exists, ``m = ⌈rows/2⌉`` and ``q = rows - m`` (the quotient then taken
    mod ``q``)."""
    n = num_embeddings
    if rows >= n + 1:
        return n, 1
    best = 0
    # m + ceil(n/m) is convex in m: the largest feasible m is below rows
    lo, hi = max(1, math.isqrt(n)), max(1, rows - 1)
    while lo <= hi:
        mid = (lo + hi) // 2
        if mid + -(-n // mid) <= rows:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    if best == 0 or best + -(-n // best) > rows:
        m = max(1, (rows + 1) // 2)
        return m, max(1, rows - m)
    return best, -(-n // best)


class QRTable(_Peer):
    """``Q[(i div m) mod q] ⊙ R[i mod m]`` (quotient–remainder, elementwise product;
    ``q = ⌈N/m⌉`` unless the budget is below ``2√N`` rows, :func:`qr_split`)."""

    def __init__(self, num_embeddings: int, dim: int, rows: int, lr: float = 1e-2) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, dim
        self.m, self.q = qr_split(num_embeddings, rows)
        self.quotient = RowSparseAdam(self.q, dim, init=torch.ones(self.q, dim), lr=lr)
        self.remainder = RowSparseAdam(self.m, dim, lr=lr)

    def forward(self, ids: Tensor) -> Tensor:
        ids = ids.long()
        return (self.quotient.lookup((ids // self.m) % self.q)
                * self.remainder.lookup(ids % self.m))

    def stored_bytes(self) -> int:
        return self.quotient.stored_bytes() + self.remainder.stored_bytes()


class MixedDimTable(_Peer):
    """Hot ids (the ``K`` most frequent) at width ``D``, the rest at width ``d`` hashed into
    ``m`` rows and projected: ``E(i) = H[rank(i)]`` or ``C[i mod m] P``.

    Args:
        hot_ids: the hot ids, most frequent first (their block rows in that order).
        cold_rows, cold_dim: ``m`` and ``d``.
    """

    def __init__(self, num_embeddings: int, dim: int, hot_ids: Tensor, cold_rows: int,
                 cold_dim: int, lr: float = 1e-2) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, dim
        hot = torch.as_tensor(hot_ids, dtype=torch.long).reshape(-1)
        order = torch.argsort(hot)
        # the id -> hot row map is part of what is stored (parameters no optimizer sees)
        self.hot_sorted = nn.Parameter(hot[order].contiguous(), requires_grad=False)
        self.hot_row = nn.Parameter(order.contiguous(), requires_grad=False)
        self.cold_rows, self.cold_dim = max(1, int(cold_rows)), int(cold_dim)
        # no hot ids: an empty block (nothing stored that the budget does not count)
        self.hot = RowSparseAdam(len(hot), dim, lr=lr,
                                 init=None if len(hot) else torch.zeros(0, dim))
        self.cold = RowSparseAdam(self.cold_rows, self.cold_dim, init=torch.empty(
            self.cold_rows, self.cold_dim).uniform_(-1 / math.sqrt(self.cold_rows),
                                                    1 / math.sqrt(self.cold_rows)), lr=lr)
        self.proj = nn.Parameter(torch.randn(self.cold_dim, dim) / math.sqrt(self.cold_dim))

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.long().reshape(-1)
        out = self.cold.lookup(flat % self.cold_rows) @ self.proj
        k = len(self.hot_sorted)
        if k:
            pos = torch.searchsorted(self.hot_sorted, flat).clamp_(max=k - 1)
            is_hot = self.hot_sorted[pos] == flat
            out = torch.where(is_hot.unsqueeze(-1), self.hot.lookup(self.hot_row[pos]), out)
        return out.reshape(*ids.shape, self.embedding_dim)

    def stored_bytes(self) -> int:
        k = len(self.hot_sorted)
        index = 2 * k * self.hot_sorted.element_size()  # the id -> row map
        return (k * self.embedding_dim * _F32 + index + self.cold.stored_bytes()
                + self.proj.numel() * _F32)


class _Int8Master(RowSparseAdam):
    """The fp32 master of an int8 table, re-quantising the rows it updates into its
    owner's ``codes`` / ``scales``."""

    def __init__(self, owner: Int8Table, rows: int, dim: int, lr: float) -> None:
        super().__init__(rows, dim, lr=lr, stored=False)
        self._owner = [owner]  # not a submodule

    def after_update(self, rows: Tensor) -> None:
        self._owner[0].quantize_rows_(rows)


def quantize_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """Row-wise symmetric int8: ``(q int8 [n, D], s fp32 [n])`` with ``s = max|w_row|/127``
    (1 for an all-zero row) and ``q = round(w / s)`` (|w - s q| ≤ s / 2)."""
    s = w.abs().amax(dim=-1) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(w / s.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, s.float()


class Int8Table(_Peer):
    """Row-wise int8 table of ``m`` rows at ``i mod m`` (``m = N``: every id its row),
    trained by QAT through an fp32 master (module docstring)."""

    def __init__(self, num_embeddings: int, dim: int, rows: int, lr: float = 1e-2) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, dim
        self.rows = max(1, min(int(rows), num_embeddings))
        self.master = _Int8Master(self, self.rows, dim, lr)
        q, s = quantize_rows(self.master.weight)
        self.codes = nn.Parameter(q, requires_grad=False)
        self.scales = nn.Parameter(s, requires_grad=False)

    @torch.no_grad()
    def quantize_rows_(self, rows: Tensor) -> None:
        q, s = quantize_rows(self.master.weight[rows])
        self.codes[rows] = q
        self.scales[rows] = s

    def dequantized(self, idx: Tensor) -> Tensor:
        """``s_j q_j`` for the rows ``idx`` (what is stored, read back)."""
        return self.codes[idx].float() * self.scales[idx].unsqueeze(-1)

    def forward(self, ids: Tensor) -> Tensor:
        idx = ids.long() % self.rows
        stored = self.dequantized(idx)
        if not (self.training and torch.is_grad_enabled()):
            return stored
        master = self.master.lookup(idx)  # straight-through: value of the stored rows
        return master + (stored - master).detach()

    def stored_bytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * _F32


def tt_rank_for_budget(num_embeddings: int, dim: int, budget: int, max_rank: int = 256) -> int:
    """The largest uniform rank whose TT embedding's cores (fp32, the factors
    :class:`TTEmbedding` chooses, ranks clamped to the full TT ranks) fit ``budget``
    bytes (at least 1)."""
    from ..tensor.tt import max_tt_ranks
    from .tt_embedding import embedding_factors

    fv, fe = embedding_factors(num_embeddings, dim, None, None, None)
    modes = [a * b for a, b in zip(fv.factors, fe.factors)]
    caps = max_tt_ranks(modes)

    def nbytes(r: int) -> int:
        ranks = [1, *(min(r, c) for c in caps), 1]
        return sum(ranks[k] * modes[k] * ranks[k + 1] for k in range(len(modes))) * _F32

    lo, hi, best = 1, max_rank, 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if nbytes(mid) <= budget:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


class _FixedTT(_Peer):
    """The engine's ``TTEmbedding`` with its rank gates frozen (fixed ranks)."""

    def __init__(self, num_embeddings: int, dim: int, rank: int) -> None:
        super().__init__()
        from .tt_embedding import TTEmbedding

        self.num_embeddings, self.embedding_dim = num_embeddings, dim
        self.tt = TTEmbedding(num_embeddings, dim, rank=rank)
        for name, p in self.tt.named_parameters():
            if "gate" in name:
                p.requires_grad_(False)

    def forward(self, ids: Tensor) -> Tensor:
        return self.tt(ids)

    def stored_bytes(self) -> int:
        return self.tt.num_params() * _F32


def build_peer(kind: str, num_embeddings: int, dim: int, budget: int | None = None,
               counts: np.ndarray | Tensor | Sequence[int] | None = None,
               lr: float = 1e-2) -> nn.Module:
    """A ``kind`` table (:data:`PEER_KINDS`) of ``num_embeddings × dim`` in at most
    ``budget`` bytes as stored (``None``: the dense size). ``counts``: ids ordered by
    falling frequency (``mixed`` only; without it every id is cold). ``lr``: the
    row-sparse Adam's rate of the row tables.

    Raises:
        ValueError: an unknown ``kind`` or a budget below what the kind needs (one row).
    """
    n, d = int(num_embeddings), int(dim)
    full = n * d * _F32
    b = full if budget is None else int(budget)
    if kind not in PEER_KINDS:
        raise ValueError(f"kind: one of {', '.join(PEER_KINDS)}, got {kind!r}")
    if b < d * _F32:
        raise ValueError(f"budget: {b} bytes hold less than one row of {d} floats")
    if kind == "dense" or b >= full and kind in ("hash", "qr", "mixed"):
        return DenseTable(n, d, lr=lr) if kind != "qr" else QRTable(n, d, n + 1, lr=lr)
    if kind == "hash":
        return HashTable(n, d, b // (d * _F32), lr=lr)
    if kind == "qr":
        return QRTable(n, d, b // (d * _F32), lr=lr)
    if kind == "int8":
        return Int8Table(n, d, b // (d + _F32), lr=lr)
    if kind == "tt":
        return _FixedTT(n, d, tt_rank_for_budget(n, d, b))
    cold_dim = max(1, d // 4)
    hot_ids = torch.as_tensor(np.asarray(counts if counts is not None else [], dtype=np.int64))
    k = min(len(hot_ids), (b // 2) // (d * _F32 + 16))  # a hot row: D floats + its map entry
    left = b - k * (d * _F32 + 16) - cold_dim * d * _F32
    cold_rows = max(1, left // (cold_dim * _F32))
    return MixedDimTable(n, d, hot_ids[:k], cold_rows, cold_dim, lr=lr)


def peer_tables(model: nn.Module) -> list[tuple[str, _Peer]]:
    """``(qualified name, table)`` for every row-table peer in ``model`` (hash, QR, mixed,
    int8, dense with row-sparse Adam). The fixed-rank TT peer is left out: it holds a
    :class:`~comera_engine.layers.TTEmbedding`, counted as a TT layer
    (:func:`~comera_engine.layers.size_report`)."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, _Peer) and not isinstance(m, _FixedTT)]
