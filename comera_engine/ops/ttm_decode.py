"""The tied MLM decoder on a TTM word table: ``logits = h · Eᵀ`` without building ``E``.

``E`` (``V × D``, rows ``(a, b)``, columns ``(i, j)`` row-major) is given by the two
merged half tables of :func:`comera_engine.ops.ttm_lookup.merge_tables`::

    E[(a, b), (i, j)] = Σ_r A[a, i, r] · Bt[b, r, j]      A: (V_a, E_a, r), Bt: (V_b, r, E_b)

so, with ``h`` viewed as ``(N, E_a, E_b)``::

    T[n, i, r, b] = Σ_j h[n, i, j] · Bt[b, r, j]           (N, E_a·r, V_b)
    logits[n, (a, b)] = Σ_{i, r} A[a, i, r] · T[n, i, r, b]

The main product costs ``N·V·E_a·r`` multiply-adds instead of ``N·V·D`` (``r < E_b``
makes it cheaper), and nothing of size ``V × D`` exists: :class:`TTMDecode` saves only
``h``, ``A`` and ``Bt`` for backward and recomputes ``T`` chunk by chunk there, so the
memory held between forward and backward is ``N·D + |A| + |Bt|`` instead of the dense
table (and its gradient) that :func:`ttm_decode_reference` builds.
``experiments/bench_op_ttm_decode.py`` measures both.

Rows past ``num_rows`` (the factorised vocabulary may be larger) are dropped; the
padding row, as in the embedding, reads as zero and passes no gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .ttm_lookup import merge_tables

__all__ = ["TTMDecode", "decode_path", "ttm_decode", "ttm_decode_reference"]

#: Elements of one chunk's ``T`` (4 Mi: 16 MiB in fp32).
CHUNK_ELEMENTS = 1 << 22


def _t_chunk(hp: Tensor, Bt: Tensor) -> Tensor:
    """``T`` for rows ``hp`` (n, E_a, E_b): (n, E_a·r, V_b)."""
    n, Ea, Eb = hp.shape
    Vb, r, _ = Bt.shape
    t = hp.reshape(n * Ea, Eb) @ Bt.permute(2, 1, 0).reshape(Eb, r * Vb)  # (n·E_a, r·V_b)
    return t.reshape(n, Ea * r, Vb)


class TTMDecode(torch.autograd.Function):
    """Autograd of :func:`ttm_decode`; saves ``h``, ``A``, ``Bt``, recomputes ``T``."""

    @staticmethod
    def forward(ctx, h: Tensor, A: Tensor, Bt: Tensor, num_rows: int,  # noqa: ANN001
                pad_row: int | None, chunk: int) -> Tensor:
        N, D = h.shape
        Va, Ea, r = A.shape
        Vb, _, Eb = Bt.shape
        hp = F.pad(h, (0, Ea * Eb - D)).reshape(N, Ea, Eb)
        A2 = A.permute(1, 2, 0).reshape(Ea * r, Va)  # (E_a·r, V_a)
        out = h.new_empty(N, num_rows)
        for s in range(0, N, chunk):
            t = _t_chunk(hp[s:s + chunk], Bt)  # (n, K, V_b)
            o = (t.transpose(1, 2) @ A2).transpose(1, 2)  # (n, V_a, V_b)
            out[s:s + chunk] = o.reshape(o.shape[0], Va * Vb)[:, :num_rows]
        if pad_row is not None:
            out[:, pad_row] = 0
        ctx.save_for_backward(h, A, Bt)
        ctx.meta = (num_rows, pad_row, chunk)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):  # noqa: ANN001, ANN205
        h, A, Bt = ctx.saved_tensors
        num_rows, pad_row, chunk = ctx.meta
        N, D = h.shape
        Va, Ea, r = A.shape
        Vb, _, Eb = Bt.shape
        if pad_row is not None:
            g = g.clone()
            g[:, pad_row] = 0
        gp = F.pad(g, (0, Va * Vb - num_rows)).reshape(N, Va, Vb)
        hp = F.pad(h, (0, Ea * Eb - D)).reshape(N, Ea, Eb)
        A2 = A.permute(1, 2, 0).reshape(Ea * r, Va)
        Bm = Bt.permute(2, 1, 0).reshape(Eb, r * Vb)  # (E_b, r·V_b)
        gA2 = torch.zeros_like(A2)
        gBm = torch.zeros_like(Bm)
        gh = h.new_empty(N, Ea, Eb)
        for s in range(0, N, chunk):
            hc, gc = hp[s:s + chunk], gp[s:s + chunk]
            n = hc.shape[0]
            t = _t_chunk(hc, Bt)  # (n, K, V_b)
            K = t.shape[1]  # Σ_n T[n]·G[n]ᵀ as one GEMM: (K, n·V_b) @ (n·V_b, V_a)
            gA2 += t.transpose(0, 1).reshape(K, n * Vb) @ gc.transpose(1, 2).reshape(n * Vb, Va)
            gt = A2 @ gc  # (n, K, V_b)
            gt = gt.reshape(n * Ea, r * Vb)  # rows (n, i), cols (r, b)
            gh[s:s + chunk] = (gt @ Bm.t()).reshape(n, Ea, Eb)
            gBm += hc.reshape(n * Ea, Eb).t() @ gt
        gA = gA2.reshape(Ea, r, Va).permute(2, 0, 1)
        gBt = gBm.reshape(Eb, r, Vb).permute(2, 1, 0)
        gh = gh.reshape(N, Ea * Eb)[:, :D]
        return gh, gA, gBt, None, None, None


def decode_path(rows: int, Va: int, Ea: int, r: int, Vb: int, Eb: int,
                chunk: int | None = None) -> str:
    """``"tt"`` or ``"table"``: the path that holds fewer elements for ``rows`` hidden
    states. Table: ``E`` and its gradient, ``2·Va·Vb·Ea·Eb``. TT: two chunks of ``T``
    (forward and backward), ``2·min(rows, chunk)·Ea·r·Vb``. (The logits, ``rows × V``,
    are the same on both.)"""
    per_row = Ea * r * Vb
    chunk = chunk or max(1, CHUNK_ELEMENTS // max(1, per_row))
    return "tt" if 2 * min(rows, chunk) * per_row < 2 * Va * Vb * Ea * Eb else "table"


def ttm_decode(h: Tensor, cores: list[Tensor], split: int, num_rows: int,
               pad_row: int | None = None, chunk: int | None = None,
               path: str = "auto") -> Tensor:
    """``h (N, D) · Eᵀ -> (N, num_rows)`` for the TTM table of (gated) ``cores``
    ``(r, v_k, e_k, r')``, split into half tables after core ``split`` (see the module
    doc). ``chunk``: rows of ``h`` per recomputed ``T`` block (default: ``T`` blocks of
    :data:`CHUNK_ELEMENTS`). ``path``: ``"tt"`` (the contraction), ``"table"`` (build
    ``E``: :func:`ttm_decode_reference`) or ``"auto"`` (:func:`decode_path`: the one that
    holds less memory; a small vocabulary's table is cheaper than ``T``)."""
    if h.dim() != 2:
        raise ValueError(f"h: expected (N, D), got shape {tuple(h.shape)}")
    if path not in ("auto", "tt", "table"):
        raise ValueError(f"path: expected auto, tt or table, got {path!r}")
    A, Bt = merge_tables(cores, split)
    A, Bt = A.to(h.dtype), Bt.to(h.dtype)
    (Va, Ea, r), (Vb, _, Eb) = A.shape, Bt.shape
    if path == "auto":
        path = decode_path(h.shape[0], Va, Ea, r, Vb, Eb, chunk)
    if path == "table":
        return _table_decode(h, A, Bt, num_rows, pad_row)
    if chunk is None:
        chunk = max(1, CHUNK_ELEMENTS // max(1, Ea * r * Vb))
    return TTMDecode.apply(h, A, Bt, num_rows, pad_row, chunk)


def _table_decode(h: Tensor, A: Tensor, Bt: Tensor, num_rows: int,
                  pad_row: int | None) -> Tensor:
    Va, Ea, r = A.shape
    Vb, _, Eb = Bt.shape
    E = torch.einsum("air,brj->abij", A, Bt).reshape(Va * Vb, Ea * Eb)
    E = E[:num_rows, : h.shape[1]].to(h.dtype)
    if pad_row is not None:
        keep = torch.ones(num_rows, 1, dtype=E.dtype, device=E.device)
        keep[pad_row] = 0
        E = E * keep
    return h @ E.t()


def ttm_decode_reference(h: Tensor, cores: list[Tensor], split: int, num_rows: int,
                         pad_row: int | None = None) -> Tensor:
    """The plain path: build ``E`` (``V × D``) from the half tables, then ``h · Eᵀ``."""
    A, Bt = merge_tables(cores, split)
    return _table_decode(h, A, Bt, num_rows, pad_row)
